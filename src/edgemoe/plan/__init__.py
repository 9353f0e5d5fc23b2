"""Planners: which node holds which experts (numpy/scipy only, no torch)."""

from .base import Placement, PlanProblem, load_placement, plan, planners, register
from .problem import plan_problem

__all__ = ["Placement", "PlanProblem", "load_placement", "plan", "plan_problem", "planners", "register"]
