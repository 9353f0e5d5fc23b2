"""The look-ahead's exposure tables (`LookAhead`, backlog) in compressed rows.

exposure[l](h, g, key) [N] is the expected number of layers l .. l+H-1 whose slowest output is computed on each
node, for a token at node g with look-ahead key `key` whose home has row h (one row for every home where layer l's
tables do not depend on the home). A token's next H layers reach a few nodes, not all N, so each row is kept as
its nonzero entries, nodes ascending: memory and the per-decision dot product scale with what a token can reach
instead of with N (at 256 nodes and 256 homes the dense tables took gigabytes). The wait a row is priced at,
exposure . waits, is summed over the entries in node order, starting from 0.0: the same bits as the dense sum
over every node left to right (adding an exact +0.0 changes no sum), in numpy (`Exposure.wait`) and in the
compiled decision (`ordermoe_kernel._backlog_s`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class ExposureLayer(NamedTuple):
    """One layer's rows: `homes` (1 or Nh) x N x C rows, row (h * N + g) * C + key holding the entries
    ptr[row] .. ptr[row + 1] of node [nnz] and val [nnz]."""

    homes: int
    ptr: np.ndarray  # [homes * N * C + 1] int64
    node: np.ndarray  # [nnz] int64, ascending within a row
    val: np.ndarray  # [nnz] float

    @staticmethod
    def from_dense(blocks, n: int, c: int) -> ExposureLayer:
        """The rows of dense per-home blocks (an iterable of [N, C, N] arrays, one per home row)."""
        ptrs, nodes, vals, base, homes = [np.zeros(1, np.int64)], [], [], 0, 0
        for block in blocks:
            flat = np.asarray(block, float).reshape(n * c, n)
            row, node = np.nonzero(flat)  # row-major: rows ascending, nodes ascending within each
            ptrs.append(base + np.cumsum(np.bincount(row, minlength=n * c)))
            nodes.append(node.astype(np.int64))
            vals.append(flat[row, node])
            base += len(row)
            homes += 1
        return ExposureLayer(homes, np.concatenate(ptrs), np.concatenate(nodes) if nodes else np.zeros(0, np.int64),
                             np.concatenate(vals) if vals else np.zeros(0))

    @staticmethod
    def empty(n: int, c: int) -> ExposureLayer:
        """A layer with no exposure (past the last layer, or layer 0, which no decision looks up)."""
        return ExposureLayer(1, np.zeros(n * c + 1, np.int64), np.zeros(0, np.int64), np.zeros(0))

    def dense(self, h: int, n: int, c: int) -> np.ndarray:
        """[N, C, N] the rows of home row h (row 0 where the layer has one for every home)."""
        h = h if self.homes > 1 else 0
        ptr = self.ptr[h * n * c:(h + 1) * n * c + 1]
        out = np.zeros((n * c, n))
        rows = np.repeat(np.arange(n * c), np.diff(ptr))
        out[rows, self.node[ptr[0]:ptr[-1]]] = self.val[ptr[0]:ptr[-1]]
        return out.reshape(n, c, n)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (wrapping): nearby inputs get unrelated outputs."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shared_rows(ptr: np.ndarray, node: np.ndarray, val: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(span [R, 2] int32 (int64 past 2^31 entries), node [u], val [u]): the R rows ptr[r] .. ptr[r + 1] of (node, val) with every set of
    identical rows (the same nodes and the same value bits, in order) stored once, row r then reading entries
    span[r, 0] .. span[r, 1]. Why: at hundreds of nodes most per-home rows repeat (a far home changes no
    action: 1.06M rows hold 44k distinct ones at 256 nodes), and the distinct entries fit in cache where all of
    them do not. Rows are grouped by a 64-bit hash of their entries and each is compared with its group's first
    row in full, so a hash collision only keeps a row apart, never merges different ones. Kept rows are stored
    in row order (the result depends on nothing but the input)."""
    rows = len(ptr) - 1
    count = np.diff(ptr)
    row_of = np.repeat(np.arange(rows), count)  # [nnz]
    pos = np.arange(len(val)) - ptr[row_of]  # each entry's place in its row
    bits = np.ascontiguousarray(val, np.float64).view(np.uint64)
    entry = _mix(bits ^ _mix(node.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + pos.astype(np.uint64)))
    summed = np.concatenate([np.zeros(1, np.uint64), np.cumsum(entry, dtype=np.uint64)])  # (wraps: a sum mod 2^64)
    row_hash = _mix((summed[ptr[1:]] - summed[ptr[:-1]]) ^ count.astype(np.uint64))
    _, first, inverse = np.unique(row_hash, return_index=True, return_inverse=True)
    rep = first[inverse.reshape(-1)]  # [R] each row's group's first row
    same = count == count[rep]
    at = ptr[rep[row_of]] + pos  # [nnz] the entry of the group's first row at the same place
    at = np.where(same[row_of], at, np.arange(len(val)))
    differs = (node[at] != node) | (bits[at] != bits)
    same &= np.bincount(row_of, differs, minlength=rows) == 0
    rep = np.where(same, rep, np.arange(rows))  # (a collision: the row keeps its own entries)
    own = rep == np.arange(rows)
    start = np.zeros(rows, np.int64)
    start[own] = np.concatenate([[0], np.cumsum(count[own])[:-1]]) if own.any() else 0
    keep = own[row_of]
    span = np.stack([start[rep], start[rep] + count], axis=1)
    span = span.astype(np.int32 if len(span) == 0 or span.max() < 2**31 else np.int64)  # (int32: half the misses' bytes)
    return span, node[keep], val[keep]


class Exposure:
    """Every layer's `ExposureLayer` packed into flat arrays: layer l's rows start at base[l] and number
    homes[l] x N x C; row base[l] + (h' * N + g) * C + key with h' the home's row where homes[l] > 1, else 0,
    holding entries span[row, 0] .. span[row, 1] of node and val (identical rows share theirs: `shared_rows`)."""

    def __init__(self, layers: dict[int, ExposureLayer], num_layers: int, n: int, c: int):
        self.n, self.c = n, c
        per = [layers.get(layer) or ExposureLayer.empty(n, c) for layer in range(num_layers + 1)]
        self.homes = np.array([x.homes for x in per], np.int64)  # [L+1]
        self.base = np.concatenate([[0], np.cumsum(self.homes * n * c)]).astype(np.int64)  # [L+2] first row per layer
        offsets = np.concatenate([[0], np.cumsum([len(x.val) for x in per])]).astype(np.int64)
        ptr = np.concatenate([per[0].ptr[:1]] + [x.ptr[1:] + off for x, off in zip(per, offsets[:-1], strict=True)])
        self.span, self.node, self.val = shared_rows(ptr, np.concatenate([x.node for x in per]).astype(np.int64),
                                                     np.concatenate([x.val for x in per]).astype(float))
        self.layers = per

    @property
    def count(self) -> np.ndarray:
        """[rows] entries per row."""
        return self.span[:, 1] - self.span[:, 0]

    @property
    def nbytes(self) -> int:
        return self.span.nbytes + self.node.nbytes + self.val.nbytes

    def rows(self, layer: np.ndarray, home_row: np.ndarray, nodes: np.ndarray, key: np.ndarray) -> np.ndarray:
        """[T, G] row of each (layer [T], home row [T], node [T, G], key [T])."""
        h = np.where(self.homes[layer] > 1, home_row, 0)
        return self.base[layer][:, None] + (h[:, None] * self.n + nodes) * self.c + key[:, None]

    def wait(self, layer: np.ndarray, home_row: np.ndarray, nodes: np.ndarray, key: np.ndarray,
             load: np.ndarray) -> np.ndarray:
        """[T, G] exposure . load of each row (`rows`), summed over its entries in node order from 0.0. load: [N]
        waits for every row, or [T, N] each row's own (the `mean` term's per-row EWMA)."""
        rows = self.rows(layer, home_row, nodes, key)
        start, count = self.span[rows, 0].astype(np.int64), (self.span[rows, 1] - self.span[rows, 0]).astype(np.int64)
        width = int(count.max()) if count.size else 0
        if width == 0:  # (no entry in any asked row; also when there are none at all)
            return np.zeros(rows.shape)
        k = np.arange(width)
        idx = np.minimum(start[..., None] + k, len(self.val) - 1)  # [T, G, width]
        if load.ndim == 1:
            seen = load[self.node[idx]]
        else:  # row t of the call reads load[t]
            seen = load[np.arange(rows.shape[0]).reshape((-1,) + (1,) * (idx.ndim - 1)), self.node[idx]]
        terms = np.where(k < count[..., None], self.val[idx] * seen, 0.0)
        # 0.0 first, then each term in order: the compiled loop's sum (cumsum is sequential, unlike sum)
        return np.cumsum(np.concatenate([np.zeros(rows.shape + (1,)), terms], axis=-1), axis=-1)[..., -1]

    def dense(self) -> np.ndarray:
        """[L+1, Hmax, N, C, N] every row, a one-home layer's repeated in every home row (tests, inspection: the
        memory the compressed rows save)."""
        hmax = int(self.homes.max())
        return np.stack([np.stack([x.dense(h, self.n, self.c) for h in range(hmax)]) for x in self.layers])
