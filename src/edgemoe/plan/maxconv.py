"""(max,+) convolution and the multiple-choice knapsack over layers (ALGORITHMS.md §2.5.3–2.5.4).

A server's subproblem picks one budget c_l per layer with sum_l c_l <= C to maximise sum_l V_l(c_l),
given per-layer value tables V [L, C+1]. Three solvers:
- `naive`: the exact DP, D_l = D_{l-1} (+) V_l by the O(C^2) (max,+) convolution (the reference);
- `concave`: exact and O(C log C) when every table is concave: merge the increment sequences;
- `fptas`: value rounding with parameter epsilon; result >= (1 - epsilon) * optimum, polynomial in L/eps.
"""

from __future__ import annotations

import numpy as np

CONCAVITY_TOL = 1e-12  # relative slack when checking that increments never increase


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


def solve_layers_dp(tables: np.ndarray, method: str = "naive") -> np.ndarray:
    """Budgets [L] maximising sum_l tables[l, c_l] s.t. sum c_l <= C, by exact (max,+) DP.

    tables: [L, C+1]. method "naive" or "concave" (the latter requires concave tables).
    """
    tables = np.asarray(tables, dtype=np.float64)
    conv = maxconv_concave if method == "concave" else maxconv_naive
    L = tables.shape[0]
    best = tables[0]
    args = []
    for layer in range(1, L):
        best, arg = conv(best, tables[layer])
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


def solve_layers(tables: np.ndarray, method: str = "auto", epsilon: float = 0.1) -> tuple[np.ndarray, str]:
    """Budgets [L] for tables [L, C+1] and the method used.

    method: "naive" (exact reference), "concave" (exact, requires concave tables), "fptas", or "auto"
    (concave when every table passes the concavity check, else naive).
    """
    if method == "auto":
        method = "concave" if all(is_concave(t) for t in tables) else "naive"
    if method == "fptas":
        return solve_layers_fptas(tables, epsilon), method
    if method not in ("naive", "concave"):
        raise ValueError(f"unknown max-convolution method {method!r}; expected auto, naive, concave or fptas")
    return solve_layers_dp(tables, method), method
