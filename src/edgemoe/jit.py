"""numba's `njit` for the compiled hot loops (simulator waves, SlimCaching's DP and beam), and whether it is real.

numba is a dependency; without it `njit` leaves functions as plain Python, so the package still imports and
the callers that keep a numpy path (`HAVE_NUMBA` False) take it.
"""

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a dependency
    HAVE_NUMBA = False

    def njit(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda f: f)


__all__ = ["HAVE_NUMBA", "njit"]
