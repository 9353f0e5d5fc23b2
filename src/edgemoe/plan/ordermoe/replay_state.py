"""The per-row outcome of a `PathModel` replay (its own module so that the replay's units can name it
without importing the model that combines them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Replay:
    """Per-row outcome of a replay. R rows, L layers."""

    latency_s: np.ndarray  # [R, L] seconds of each layer
    location: np.ndarray  # [R, L+1] node at the start of each layer (column L: after the last layer)
    budget_left: np.ndarray  # [R, L+1] remaining quality budget at the start of each layer
    # [R, L] each decision's budget bounds (`replay_kernel`, "Budget bounds"): the compiled replay's only
    q_need: np.ndarray | None = None
    q_block: np.ndarray | None = None
