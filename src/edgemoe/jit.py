"""numba's `njit` for the compiled hot loops (simulator waves, SlimCaching's DP and beam), and whether it is real.

numba is a dependency; without it `njit` leaves functions as plain Python, so the package still imports and
the callers that keep a numpy path (`HAVE_NUMBA` False) take it. `UnliteralStructRef` (numba only) is the
base of the compiled loops' table StructRefs.
"""

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a dependency
    HAVE_NUMBA = False

    def njit(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda f: f)


if HAVE_NUMBA:
    from numba.core import types as _types

    class UnliteralStructRef(_types.StructRef):
        """A numba StructRef type whose fields are typed without their literal values: a table group holding an
        int or a bool (a layer count, a flag) then gives one type, so one compiled signature, whatever the value."""

        def preprocess_fields(self, fields):
            return tuple((name, _types.unliteral(typ)) for name, typ in fields)


__all__ = ["HAVE_NUMBA", "njit"]
