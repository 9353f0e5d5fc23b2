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


class Exposure:
    """Every layer's `ExposureLayer` packed into flat arrays: layer l's rows start at base[l] and number
    homes[l] x N x C; row base[l] + (h' * N + g) * C + key with h' the home's row where homes[l] > 1, else 0."""

    def __init__(self, layers: dict[int, ExposureLayer], num_layers: int, n: int, c: int):
        self.n, self.c = n, c
        per = [layers.get(layer) or ExposureLayer.empty(n, c) for layer in range(num_layers + 1)]
        self.homes = np.array([x.homes for x in per], np.int64)  # [L+1]
        self.base = np.concatenate([[0], np.cumsum(self.homes * n * c)]).astype(np.int64)  # [L+2] first row per layer
        offsets = np.concatenate([[0], np.cumsum([len(x.val) for x in per])]).astype(np.int64)
        self.ptr = np.concatenate([per[0].ptr[:1]] + [x.ptr[1:] + off for x, off in zip(per, offsets[:-1], strict=True)])
        self.node = np.concatenate([x.node for x in per]).astype(np.int64)
        self.val = np.concatenate([x.val for x in per]).astype(float)
        self.layers = per

    @property
    def nbytes(self) -> int:
        return self.ptr.nbytes + self.node.nbytes + self.val.nbytes

    def rows(self, layer: np.ndarray, home_row: np.ndarray, nodes: np.ndarray, key: np.ndarray) -> np.ndarray:
        """[T, G] row of each (layer [T], home row [T], node [T, G], key [T])."""
        h = np.where(self.homes[layer] > 1, home_row, 0)
        return self.base[layer][:, None] + (h[:, None] * self.n + nodes) * self.c + key[:, None]

    def wait(self, layer: np.ndarray, home_row: np.ndarray, nodes: np.ndarray, key: np.ndarray,
             load: np.ndarray) -> np.ndarray:
        """[T, G] exposure . load of each row (`rows`), summed over its entries in node order from 0.0."""
        rows = self.rows(layer, home_row, nodes, key)
        start, count = self.ptr[rows], self.ptr[rows + 1] - self.ptr[rows]
        width = int(count.max()) if count.size else 0
        if width == 0:  # (no entry in any asked row; also when there are none at all)
            return np.zeros(rows.shape)
        k = np.arange(width)
        idx = np.minimum(start[..., None] + k, len(self.val) - 1)  # [T, G, width]
        terms = np.where(k < count[..., None], self.val[idx] * load[self.node[idx]], 0.0)
        # 0.0 first, then each term in order: the compiled loop's sum (cumsum is sequential, unlike sum)
        return np.cumsum(np.concatenate([np.zeros(rows.shape + (1,)), terms], axis=-1), axis=-1)[..., -1]

    def dense(self) -> np.ndarray:
        """[L+1, Hmax, N, C, N] every row, a one-home layer's repeated in every home row (tests, inspection: the
        memory the compressed rows save)."""
        hmax = int(self.homes.max())
        return np.stack([np.stack([x.dense(h, self.n, self.c) for h in range(hmax)]) for x in self.layers])
