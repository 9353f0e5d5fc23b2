"""numba's `njit` for the compiled hot loops (simulator waves, SlimCaching's DP and beam), and whether it is real.

numba is a dependency; without it `njit` leaves functions as plain Python, so the package still imports and
the callers that keep a numpy path (`HAVE_NUMBA` False) take it. `UnliteralStructRef` (numba only) is the
base of the compiled loops' table StructRefs; `prefetch` is a cache hint for compiled code.
"""

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a dependency
    HAVE_NUMBA = False

    def njit(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda f: f)


if HAVE_NUMBA:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cgutils
    from numba.core import types as _types
    from numba.extending import intrinsic as _intrinsic

    class UnliteralStructRef(_types.StructRef):
        """A numba StructRef type whose fields are typed without their literal values: a table group holding an
        int or a bool (a layer count, a flag) then gives one type, so one compiled signature, whatever the value."""

        def preprocess_fields(self, fields):
            return tuple((name, _types.unliteral(typ)) for name, typ in fields)

    @_intrinsic
    def prefetch(typingctx, arr, index):
        """(compiled code) Ask the CPU to bring the cache line of arr[index] (a 1-D array, 0 <= index < len) in
        for reading, and go on: LLVM's llvm.prefetch, which changes no value. Why: a load that misses the cache
        holds up the instructions after it once the reorder buffer is full; a prefetch issued early lets the miss
        overlap with the work between it and the load."""
        if not (isinstance(arr, _types.Array) and arr.ndim == 1 and isinstance(index, _types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = _cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
            i8p, i32 = _ir.IntType(8).as_pointer(), _ir.IntType(32)
            fn = _cgutils.get_or_insert_function(builder.module, _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0")
            # (address, 0: for reading, 3: keep in every cache level, 1: data)
            builder.call(fn, [builder.bitcast(ptr, i8p), _ir.Constant(i32, 0), _ir.Constant(i32, 3), _ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return _types.none(arr, index), codegen
else:  # pragma: no cover - numba is a dependency

    def prefetch(arr, index):
        """Without numba: nothing to do."""


__all__ = ["HAVE_NUMBA", "njit", "prefetch"]
