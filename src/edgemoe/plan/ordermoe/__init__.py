"""OrderMoE's planner: the placement search (`planner`, `search`), the runtime model it prices a placement
with (`runtime_model`) and the stand-in costs it shares with the runtime policy (`standins`)."""
