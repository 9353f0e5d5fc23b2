"""The policy registry: names -> Policy classes, and `make_policy`.

Imports run one way: registry -> the policy modules (baselines, ordermoe, oracle, field_baselines in runtime.policies) -> policy (the interface)
-> context. The policy modules know nothing of the registry; each class carries its `name`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from edgemoe.errors import EdgeMoEError
from edgemoe.params import validate_params

from .context import RuntimeContext
from .policies.baselines import DropPolicy, ExactPolicy, SlimCachingPolicy
from .policies.field_baselines import (
    OrderMoECalibratedPolicy,
    OrderMoEErrorGroupsPolicy,
    RandomLocalPolicy,
    RerouteLocalPolicy,
    SkipPolicy,
)
from .policies.oracle import OraclePolicy
from .policies.ordermoe import OrderMoEPolicy
from .policy import Policy

_POLICIES: dict[str, Callable[..., Policy]] = {cls.name: cls for cls in (
    ExactPolicy, SlimCachingPolicy, DropPolicy, OrderMoEPolicy, OraclePolicy,
    SkipPolicy, RerouteLocalPolicy, RandomLocalPolicy, OrderMoEErrorGroupsPolicy, OrderMoECalibratedPolicy)}


def register_policy(name: str):
    """Class decorator for policies defined elsewhere: make a Policy subclass available to `make_policy(name)`."""

    def deco(cls):
        if name in _POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return deco


def policy_names() -> list[str]:
    return sorted(_POLICIES)


# Policies that take a `budget` but never spend it (they never substitute or zero an expert); every other
# policy with a `budget` spends it, and one not given a budget takes the placement's (`make_policy`).
BUDGET_FREE = frozenset({"exact", "slimcaching", "drop"})


def make_policy(name: str, ctx: RuntimeContext, **params) -> Policy:
    """The policy called `name` (see `policy_names()`) on `ctx` with `params`.

    A policy that spends a budget (not BUDGET_FREE) and is given none serves at the budget the placement was
    planned for (ctx.placement_budget), when its planner had one; otherwise at the policy's own default."""
    if name not in _POLICIES:
        raise EdgeMoEError(f"unknown policy {name!r}; expected one of {policy_names()}")
    if ("budget" not in params and name not in BUDGET_FREE and ctx.placement_budget is not None
            and "budget" in inspect.signature(_POLICIES[name]).parameters):
        params = {**params, "budget": ctx.placement_budget}
    try:
        return _POLICIES[name](ctx, **params)
    except TypeError as exc:
        raise EdgeMoEError(f"policy {name!r}: bad parameters {sorted(params)} ({exc})") from None


def policy_params(policy: str, params: dict, flag: str = "--param") -> dict:
    """`params` typed and range-checked for runtime policy `policy` (unknown policy: names the valid ones).

    Lives beside the registry (not in edgemoe.params) so the parameter helpers import nothing above them.
    """
    names = policy_names()
    if policy not in names:
        raise EdgeMoEError(f"unknown policy {policy!r}; expected one of {', '.join(names)}")
    return validate_params(_POLICIES[policy], params, f"policy {policy!r}", flag=flag)
