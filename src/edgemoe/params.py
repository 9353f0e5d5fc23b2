"""`key=value` parameters given on the command line (planner, policy and method options)."""

from __future__ import annotations

from edgemoe.errors import EdgeMoEError

INT32_MAX = 2**31 - 1  # every integer parameter is a count, a seed or a limit that fits a C int


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
        from edgemoe.io import loads_json

        try:
            return loads_json(raw, "parameter value", line_numbers=False)  # the document limits apply here too
        except EdgeMoEError as exc:
            raise EdgeMoEError(f"{exc} (a value that looks like JSON: {raw[:60]!r})") from None
    return raw


# ------------------------------------------------------------------------------------------ validation

def _param_types() -> dict:
    """Type and range of every planner/policy parameter name, shared by all that take it.

    A name listed here overrides the function's own annotation (which says the type but not the range);
    other names are checked against the annotation alone. Every float must be finite.
    """
    from typing import Annotated, Literal

    from pydantic import Field

    def num(kind, **limits):
        if kind is int:  # counts and seeds reach HiGHS and numpy as C ints: keep them in int32
            limits.setdefault("le", INT32_MAX)
        return Annotated[kind, Field(**limits)]

    nonneg_float = num(float, ge=0)
    return {
        # planners
        "time_limit": num(float, gt=0), "node_limit": num(int, ge=1), "refine_work": num(float, ge=0), "k1_seeds": num(int, ge=0), "k1_max_seeds": num(int, ge=1), "mip_rel_gap": num(float, ge=0, lt=1),
        "seed": num(int, ge=0), "kicks": num(int, ge=0), "forced": num(int, ge=0), "passes": num(int, ge=1),
        "enum_max": num(int, ge=1), "beam_width": num(int, ge=1), "max_units": num(int, ge=1),
        "epsilon": num(float, gt=0, le=1),
        "theta_hi": num(float, ge=-1, le=1), "theta_lo": num(float, ge=-1, le=1), "theta": num(float, ge=-1, le=1) | None,
        "groups_per_layer": num(int, ge=1) | None, "max_group_size": num(int, ge=1) | None,
        "eta": nonneg_float, "gamma": nonneg_float, "rep_weight": nonneg_float,
        # runtime policies
        "budget": nonneg_float | list[nonneg_float] | Literal["paper", "strict"], "horizon": num(int, ge=0, le=16), "levels": num(int, ge=2, le=4096),
        "quality_price": nonneg_float | None, "pressure_gain": nonneg_float, "sets_per_prev": num(int, ge=1),
        "max_enum_k": num(int, ge=1), "ewma": num(float, gt=0, le=1),
    }


def _signature_fields(fn, skip: int) -> dict:
    """name -> (annotation, default) of `fn`'s parameters after the first `skip` (for a class: __init__'s)."""
    import inspect
    import typing

    target = fn.__init__ if inspect.isclass(fn) else fn
    params = list(inspect.signature(target).parameters.values())[skip + (1 if inspect.isclass(fn) else 0):]
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # an annotation that cannot be resolved: fall back to "any value"
        hints = {}
    fields = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        fields[p.name] = (hints.get(p.name, typing.Any), p.default)
    return fields


def validate_params(fn, params: dict, owner: str, flag: str = "--param", skip: int = 1) -> dict:
    """Check `params` against what `fn` (a planner function or a policy class) takes; return them typed.

    Unknown names are an error that lists the valid ones; each value must have the parameter's type and
    lie in its range (`_param_types`), floats finite, integers within int32 (HiGHS takes its limits as C ints). `owner` names fn in messages ("planner 'exact'").
    """
    import typing
    from typing import Annotated

    from pydantic import ConfigDict, Field, ValidationError, create_model

    fields = _signature_fields(fn, skip)
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise EdgeMoEError(f"{owner} does not take {flag} {', '.join(unknown)}; valid: {', '.join(fields) or '(none)'}")
    types = _param_types()
    spec = {}
    for name in params:
        annotation, _default = fields[name]
        if annotation is int:
            annotation = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
        spec[name] = (types.get(name, annotation), ...)
    model = create_model("Params", __config__=ConfigDict(allow_inf_nan=False, arbitrary_types_allowed=True), **spec)
    try:
        checked = model(**params)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else "?"
        expected = _describe_type(types.get(name, fields.get(name, (typing.Any,))[0]))
        raise EdgeMoEError(f"{flag} {name}={params.get(name)!r} for {owner}: {err['msg'].lower()} "
                           f"(expected {expected})") from None
    return {name: getattr(checked, name) for name in params}


def _describe_type(annotation) -> str:
    """A short human description of a parameter type, e.g. 'int >= 0' or 'float > 0, or none'."""
    import typing

    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *meta = args
        limits = []
        for m in meta:
            for item in getattr(m, "metadata", []):
                for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                    if getattr(item, attr, None) is not None:
                        limits.append(f"{sym} {getattr(item, attr)}")
        return f"{base.__name__} {' and '.join(limits)}".strip()
    if args and origin is not list:
        parts = [("none" if a is type(None) else _describe_type(a)) for a in args]
        return " or ".join(parts)
    if origin is list:
        return f"a list of {_describe_type(args[0])}" if args else "a list"
    return getattr(annotation, "__name__", str(annotation))
