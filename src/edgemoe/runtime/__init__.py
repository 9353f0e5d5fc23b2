"""Runtime: policies that decide per token and layer where each expert runs, and the backends that run them."""

from .context import RuntimeContext, context_from_problem, make_context
from .policy import Decision, Policy, TokenState
from .registry import make_policy, policy_names, register_policy

__all__ = ["Decision", "Policy", "RuntimeContext", "TokenState", "context_from_problem", "make_context", "make_policy", "policy_names",
           "register_policy"]
