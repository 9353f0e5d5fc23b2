"""The served quality dial: dial files, calibration as the server runs, `max_ppl_increase` over HTTP and the CLI."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from edgemoe.cli import app
from edgemoe.errors import EdgeMoEError
from edgemoe.eval.dial import DIAL_SCHEMA, QualityDial, load_dial, save_dial
from edgemoe.serve.dial import calibrate_serving_dial, check_identity, deployment_budget, identity

SMALL = ["--planner", "uniform", "--calib-tokens", "2048", "--policy", "ordermoe"]  # the conftest deployment
PROMPT = "The history of the city"


@pytest.fixture(scope="module")
def calibrated(deployment):
    """The conftest deployment's dial on two blocks of its calibration text, at half and all of its budget."""
    return calibrate_serving_dial(deployment, "offline", tokens=512, fractions=(0.5, 1.0), refine=0)


@pytest.fixture(scope="module")
def dial_file(calibrated, deployment, tmp_path_factory):
    path = tmp_path_factory.mktemp("dial") / "dial.json"
    save_dial(path, calibrated, identity(deployment))
    return path


def test_a_dial_file_round_trips(tmp_path):
    dial = QualityDial(np.array([0.0, 0.01, 0.05]), np.array([0.0, 0.02, 0.01]), "ordermoe", 512, "isotonic")
    path = tmp_path / "d.json"
    save_dial(path, dial, {"policy": "ordermoe"})
    back, dep = load_dial(path)
    assert dep == {"policy": "ordermoe"} and back.policy == "ordermoe" and back.curve == "isotonic"
    np.testing.assert_array_equal(back.budgets, dial.budgets)
    np.testing.assert_array_equal(back.rise, dial.rise)  # the measured curve, not the credited one
    assert back.budget(0.012) == dial.budget(0.012)
    assert [p.name for p in tmp_path.iterdir()] == ["d.json"]  # written through a temporary file, renamed


@pytest.mark.parametrize("doc, where", [
    ("not json", "d.json"),
    ({"schema": "other"}, "not a dial file"),
    ({"schema": DIAL_SCHEMA, "dial": {}}, "deployment"),
    ({"schema": DIAL_SCHEMA, "deployment": {}, "dial": {"budgets": [0, 1]}}, "calib_ppl_rel_increase"),
    ({"schema": DIAL_SCHEMA, "deployment": {}, "dial": {"budgets": [0, True], "calib_ppl_rel_increase": [0, 1]}},
     "budgets"),
    ({"schema": DIAL_SCHEMA, "deployment": {}, "dial": {"budgets": [0.5, 0.1], "calib_ppl_rel_increase": [0, 1]}},
     "ascending"),
    ({"schema": DIAL_SCHEMA, "deployment": {}, "dial": {"budgets": [0, 1], "calib_ppl_rel_increase": [0, 1],
                                                        "curve": "cubic"}}, "curve"),
])
def test_a_bad_dial_file_is_a_clear_error(tmp_path, doc, where):
    path = tmp_path / "d.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(EdgeMoEError, match=where):
        load_dial(path)


def test_calibration_as_the_server_runs(calibrated, deployment):
    from edgemoe.runtime import make_policy

    top = deployment_budget(make_policy("ordermoe", deployment.ctx))
    np.testing.assert_allclose(calibrated.budgets, [0.0, top / 2, top])
    assert calibrated.rise[0] == 0.0  # a zero budget is exact execution, bit for bit
    assert calibrated.calib_tokens == 512 and calibrated.policy == "ordermoe"
    assert calibrated.budget(calibrated.envelope[-1] + 1.0) == pytest.approx(top)  # never past the deployment's


def test_row_allowance_is_the_servers_request_budget(deployment):
    """score_local(row_allowance=): rows granted 0 run exactly; rows granted the policy's own allowance are the
    policy run as made."""
    from edgemoe.models.scoring import token_scores
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.local import score_local

    rng = np.random.default_rng(0)
    ids = rng.integers(0, deployment.vocab_size, size=(2, 64))
    users = np.array([0, 1])
    exact = token_scores(deployment.adapter, ids)[0]
    pol = lambda: make_policy("ordermoe", deployment.ctx, budget=0.5)  # noqa: E731
    zero = score_local(deployment.adapter, pol(), ids, users, row_allowance=np.zeros(2))[0]
    np.testing.assert_array_equal(zero, exact)
    own = score_local(deployment.adapter, pol(), ids, users, row_allowance=np.full(2, 0.5))[0]
    np.testing.assert_array_equal(own, score_local(deployment.adapter, pol(), ids, users)[0])
    with pytest.raises(EdgeMoEError, match="row_allowance"):
        score_local(deployment.adapter, pol(), ids, users, row_allowance=np.array([0.1, -1.0]))


def test_identity_names_what_differs(deployment, tmp_path):
    ident = identity(deployment)
    check_identity(ident, identity(deployment), "d.json")  # its own: accepted
    with pytest.raises(EdgeMoEError, match=r"policy_params: file \{'budget': 9\.0\}"):
        check_identity({**ident, "policy_params": {"budget": 9.0}}, identity(deployment), "d.json")
    with pytest.raises(EdgeMoEError, match="weights.*placement"):
        check_identity({**ident, "weights": "0", "placement": "0"}, identity(deployment), "d.json")


def test_an_older_dial_file_says_to_calibrate_again(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"schema": "edgemoe.dial/1", "deployment": {}, "dial": {}}))
    with pytest.raises(EdgeMoEError, match=r"older edgemoe .*run `edgemoe dial` again"):
        load_dial(path)


def test_the_ray_identity_is_the_in_process_one_without_loading_the_model(deployment, monkeypatch):
    """`ray_identity` names the weights from the checkpoint's files: equal to the loaded deployment's `identity`
    for the same model, dtype, cluster, placement, mode and policy, with every model loader made to fail."""
    from dataclasses import replace

    import edgemoe.models
    import edgemoe.models.loader
    from edgemoe.distributed.server import ServerConfig
    from edgemoe.serve.dial import ray_identity

    spec, want = deployment.spec, identity(deployment)
    cfg = ServerConfig(deployment.ctx, spec.model, policy=spec.policy, policy_params=spec.policy_params,
                       dtype=spec.dtype)

    def never(*_a, **_k):
        raise AssertionError("ray_identity loaded the model")

    for module in (edgemoe.models, edgemoe.models.loader):
        monkeypatch.setattr(module, "load_moe", never)
    assert ray_identity(cfg) == want
    assert ray_identity(replace(cfg, dtype="bfloat16"))["weights"] != want["weights"]  # the dtype computed in counts


def test_exact_policy_has_no_dial(deployment):
    from edgemoe.runtime import make_policy

    with pytest.raises(EdgeMoEError, match="budget > 0"):
        deployment_budget(make_policy("exact", deployment.ctx))


def test_max_ppl_increase_over_http_runs_the_dials_mixture(deployment, dial_file, calibrated):
    """Asked at a grid point's credited rise, a request runs as that grid budget itself (the same text and counts as
    a request giving it, same seed); asked halfway in nats up a step, its token rows are dealt between the step's
    two budgets (mix_rows) and the budget granted is their sum x layers. With a budget too, or negative: a 400."""
    from edgemoe.distributed.batching import mix_rows
    from edgemoe.serve.service import ServerThread, make_service

    env = calibrated.envelope
    step = int(np.argmax(np.diff(env) > 0))
    assert env[step + 1] > env[step]
    svc = make_service(deployment.spec, deployment=deployment, max_running=4, max_queue=8, dial=str(dial_file))
    try:
        with ServerThread(svc.app) as server:
            body = {"model": "default", "prompt": PROMPT, "max_tokens": 6, "seed": 5}

            def post(opts):
                return httpx.post(server.url + "/v1/completions", json={**body, "edgemoe": opts}, timeout=120)

            low, _, share = calibrated.mix(float(env[step + 1]))  # the largest budget credited with that rise
            assert share == 0 and low == calibrated.budgets[np.flatnonzero(env <= env[step + 1])[-1]]
            by_dial, by_budget = post({"max_ppl_increase": float(env[step + 1])}), post({"budget": low})
            assert by_dial.status_code == by_budget.status_code == 200, by_dial.text
            a, b = by_dial.json(), by_budget.json()
            assert a["choices"][0]["text"] == b["choices"][0]["text"]
            for key in ("expert_slots", "budget_granted", "budget_spent"):
                assert a["edgemoe"][key] == b["edgemoe"][key]
            assert a["edgemoe"]["budget_granted"] > 0

            halfway = float(np.expm1(np.log1p(env[step : step + 2]).mean()))
            low, high, share = calibrated.mix(halfway)
            assert (low, high) == tuple(calibrated.budgets[step : step + 2]) and share == pytest.approx(0.5)
            mixed = post({"max_ppl_increase": halfway}).json()
            rows = np.arange(mixed["usage"]["prompt_tokens"] + mixed["usage"]["completion_tokens"] - 1)
            want = mix_rows(low, high, share, rows).sum() * deployment.ctx.num_layers
            assert mixed["edgemoe"]["budget_granted"] == pytest.approx(want)
            both = post({"max_ppl_increase": halfway, "budget": 0.01})
            assert both.status_code == 400 and both.json()["error"]["param"] == "edgemoe.max_ppl_increase"
            neg = post({"max_ppl_increase": -0.1})
            assert neg.status_code == 400 and "max_ppl_increase" in neg.json()["error"]["message"]
    finally:
        svc.close()


def test_a_server_without_a_dial_refuses_max_ppl_increase(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "default", "prompt": PROMPT, "max_tokens": 2, "edgemoe": {"max_ppl_increase": 0.05}})
    assert r.status_code == 400 and "no quality dial" in r.json()["error"]["message"]


def test_dial_and_generate_commands(serve_cache, deployment, tmp_path):
    out = tmp_path / "dial.json"
    made = CliRunner().invoke(app, ["dial", "--out", str(out), "--tokens", "256", "--refine", "0",
                                    "--cache-dir", str(serve_cache), *SMALL])
    assert made.exit_code == 0, made.stderr
    dial, found = load_dial(out)
    assert found["data"] == "offline" and found["policy"] == "ordermoe" and len(dial.budgets) == 13
    gen = CliRunner().invoke(app, ["generate", "The history of", "--max-tokens", "3", "--dial", str(out),
                                   "--max-ppl-increase", "0.02", "--cache-dir", str(serve_cache), *SMALL])
    assert gen.exit_code == 0, gen.stderr
    assert gen.stdout.startswith("The history of") and "ordermoe at" in gen.stderr
    other = CliRunner().invoke(app, ["generate", "x", "--max-tokens", "1", "--dial", str(out), "--max-ppl-increase",
                                     "0.02", "--param", "budget=0.3", "--cache-dir", str(serve_cache), *SMALL])
    assert other.exit_code == 2 and "calibrated on another deployment" in other.stderr
    alone = CliRunner().invoke(app, ["generate", "x", "--max-ppl-increase", "0.02", *SMALL])
    assert alone.exit_code == 2 and "--dial" in alone.stderr


@pytest.mark.parametrize("args", [["serve"], ["serve", "--backend", "ray"], ["generate", "x", "--max-ppl-increase", "0.02"]],
                         ids=["serve", "serve-ray", "generate"])
def test_a_bad_dial_file_fails_before_the_deployment_is_built(tmp_path, monkeypatch, args):
    """A broken --dial is refused, naming the file, before the model loads or Ray starts (both would fail the
    test here: they are replaced by functions that raise)."""
    import edgemoe.serve.setup as setup

    def never(*_a, **_k):
        raise AssertionError("the deployment was built before the dial file was checked")

    monkeypatch.setattr(setup, "load_deployment", never)
    monkeypatch.setattr("edgemoe.serve.cli._serve_ray", never)
    bad = tmp_path / "dial.json"
    bad.write_text(json.dumps({"schema": DIAL_SCHEMA, "deployment": {}, "dial": {"budgets": "x"}}))
    r = CliRunner().invoke(app, [*args, "--dial", str(bad)])
    assert r.exit_code == 2 and str(bad) in r.stderr and "budgets" in r.stderr, r.stderr


def test_a_ray_load_run_refuses_a_dial(tmp_path):
    r = CliRunner().invoke(app, ["serve", "--backend", "ray", "--load-users", "2", "--dial", str(tmp_path / "d.json")])
    assert r.exit_code == 2 and "--load-users" in r.stderr
