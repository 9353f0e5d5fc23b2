"""The quality dial: a user states quality in the field's unit, a maximum relative perplexity increase
(`max_ppl_increase`), and the dial turns it into a policy's internal budget (issue 19, section 3).

The map comes from a calibration curve: the policy's perplexity increase on calibration text (never the
evaluation text) at a grid of budgets. The curve is made monotone (`curve`): by its running maximum (a budget
is never credited with less harm than a smaller budget showed) or by its isotonic fit (the least-squares
non-decreasing curve: a point measured high by noise is averaged with its neighbours instead of lifting every
larger budget), and the dial returns the largest budget whose credited increase is <= the asked value,
interpolated linearly between the two grid budgets that bracket it. Assumption: the point estimate on calibration text is what the dial aims at (not its 95% upper bound,
which the named operating points `paper`/`strict` use), so the increase measured on other text scatters
around the asked value rather than below it. `raw_monotone` says whether the measured curve needed making
monotone at all (a measured increase that falls with more budget is a defect of the policy, reported,
not hidden).

Per user: `dial.budget(max_ppl_increase)` with a [U] array gives the policy's [U] budgets. A server uses
`dial.mix(max_ppl_increase)` instead: a mixture of the two bracketing grid budgets over a request's token rows
(`edgemoe.distributed.batching.mix_rows`), which lands inside a jump of the curve where no single budget can. Per request:
`dial.grant(state, rows, max_ppl_increase)` sets the budget of one request's rows in a started TokenState.

A dial file (`save_dial` / `load_dial`, schema DIAL_SCHEMA) is the dial plus the deployment it was calibrated
on (`deployment`: what a server checks before it maps a request's `max_ppl_increase` with it; `edgemoe dial`
writes one, `edgemoe serve --dial` reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError

DIAL_SCHEMA = "edgemoe.dial/2"  # /2: the weights digest is read from the checkpoint's files (/1 hashed the loaded model)


@dataclass(frozen=True)
class QualityDial:
    """max_ppl_increase -> budget per token-layer, for one policy on one deployment. G grid points."""

    budgets: np.ndarray  # [G] ascending budgets (the first is 0: exact execution)
    rise: np.ndarray  # [G] measured relative perplexity increase on calibration text at each budget
    policy: str = ""
    calib_tokens: int = 0
    curve: str = "running-max"  # how the measured rise is made monotone: "running-max" or "isotonic"

    def __post_init__(self):
        b, r = np.asarray(self.budgets, float), np.asarray(self.rise, float)
        if b.ndim != 1 or b.shape != r.shape or len(b) < 2 or b[0] != 0 or (np.diff(b) <= 0).any():
            raise EdgeMoEError("dial: budgets must be [G >= 2] ascending from 0, with one rise per budget")
        if not np.isfinite(r).all():
            raise EdgeMoEError("dial: every calibration rise must be finite")
        if self.curve not in CURVES:
            raise EdgeMoEError(f"dial: curve must be one of {CURVES}, got {self.curve!r}")

    @property
    def envelope(self) -> np.ndarray:
        """[G] the monotone curve a budget is credited with, from 0: the running maximum of the calibrated rise,
        or its isotonic (least-squares non-decreasing) fit, floored at 0."""
        r = np.maximum(np.asarray(self.rise, float), 0.0)
        return np.maximum.accumulate(r) if self.curve == "running-max" else isotonic(r)

    @property
    def raw_monotone(self) -> bool:
        """Whether the measured curve never falls as the budget grows (up to 1e-4 of perplexity)."""
        return bool((np.diff(np.asarray(self.rise, float)) >= -1e-4).all())

    def budget(self, max_ppl_increase) -> np.ndarray:
        """[...] the largest budget whose calibrated rise is <= max_ppl_increase [...] (>= 0), interpolated
        linearly inside the bracketing grid step; beyond the last grid point's rise, the last budget."""
        asked = np.asarray(max_ppl_increase, dtype=float)
        if not np.isfinite(asked).all() or (asked < 0).any():
            raise EdgeMoEError(f"max_ppl_increase must be finite and >= 0, got {max_ppl_increase}")
        b, env = np.asarray(self.budgets, float), self.envelope
        # i: the last grid point whose credited rise fits; the next one (if any) does not
        i = np.searchsorted(env, asked, side="right") - 1
        i = np.clip(i, 0, len(b) - 1)
        j = np.minimum(i + 1, len(b) - 1)
        lo, hi = env[i], env[j]
        frac = np.where((j > i) & (hi > lo), (asked - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)
        return np.where(j > i, b[i] + np.clip(frac, 0.0, 1.0) * (b[j] - b[i]), b[i])

    def mix(self, max_ppl_increase) -> tuple[float, float, float]:
        """(low, high, share) for one asked increase: the budgets of the two grid points whose credited rises
        bracket it and the share of token rows to run at `high` (the rest at `low`; edgemoe.distributed.batching.mix_rows deals them) so
        that the mixture's mean extra NLL is the asked one on the calibration curve. Why a mixture, not a budget
        between the two: a policy's rise can jump anywhere between grid points (a whole mechanism becoming
        affordable to every token at once: a cliff), and no single budget lands inside the jump; a mixture of
        rows does, whatever the policy does between them. Mean extra NLL is the rows' mean, so the share is
        linear in nats: share = (log1p(asked) - log1p(rise_low)) / (log1p(rise_high) - log1p(rise_low)).
        Assumption: a row's extra NLL depends on its own budget only (to first order: a degraded row also
        changes the keys and values later rows attend to). Beyond the last credited rise: (top, top, 0)."""
        asked = float(np.asarray(max_ppl_increase, dtype=float))
        if not np.isfinite(asked) or asked < 0:
            raise EdgeMoEError(f"max_ppl_increase must be finite and >= 0, got {max_ppl_increase}")
        b, env = np.asarray(self.budgets, float), self.envelope
        i = int(np.searchsorted(env, asked, side="right")) - 1
        if i < 0:  # below the rise credited to budget 0 (a curve that never starts at 0): exact execution
            return float(b[0]), float(b[0]), 0.0
        if i >= len(b) - 1:
            return float(b[-1]), float(b[-1]), 0.0
        # the first grid point past i whose credited rise is above i's (a plateau's points add nothing)
        j = i + 1 + int(np.argmax(env[i + 1:] > env[i]))
        lo, hi = np.log1p(env[i]), np.log1p(env[j])
        return float(b[i]), float(b[j]), float(np.clip((np.log1p(asked) - lo) / (hi - lo), 0.0, 1.0))

    def grant(self, state, rows, max_ppl_increase, num_layers: int) -> None:
        """Per request: give the TokenState rows `rows` [R] of one request the budget of max_ppl_increase
        (scalar or [R]) for all num_layers layers (before their first layer is decided)."""
        rows = np.asarray(rows, dtype=np.int64)
        if (state.layer[rows] != 0).any():
            raise EdgeMoEError("dial: a request's budget is granted before its first layer")
        state.budget_total[rows] = np.broadcast_to(self.budget(max_ppl_increase), rows.shape) * num_layers

    def to_dict(self) -> dict:
        return {"policy": self.policy, "calib_tokens": self.calib_tokens, "curve": self.curve,
                "budgets": np.asarray(self.budgets).tolist(), "calib_ppl_rel_increase": np.asarray(self.rise).tolist(),
                "credited": self.envelope.tolist(), "raw_monotone": self.raw_monotone}


    @classmethod
    def from_dict(cls, d, where: str = "dial") -> QualityDial:
        """The dial `to_dict` wrote (the measured `calib_ppl_rel_increase`, not the derived `credited`); every
        missing or malformed field is an EdgeMoEError naming it under `where`."""
        if not isinstance(d, dict):
            raise EdgeMoEError(f"{where}: expected an object with budgets and calib_ppl_rel_increase")
        arrays = {}
        for key in ("budgets", "calib_ppl_rel_increase"):
            v = d.get(key)
            if not isinstance(v, list) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
                raise EdgeMoEError(f"{where}.{key}: expected a list of numbers, got {type(v).__name__}")
            arrays[key] = np.asarray(v, dtype=float)
        curve, policy, tokens = d.get("curve", "running-max"), d.get("policy", ""), d.get("calib_tokens", 0)
        if not isinstance(policy, str) or not isinstance(curve, str):
            raise EdgeMoEError(f"{where}.policy and {where}.curve must be strings")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise EdgeMoEError(f"{where}.calib_tokens: expected an integer >= 0, got {tokens!r}")
        try:
            return cls(arrays["budgets"], arrays["calib_ppl_rel_increase"], policy, tokens, curve)
        except EdgeMoEError as exc:
            raise EdgeMoEError(f"{where}: {exc}") from None


CURVES = ("running-max", "isotonic")


def save_dial(path, dial: QualityDial, deployment: dict) -> None:
    """Write a dial file atomically: the dial and the deployment (a JSON object) it was calibrated on."""
    from edgemoe.io import atomic_write_json, jsonable

    if not isinstance(deployment, dict):
        raise EdgeMoEError("save_dial: deployment must be a dict")
    atomic_write_json(path, {"schema": DIAL_SCHEMA, "deployment": jsonable(deployment), "dial": dial.to_dict()})


def load_dial(path) -> tuple[QualityDial, dict]:
    """(the dial, its deployment) from a dial file (`save_dial`); any defect is an EdgeMoEError naming the file."""
    from edgemoe.io import read_json

    doc = read_json(path, "dial file")
    if not isinstance(doc, dict) or doc.get("schema") != DIAL_SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        if got == "edgemoe.dial/1":
            raise EdgeMoEError(f"{path}: a dial file of an older edgemoe (schema 'edgemoe.dial/1', which named the "
                               f"weights differently); run `edgemoe dial` again to make a {DIAL_SCHEMA!r} file")
        raise EdgeMoEError(f"{path}: not a dial file (expected schema {DIAL_SCHEMA!r}, got {got!r})")
    if not isinstance(doc.get("deployment"), dict):
        raise EdgeMoEError(f"{path}: deployment: expected an object (what the dial was calibrated on)")
    return QualityDial.from_dict(doc.get("dial"), where=f"{path}: dial"), doc["deployment"]


def handoff(max_ppl_increase: float, dial: QualityDial, wide: QualityDial | None) -> tuple[bool, float]:
    """(whether `wide` serves it, the budget) for one asked increase: `dial` while the asked value is within its
    largest credited rise on calibration text, else (the asked value is `saturated` for `dial`: its policy has
    nothing left to spend on) `wide`, the dial of the same policy with more mechanisms allowed (empty layers),
    calibrated on the same text. Without `wide`, `dial`'s top budget, its fastest point."""
    saturated = float(max_ppl_increase) > float(dial.envelope[-1])
    use_wide = saturated and wide is not None
    return use_wide, float((wide if use_wide else dial).budget(max_ppl_increase))


def isotonic(y: np.ndarray) -> np.ndarray:
    """[G] the non-decreasing sequence nearest to y [G] in squared error (pool adjacent violators, equal weights).
    Unlike a running maximum, one grid point measured high by noise is averaged with its neighbours instead of
    lifting every larger budget to it."""
    vals: list[float] = []
    sizes: list[int] = []
    for v in np.asarray(y, float):
        vals.append(float(v))
        sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:  # merge the last two blocks into their mean
            n = sizes[-2] + sizes[-1]
            vals[-2:] = [(vals[-2] * sizes[-2] + vals[-1] * sizes[-1]) / n]
            sizes[-2:] = [n]
    return np.repeat(vals, sizes)


def rise_interval(block_extra_nats, level: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Block bootstrap interval of a relative perplexity increase from the per-block mean extra NLL [B] of blocks
    of equal length (blocks, not tokens, are resampled: tokens within a block are correlated)."""
    d = np.asarray(block_extra_nats, dtype=np.float64)
    if d.ndim != 1 or len(d) == 0 or not 0 < level < 1:
        raise EdgeMoEError("rise_interval: block_extra_nats must be [B >= 1] and level in (0, 1)")
    idx = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))
    rise = np.expm1(d[idx].mean(axis=1))
    tail = (1 - level) / 2
    return float(np.quantile(rise, tail)), float(np.quantile(rise, 1 - tail))


def steepest_step(dial: QualityDial, up_to: float, jump: float) -> int | None:
    """The grid step i -> i+1 (i >= 1) where the credited curve turns most sharply: its slope is more than `jump`
    times the previous step's and it rises by more than one point, among the steps starting below `up_to`; the
    sharpest (largest slope ratio) of them, or None. A linear curve has none; a plateau that ends in a jump has one."""
    b, env = np.asarray(dial.budgets, float), dial.envelope
    slope = np.diff(env) / np.diff(b)  # [G-1]
    prev = np.maximum(slope[:-1], 1e-12)  # the slope before each step from the second on
    ratio = slope[1:] / prev
    ok = (env[1:-1] < up_to) & (ratio > jump) & (np.diff(env)[1:] > 0.01)
    return int(np.argmax(np.where(ok, ratio, -np.inf))) + 1 if ok.any() else None


def calibrate_dial(rise_at: Callable[[float], float], budgets, policy: str = "", calib_tokens: int = 0,
                   curve: str = "running-max", refine: int = 0, up_to: float = 0.3, jump: float = 2.0) -> QualityDial:
    """The dial of a policy from `rise_at(budget)` (its perplexity increase on calibration text) on the grid
    `budgets` (0 is added when missing). refine: up to that many more budgets, each the midpoint of the
    sharpest turn of the curve below `up_to` (`steepest_step`), so that an asked value is not interpolated linearly across
    a knee the grid stepped over; the extra points are chosen on the calibration curve alone and counted, not
    timed."""
    if refine < 0 or jump <= 1 or not up_to > 0:
        raise EdgeMoEError(f"calibrate_dial: refine must be >= 0, jump > 1 and up_to > 0 (got {refine}, {jump}, {up_to})")
    grid = np.unique(np.concatenate([[0.0], np.asarray(budgets, float)]))
    rise = np.array([float(rise_at(float(b))) for b in grid])
    dial = QualityDial(grid, rise, policy, calib_tokens, curve)
    for _ in range(refine):
        i = steepest_step(dial, up_to, jump)
        if i is None:
            break
        mid = 0.5 * (grid[i] + grid[i + 1])
        grid, rise = np.insert(grid, i + 1, mid), np.insert(rise, i + 1, float(rise_at(float(mid))))
        dial = QualityDial(grid, rise, policy, calib_tokens, curve)
    return dial
