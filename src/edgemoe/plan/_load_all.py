"""Import every planner module so that its @register runs. A new planner module adds itself here.

The order is the registry's order (`planners()` lists planners in it): the baseline heuristics, the ILP,
SlimCaching and its two baselines, OrderMoE.
"""

import importlib

PLANNER_MODULES = (
    "edgemoe.plan.baselines.heuristics",
    "edgemoe.plan.exact",
    "edgemoe.plan.slimcaching.planner",
    "edgemoe.plan.baselines.greedy",
    "edgemoe.plan.ordermoe.planner",
    "edgemoe.plan.baselines.ushaped",
)

for _name in PLANNER_MODULES:
    importlib.import_module(_name)
