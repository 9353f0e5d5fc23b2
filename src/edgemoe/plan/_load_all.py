"""Import every planner module so that its @register runs. Planner modules add themselves here."""

import importlib
import pkgutil

import edgemoe.plan as _pkg

for _info in pkgutil.iter_modules(_pkg.__path__):
    if not _info.name.startswith("_") and _info.name not in {"base", "cli", "synthetic"}:
        importlib.import_module(f"edgemoe.plan.{_info.name}")
