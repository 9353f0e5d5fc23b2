"""edgemoe.jit: `prefetch` is a cache hint inside compiled code; it changes no value and takes only a 1-D array."""

import numpy as np
import pytest

from edgemoe.jit import HAVE_NUMBA, njit, prefetch

pytestmark = pytest.mark.skipif(not HAVE_NUMBA, reason="numba is a dependency; without it prefetch is a no-op")


@njit
def _gather_with_prefetch(a, idx):  # pragma: no cover - compiled
    for i in range(idx.shape[0]):
        prefetch(a, idx[i])
    out = np.empty(idx.shape[0])
    for i in range(idx.shape[0]):
        out[i] = a[idx[i]]
    return out


@njit
def _prefetch_2d(a):  # pragma: no cover - compiled
    prefetch(a, 0)


def test_prefetch_changes_no_value():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(100_000)
    idx = rng.integers(0, a.size, 2_000)
    np.testing.assert_array_equal(_gather_with_prefetch(a, idx), a[idx])
    # read-only arrays and int32 indices type too (the kernel passes both)
    a.flags.writeable = False
    np.testing.assert_array_equal(_gather_with_prefetch(a, idx.astype(np.int32)), a[idx])


def test_prefetch_takes_only_a_one_dimensional_array():
    from numba.core.errors import TypingError

    with pytest.raises(TypingError):
        _prefetch_2d(np.zeros((2, 2)))
