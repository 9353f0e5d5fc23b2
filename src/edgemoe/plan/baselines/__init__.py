"""Baseline planners: uniform, random, lfu, activation-aware, eplb, affinity (`heuristics`), and the two
baselines of the SlimCaching paper, `greedy` and `u-shaped`."""
