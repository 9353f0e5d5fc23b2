"""`key=value` parameters given on the command line (planner, policy and method options)."""

from __future__ import annotations

import json

from edgemoe.errors import EdgeMoEError


def parse_params(items: list[str] | None, flag: str = "--param") -> dict:
    """["k=v", ...] -> {k: v}, each value read by `parse_value`. `flag` names the option in errors."""
    params: dict = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise EdgeMoEError(f"{flag} {item!r}: expected key=value")
        if key in params:
            raise EdgeMoEError(f"{flag} {key!r} given twice")
        params[key] = parse_value(raw.strip())
    return params


def parse_value(raw: str):
    """bool, None, int, float, a JSON list/object, or else the string itself.

    true/false/yes/no (any case) are booleans, none/null is None; "1e-3" is a float, "007" the int 7;
    "[0.1, 0.2]" is a list (e.g. one budget per user).
    """
    lowered = raw.lower()
    if lowered in {"true", "yes"}:
        return True
    if lowered in {"false", "no"}:
        return False
    if lowered in {"none", "null"}:
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    if raw and raw[0] in "[{":
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise EdgeMoEError(f"parameter value {raw!r} looks like JSON but is not ({exc})") from None
    return raw
