"""Planners: which node holds which experts (numpy/scipy only, no torch)."""

from .base import Placement, PlanProblem, load_placement, plan, planners, register

__all__ = ["Placement", "PlanProblem", "load_placement", "plan", "planners", "register"]
