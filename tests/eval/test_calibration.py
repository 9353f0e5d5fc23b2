"""The measured stand-in calibration (`edgemoe.eval.calibration`): the fit's known answers (pooled ratio, the
noise floor, missing kinds refused), the predicted nats it gives back, and the interventions on a tiny real
Mixtral (a zeroed top-1 costs more than a zeroed top-2, an empty layer is priced, the predicted P ** 2 is
the one `choose_stand_ins` would charge)."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.eval.calibration import (
    VARIANTS,
    Intervention,
    fit_calibration,
    measure_interventions,
    predicted_nats,
)
from edgemoe.plan.ordermoe.standins import KINDS, KindCalibration


def runs_for(layers: int, nats: dict, pred: float = 0.5, se: float = 0.0) -> list[Intervention]:
    """Two runs (slots 0 and 1) per kind and layer with pred each and measured nats[kind] * pred each."""
    return [Intervention(layer, kind, kind, slot, pred, nats[kind] * pred, se)
            for layer in range(layers) for kind in (*KINDS, "empty") for slot in (0, 1)]


def test_the_fit_is_the_pooled_ratio_per_kind_and_layer():
    cal = fit_calibration(runs_for(3, {"sub": 0.5, "drop": 2.0, "zero": 1.0, "empty": 4.0}), 3)
    assert np.allclose(cal.nats, [[0.5] * 3, [2.0] * 3, [1.0] * 3]) and np.allclose(cal.empty, 4.0)
    # unequal runs pool as sum(nats) / sum(pred): (0.3 + 0.1) / (0.2 + 0.2) = 1
    runs = [r for r in runs_for(1, {"sub": 1, "drop": 1, "zero": 1, "empty": 1}) if r.kind != "zero"]
    runs += [Intervention(0, "zero", "zero", 0, 0.2, 0.3, 0.0), Intervention(0, "zero", "zero", 1, 0.2, 0.1, 0.0)]
    assert fit_calibration(runs, 1).nats[KINDS.index("zero"), 0] == pytest.approx(1.0)
    assert fit_calibration(runs, 1, empty=False).empty is None


def test_a_rise_within_noise_is_credited_half_its_standard_error():
    runs = runs_for(1, {"sub": -0.01, "drop": 1.0, "zero": 1.0, "empty": 1.0}, pred=0.5, se=0.02)
    cal = fit_calibration(runs, 1)
    # sub: summed rise -0.01 < 0.5 * sqrt(2 x 0.02^2): floored, over the summed pred 1.0
    assert cal.nats[0, 0] == pytest.approx(0.5 * np.sqrt(2) * 0.02)


def test_a_kind_never_measured_is_refused():
    runs = [r for r in runs_for(2, {"sub": 1, "drop": 1, "zero": 1, "empty": 1}) if not (r.kind == "drop" and r.layer == 1)]
    with pytest.raises(EdgeMoEError, match="'drop' at layer 1"):
        fit_calibration(runs, 2)


def test_predicted_nats_uncalibrated_and_calibrated():
    runs = runs_for(1, {"sub": 1, "drop": 1, "zero": 1, "empty": 1}, pred=0.25)
    cal = KindCalibration(np.array([[2.0], [3.0], [4.0]]), np.array([5.0]))
    assert np.allclose(predicted_nats(runs, None), 0.25)
    assert np.allclose(predicted_nats(runs, cal), 0.25 * np.repeat([2.0, 3.0, 4.0, 5.0], 2))


def test_interventions_on_a_tiny_mixtral():
    from edgemoe.models import adapter_for
    from edgemoe.models.scoring import token_scores
    from edgemoe.models.tiny import TINY_VOCAB, tiny_model

    adapter = adapter_for(tiny_model("mixtral", seed=5), "mixtral")
    L, K, E = adapter.num_layers, adapter.top_k, adapter.num_experts
    ids = np.random.default_rng(0).integers(1, TINY_VOCAB, (4, 16))
    nll = token_scores(adapter, ids)[0]
    err = np.random.default_rng(1).uniform(0.2, 1.2, (L, E, E))
    runs = measure_interventions(adapter, err, ids, nll, random_sub=True)
    assert len(runs) == L * ((len(VARIANTS) + 1) * K + 1)
    assert all(np.isfinite([r.nats, r.se, r.pred]).all() and r.pred > 0 for r in runs)
    for layer in range(L):
        zero = {r.slot: r for r in runs if r.layer == layer and r.kind == "zero"}
        empty = next(r for r in runs if r.layer == layer and r.kind == "empty")
        assert zero[0].pred >= zero[1].pred  # slot 0 carries the larger gate
        assert empty.pred == pytest.approx(1.0)  # Mixtral's top-k gates sum to 1: P = 1
    cal = fit_calibration(runs, L)
    assert cal.nats.shape == (3, L) and (cal.nats > 0).all() and cal.empty.shape == (L,)
    # the same text, seed and errors: the same measurements (deterministic)
    again = measure_interventions(adapter, err, ids, nll, random_sub=True)
    assert [r.to_dict() for r in again] == [r.to_dict() for r in runs]
