"""(max,+) convolution and the multiple-choice knapsack over layers (ALGORITHMS.md §2.5.3–2.5.4).

A server's subproblem picks one budget c_l per layer with sum_l c_l <= C to maximise sum_l V_l(c_l),
given per-layer value tables V [L, C+1]. Three solvers:
- `naive`: the exact DP, D_l = D_{l-1} (+) V_l by the O(C^2) (max,+) convolution (the reference);
- `concave`: exact and O(C log C) when every table is concave: merge the increment sequences;
- `fptas`: value rounding with parameter epsilon; result >= (1 - epsilon) * optimum, polynomial in L/eps;
- `auto`: per convolution step, the fastest exact method whose condition holds: the merge when both
  operands are concave, `maxconv_monotone` (exact, O(C log C)) when the new layer's table is concave and
  the running table is arbitrary, else naive. Which ran is counted (`solve_layers` returns the counts).

Why the monotone path matters here: the running table D (best value of the layers so far per budget) is
seldom concave once a layer's table is convex (co-activated pairs are supermodular: two experts are worth
more than twice one), so the merge rarely applies past the first such layer; but each layer whose table is
concave (K = 1 layers, layers whose sets barely interact, layers with modular gains) still gets an
O(C log C) step instead of O(C^2). That is the max-convolution speed-up for the modular part.
"""

from __future__ import annotations

import numpy as np

from edgemoe.jit import HAVE_NUMBA, njit

CONCAVITY_TOL = 1e-12  # relative slack when checking that increments never increase
STEP_NAMES = ("naive", "concave", "monotone")  # codes of the compiled DP's per-step methods


def is_concave(table: np.ndarray, tol: float = CONCAVITY_TOL) -> bool:
    """True if table [C+1] has non-increasing increments (within tol * scale)."""
    inc = np.diff(np.asarray(table, dtype=np.float64))
    scale = max(float(np.abs(table).max(initial=0.0)), 1e-300)
    return bool(np.all(np.diff(inc) <= tol * scale))


def maxconv_naive(a: np.ndarray, b: np.ndarray, chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """(a (+) b)(c) = max_{j<=c} a[c-j] + b[j] for c in [0, C]; a, b: [C+1] (same length).

    Returns (out [C+1], arg [C+1]) with arg[c] = the j (budget given to b) that attains out[c];
    ties go to the smallest j. O(C^2) time, computed in row chunks to bound memory.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"maxconv_naive: a {a.shape} and b {b.shape} must be 1-D of the same length")
    size = a.shape[0]
    out = np.empty(size)
    arg = np.empty(size, dtype=np.int64)
    j = np.arange(size)
    for start in range(0, size, chunk):
        c = np.arange(start, min(start + chunk, size))[:, None]  # [R, 1]
        cand = np.where(j[None] <= c, a[np.clip(c - j[None], 0, None)] + b[None], -np.inf)  # [R, C+1]
        arg[start:start + c.shape[0]] = cand.argmax(axis=1)
        out[start:start + c.shape[0]] = cand.max(axis=1)
    return out, arg


def maxconv_concave(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Same result as `maxconv_naive` for concave a and b, by merging increments (largest first).

    Raises ValueError if a or b is not concave (the merge would be wrong).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if not (is_concave(a) and is_concave(b)):
        raise ValueError("maxconv_concave: both tables must be concave (non-increasing increments)")
    size = a.shape[0]
    inc = np.concatenate([np.diff(a), np.diff(b)])
    from_b = np.concatenate([np.zeros(size - 1, bool), np.ones(size - 1, bool)])
    order = np.argsort(-inc, kind="stable")[: size - 1]  # the C best increments; ties prefer a
    out = a[0] + b[0] + np.concatenate([[0.0], np.cumsum(inc[order])])
    arg = np.concatenate([[0], np.cumsum(from_b[order])]).astype(np.int64)
    return out, arg


def maxconv_monotone(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Same result as `maxconv_naive` (ties included) when b is concave; a may be anything.

    out(c) = max_{i <= c} a[i] + b[c - i]. With b concave the matrix a[i] + b[c - i] is Monge, so the
    largest maximising i is non-decreasing in c; divide and conquer over c (the middle row first, then
    each half searches only its side of that row's argmax), one level at a time, vectorised over the
    rows of a level: O(C log C). Raises ValueError if b is not concave.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"maxconv_monotone: a {a.shape} and b {b.shape} must be 1-D of the same length")
    if not is_concave(b):
        raise ValueError("maxconv_monotone: b must be concave (non-increasing increments)")
    size = a.shape[0]
    out = np.empty(size)
    best_i = np.empty(size, dtype=np.int64)
    lo_r, hi_r = np.array([0]), np.array([size - 1])  # row (c) ranges of the open segments
    lo_i, hi_i = np.array([0]), np.array([size - 1])  # their argmax search ranges
    while lo_r.size:
        mid = (lo_r + hi_r) // 2
        top = np.minimum(hi_i, mid)  # i <= c
        length = top - lo_i + 1
        seg = np.repeat(np.arange(mid.size), length)
        start = np.cumsum(length) - length
        i = lo_i[seg] + np.arange(seg.size) - start[seg]
        vals = a[i] + b[mid[seg] - i]
        seg_max = np.maximum.reduceat(vals, start)
        arg = np.maximum.reduceat(np.where(vals == seg_max[seg], i, -1), start)  # largest i among ties
        out[mid], best_i[mid] = seg_max, arg
        left = mid > lo_r
        right = mid < hi_r
        lo_r, hi_r, lo_i, hi_i = (np.concatenate([lo_r[left], mid[right] + 1]),
                                  np.concatenate([mid[left] - 1, hi_r[right]]),
                                  np.concatenate([lo_i[left], arg[right]]),
                                  np.concatenate([arg[left], hi_i[right]]))
    return out, np.arange(size) - best_i  # budget given to b, as maxconv_naive reports it


def _conv_step(best: np.ndarray, table: np.ndarray, method: str, best_concave: bool):
    """One (max,+) step under `method`; returns (out, arg, method used, whether out is concave)."""
    if method == "naive":
        return (*maxconv_naive(best, table), "naive", False)
    if method == "concave":
        return (*maxconv_concave(best, table), "concave", True)
    table_concave = is_concave(table)
    if best_concave and table_concave:
        return (*maxconv_concave(best, table), "concave", True)
    if table_concave:
        out, arg = maxconv_monotone(best, table)
        return out, arg, "monotone", False
    return (*maxconv_naive(best, table), "naive", False)


def solve_layers_dp(tables: np.ndarray, method: str = "naive", counts: dict | None = None,
                    compiled: bool | None = None) -> np.ndarray:
    """Budgets [L] maximising sum_l tables[l, c_l] s.t. sum c_l <= C, by exact (max,+) DP.

    tables: [L, C+1]. method "naive", "concave" (requires concave tables) or "auto" (per step, see the
    module docstring). `counts`, if given, is incremented per method used. compiled: run the loop compiled
    (numba; default for naive and auto where numba imports) or in numpy; both give the same budgets,
    step methods and values bit for bit (tested). Why: the refinement solves thousands of small DPs
    (C ~ 10-300), where numpy's per-call overhead is most of the cost.
    """
    tables = np.ascontiguousarray(tables, dtype=np.float64)
    L = tables.shape[0]
    if compiled is None:
        compiled = HAVE_NUMBA and method in ("naive", "auto")
    if compiled:  # the same loop compiled (`_dp_auto_c`): same method per step, same values and ties
        used_ids = np.zeros(max(L - 1, 0), np.int64)
        best, args = _dp_auto_c(tables, method == "auto", CONCAVITY_TOL, used_ids)
        if counts is not None:
            for k in used_ids.tolist():
                name = STEP_NAMES[k]
                counts[name] = counts.get(name, 0) + 1
    else:
        best = tables[0]
        best_concave = method == "auto" and is_concave(best)
        args = []
        for layer in range(1, L):
            best, arg, used, best_concave = _conv_step(best, tables[layer], method, best_concave)
            if counts is not None:
                counts[used] = counts.get(used, 0) + 1
            args.append(arg)
    budgets = np.zeros(L, dtype=np.int64)
    c = int(np.argmax(best))  # tables need not be monotone in tests; take the best total budget
    for layer in range(L - 1, 0, -1):
        budgets[layer] = args[layer - 1][c]
        c -= budgets[layer]
    budgets[0] = c
    return budgets


def solve_layers_fptas(tables: np.ndarray, epsilon: float) -> np.ndarray:
    """Budgets [L] with value >= (1 - epsilon) * optimum, by value rounding (multiple-choice knapsack).

    tables: [L, C+1], each non-decreasing with tables[:, 0] = 0 (a layer may get nothing). Values are
    rounded down to multiples of mu = epsilon * v_max / L, where v_max = max_l tables[l, C] (a feasible
    single-layer solution, so OPT >= v_max); each layer loses < mu, so the total loss < epsilon * OPT.
    The dual DP W[v] = least capacity reaching rounded value v runs over O(L^2 / epsilon) values.
    """
    if not 0 < epsilon < 1:
        raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
    tables = np.asarray(tables, dtype=np.float64)
    L, size = tables.shape
    v_max = float(tables[:, -1].max(initial=0.0))
    if v_max <= 0:
        return np.zeros(L, dtype=np.int64)
    mu = epsilon * v_max / L
    # Candidates per layer: the smallest budget reaching each distinct value (a step of the table).
    cand_budget, cand_rounded = [], []
    for layer in range(L):
        steps = np.concatenate([[0], np.flatnonzero(np.diff(tables[layer]) > 0) + 1])
        cand_budget.append(steps)
        cand_rounded.append(np.floor(np.maximum(tables[layer, steps], 0.0) / mu).astype(np.int64))
    top = int(sum(r.max() for r in cand_rounded))
    least = np.full(top + 1, np.inf)  # least[v]: least capacity reaching rounded value exactly v
    least[0] = 0.0
    picks = np.zeros((L, top + 1), dtype=np.int64)  # index of the candidate used at each layer
    for layer in range(L):
        new = np.full(top + 1, np.inf)
        for idx, (c, r) in enumerate(zip(cand_budget[layer], cand_rounded[layer], strict=True)):
            shifted = np.full(top + 1, np.inf)
            shifted[r:] = least[: top + 1 - r] + c
            better = shifted < new
            new[better] = shifted[better]
            picks[layer, better] = idx
        least = new
    reachable = np.flatnonzero(least <= size - 1)
    v = int(reachable.max())
    budgets = np.zeros(L, dtype=np.int64)
    for layer in range(L - 1, -1, -1):
        idx = picks[layer, v]
        budgets[layer] = cand_budget[layer][idx]
        v -= cand_rounded[layer][idx]
    return budgets


def solve_layers(tables: np.ndarray, method: str = "auto", epsilon: float = 0.1,
                 counts: dict | None = None) -> tuple[np.ndarray, str]:
    """Budgets [L] for tables [L, C+1] and the method used.

    method: "naive" (exact reference), "concave" (exact, requires concave tables), "fptas", or "auto"
    (exact; per step the merge, the monotone path or naive, see the module docstring; reported as
    "concave" when every step merged, "monotone" when some step used it, else "naive"). `counts`, if
    given, is incremented per convolution step and method.
    """
    if method == "fptas":
        return solve_layers_fptas(tables, epsilon), method
    if method not in ("naive", "concave", "auto"):
        raise ValueError(f"unknown max-convolution method {method!r}; expected auto, naive, concave or fptas")
    mine: dict[str, int] = {}
    budgets = solve_layers_dp(tables, method, mine)
    if counts is not None:
        for k, v in mine.items():
            counts[k] = counts.get(k, 0) + v
    if method != "auto":
        return budgets, method
    used = "naive" if mine.get("naive") else "monotone" if mine.get("monotone") else "concave"
    return budgets, used


# ------------------------------------------------------------------ compiled DP (same arithmetic, same ties)


@njit(cache=True)
def _is_concave_c(t, tol):  # pragma: no cover - compiled; tested against is_concave through the DP
    scale = 1e-300
    for k in range(t.size):
        scale = max(scale, abs(t[k]))
    for k in range(t.size - 2):
        if (t[k + 2] - t[k + 1]) - (t[k + 1] - t[k]) > tol * scale:
            return False
    return True


@njit(cache=True)
def _naive_c(a, b, out, arg):  # pragma: no cover
    for c in range(a.size):
        best, at = a[c] + b[0], 0
        for j in range(1, c + 1):
            v = a[c - j] + b[j]
            if v > best:
                best, at = v, j
        out[c], arg[c] = best, at


@njit(cache=True)
def _merge_c(a, b, out, arg):  # pragma: no cover
    size = a.size
    inc = np.empty(2 * (size - 1))
    for k in range(size - 1):
        inc[k] = a[k + 1] - a[k]
        inc[size - 1 + k] = b[k + 1] - b[k]
    order = np.argsort(-inc, kind="mergesort")  # stable: ties prefer a
    base = a[0] + b[0]
    out[0], arg[0] = base + 0.0, 0
    total, from_b = 0.0, 0
    for r in range(size - 1):
        total += inc[order[r]]
        from_b += order[r] >= size - 1
        out[r + 1], arg[r + 1] = base + total, from_b


@njit(cache=True)
def _monotone_c(a, b, out, arg):  # pragma: no cover
    size = a.size
    best_i = np.empty(size, np.int64)
    stack = np.empty((size + 1, 4), np.int64)  # open segments: rows lo..hi, argmax search lo_i..hi_i
    stack[0, 0], stack[0, 1], stack[0, 2], stack[0, 3] = 0, size - 1, 0, size - 1
    n = 1
    while n:
        n -= 1
        lo_r, hi_r, lo_i, hi_i = stack[n, 0], stack[n, 1], stack[n, 2], stack[n, 3]
        mid = (lo_r + hi_r) // 2
        top = min(hi_i, mid)
        best, at = a[lo_i] + b[mid - lo_i], lo_i
        for i in range(lo_i + 1, top + 1):
            v = a[i] + b[mid - i]
            if v >= best:  # largest i among ties
                best, at = v, i
        out[mid], best_i[mid] = best, at
        if mid > lo_r:
            stack[n, 0], stack[n, 1], stack[n, 2], stack[n, 3] = lo_r, mid - 1, lo_i, at
            n += 1
        if mid < hi_r:
            stack[n, 0], stack[n, 1], stack[n, 2], stack[n, 3] = mid + 1, hi_r, at, hi_i
            n += 1
    for c in range(size):
        arg[c] = c - best_i[c]


@njit(cache=True)
def _dp_auto_c(tables, auto, tol, used):  # pragma: no cover
    """solve_layers_dp's loop, compiled: per step the same method choice and arithmetic. used[L-1]: 0 naive,
    1 concave, 2 monotone. Returns (best [C+1], args [L-1, C+1])."""
    L, size = tables.shape
    best = tables[0].copy()
    best_concave = auto and _is_concave_c(best, tol)
    args = np.zeros((max(L - 1, 0), size), np.int64)
    for layer in range(1, L):
        t = tables[layer]
        out = np.empty(size)
        if auto and _is_concave_c(t, tol):
            if best_concave:
                _merge_c(best, t, out, args[layer - 1])
                used[layer - 1] = 1
            else:
                _monotone_c(best, t, out, args[layer - 1])
                used[layer - 1] = 2
                best_concave = False
        else:
            _naive_c(best, t, out, args[layer - 1])
            used[layer - 1] = 0
            best_concave = False
        best = out
    return best, args
