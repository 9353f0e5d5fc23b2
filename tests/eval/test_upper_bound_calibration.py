"""Stand-ins priced at the upper bound of their measured cost (issue 19): `fit_calibration(z=...)` adds z
standard errors to each kind's pooled rise, `Intervention.from_dict` reads a results file's runs back and refuses
malformed ones, and `model_calibration` refits a calibration file's interventions at the one-sided 95% bound."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bench.studies.equal_quality import model_calibration
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.errors import EdgeMoEError
from edgemoe.eval.calibration import Intervention, fit_calibration
from edgemoe.eval.experiment import CALIB_CONFIDENCE_Z
from edgemoe.plan.ordermoe.standins import KINDS


def runs_for(layers: int, nats: float = 1.0, pred: float = 0.5, se: float = 0.1) -> list[Intervention]:
    """Two runs (slots 0 and 1) per kind and layer, each with pred, nats * pred and standard error se."""
    return [Intervention(layer, kind, kind, slot, pred, nats * pred, se)
            for layer in range(layers) for kind in (*KINDS, "empty") for slot in (0, 1)]


def test_the_upper_bound_adds_z_pooled_standard_errors():
    runs = runs_for(2, nats=1.0, pred=0.5, se=0.1)
    point, upper = fit_calibration(runs, 2), fit_calibration(runs, 2, z=1.645)
    # pooled rise 2 x 0.5 = 1.0 over pred 1.0; se of the sum sqrt(2) x 0.1
    assert np.allclose(point.nats, 1.0)
    assert np.allclose(upper.nats, 1.0 + 1.645 * np.sqrt(2) * 0.1)
    assert np.allclose(upper.empty, 1.0 + 1.645 * np.sqrt(2) * 0.1)


def test_the_noise_floor_still_holds_under_the_bound():
    runs = runs_for(1, nats=-1.0, pred=0.5, se=0.01)  # a rise far below zero: the floor (half its se) applies
    assert np.allclose(fit_calibration(runs, 1, z=1.645).nats, 0.5 * np.sqrt(2) * 0.01)


@pytest.mark.parametrize("z", [-0.1, float("nan"), float("inf")])
def test_a_bad_z_is_refused(z):
    with pytest.raises(EdgeMoEError, match="z must be"):
        fit_calibration(runs_for(1), 1, z=z)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-0.5, 3.0), st.floats(0.0, 0.5)), min_size=8, max_size=8),
       st.floats(0.0, 3.0))
def test_the_bound_never_prices_below_the_point_and_grows_with_z(measured, z):
    runs = [Intervention(0, kind, kind, slot, 0.3, nats, se)
            for (kind, slot), (nats, se) in zip([(k, s) for k in (*KINDS, "empty") for s in (0, 1)], measured, strict=True)]
    point, upper, more = fit_calibration(runs, 1), fit_calibration(runs, 1, z=z), fit_calibration(runs, 1, z=z + 1)
    assert np.all(upper.nats >= point.nats - 1e-12) and np.all(more.nats >= upper.nats - 1e-12)
    assert np.all(upper.empty >= point.empty - 1e-12)


def test_an_intervention_round_trips_and_bad_rows_name_the_field():
    r = Intervention(2, "drop", "drop", 1, 0.25, 0.03, 0.004)
    assert Intervention.from_dict(r.to_dict()) == r
    for field, value in (("layer", 1.5), ("kind", "skip"), ("pred", -1.0), ("se", float("nan")), ("nats", "x"),
                         ("slot", True)):
        with pytest.raises(EdgeMoEError, match=rf"runs\[3\]\.{field}"):
            Intervention.from_dict({**r.to_dict(), field: value}, "runs[3]")
    bad = r.to_dict()
    del bad["se"]
    with pytest.raises(EdgeMoEError, match="missing field"):
        Intervention.from_dict(bad)
    with pytest.raises(EdgeMoEError, match="expected an object"):
        Intervention.from_dict([1, 2])


def write_calibration_file(tmp_path, runs, layers: int):
    point = fit_calibration(runs, layers)
    doc = {"models": [{"model": "tiny", "calibration": point.to_dict(),
                       "interventions_calibration_text": [r.to_dict() for r in runs]}]}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(doc))
    return path, point


def test_model_calibration_refits_the_file_at_the_one_sided_95_bound(tmp_path):
    runs = runs_for(3, nats=0.8, pred=0.4, se=0.05)
    path, point = write_calibration_file(tmp_path, runs, 3)
    as_point = model_calibration("tiny", path, price="point")
    assert np.allclose(as_point["nats"], point.nats) and as_point["empty"] is None
    upper = model_calibration("tiny", path, price="upper-bound")
    want = fit_calibration(runs, 3, z=CALIB_CONFIDENCE_Z)
    assert np.allclose(upper["nats"], want.nats) and upper["empty"] is None
    assert np.all(np.asarray(upper["nats"]) > np.asarray(point.nats))


def test_model_calibration_refuses_what_it_cannot_refit(tmp_path):
    runs = runs_for(1)
    path, _ = write_calibration_file(tmp_path, runs, 1)
    with pytest.raises(EdgeMoEError, match="price must be one of"):
        model_calibration("tiny", path, price="median")
    with pytest.raises(EdgeMoEError, match="no models\\[\\].calibration for model 'other'"):
        model_calibration("other", path)
    doc = json.loads(path.read_text())
    del doc["models"][0]["interventions_calibration_text"]
    path.write_text(json.dumps(doc))
    with pytest.raises(EdgeMoEError, match="no interventions_calibration_text"):
        model_calibration("tiny", path, price="upper-bound")
    assert model_calibration("tiny", path, price="point")["empty"] is None  # the stored fit needs none


def test_model_calibration_keeps_the_empty_layer_price_only_when_asked(tmp_path):
    runs = runs_for(2, nats=0.8, pred=0.4, se=0.05)
    path, point = write_calibration_file(tmp_path, runs, 2)
    assert np.allclose(model_calibration("tiny", path, price="point", empty=True)["empty"], point.empty)
    upper = model_calibration("tiny", path, empty=True)
    assert np.allclose(upper["empty"], fit_calibration(runs, 2, z=CALIB_CONFIDENCE_Z).empty)
    assert model_calibration("tiny", path)["empty"] is None
