"""A table of bad inputs across commands: each must end with exit status 2, one `error: ...` line on
stderr that names what to fix, no traceback, and every pre-existing file byte-identical afterwards.

All runs are in-process through the real entry point's group (typer's CliRunner calls the same `main`),
on tiny inputs; every case fails before any model runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from edgemoe.cli import app
from edgemoe.cluster import load_cluster
from edgemoe.models.tiny import save_tiny
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.results import write_results


def _edit_arrays(folder: Path, **changes) -> None:
    arrays = load_file(str(folder / "arrays.safetensors"))
    for name, fn in changes.items():
        arrays[name] = fn(arrays[name].copy())
    save_file(arrays, str(folder / "arrays.safetensors"))


def _edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


@pytest.fixture(scope="module")
def d(tmp_path_factory, three_edge_cluster_yaml) -> Path:
    """Every input the table points at, made once."""
    root = tmp_path_factory.mktemp("bad")
    prof = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=300, expert_bytes=1_000_000, seed=0)
    prof.save(root / "prof")
    (root / "cluster.yaml").write_text(three_edge_cluster_yaml)
    placement = plan(plan_problem(prof, load_cluster(root / "cluster.yaml")), "uniform")
    placement.save(root / "placement.json")

    for name in ("nan_prof", "oob_prof", "corrupt_prof", "badmeta_prof", "negmeta_prof"):
        prof.save(root / name)
    _edit_arrays(root / "nan_prof", freq=lambda a: np.where(np.arange(a.size).reshape(a.shape) == 3, np.nan, a))
    _edit_arrays(root / "oob_prof", topk=lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, 99, a).astype(a.dtype))
    (root / "corrupt_prof" / "arrays.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    (root / "badmeta_prof" / "meta.json").write_bytes(b"\xff\xfe not utf-8")
    _edit_json(root / "negmeta_prof" / "meta.json", lambda m: m.update(num_experts=-1))

    p = root / "placement.json"
    (root / "pl_missing.json").write_text(json.dumps({k: v for k, v in json.loads(p.read_text()).items() if k != "hosts"}))
    other = synthetic_profile(num_layers=2, num_experts=4, top_k=2, num_tokens=100, expert_bytes=1_000_000, seed=1)
    other.save(root / "other_prof")  # matches the small checkpoint below and pl_other_model.json
    plan(plan_problem(other, load_cluster(root / "cluster.yaml")), "uniform").save(root / "pl_other_model.json")

    def overfill(doc):  # every expert on node c (8 MB) and its recorded capacity raised to match
        doc["hosts"]["c"] = [list(range(8))] * 4
        doc["capacity_bytes"]["c"] = 32_000_000
    (root / "pl_over_memory.json").write_text(p.read_text())
    _edit_json(root / "pl_over_memory.json", overfill)
    (root / "pl_over_recorded.json").write_text(p.read_text())
    _edit_json(root / "pl_over_recorded.json", lambda doc: doc["hosts"].update(c=[list(range(8))] * 4))
    (root / "pl_bad_id.json").write_text(p.read_text())
    _edit_json(root / "pl_bad_id.json", lambda doc: doc["hosts"]["a"].__setitem__(0, [0, 42]))
    (root / "not_json.json").write_text("{ this is not json")
    (root / "cluster_bad.yaml").write_text("nodes: 5\n")
    (root / "cluster_kind.yaml").write_text(three_edge_cluster_yaml.replace("kind: edge, memory: 8MB", "kind: fog, memory: 8MB"))
    (root / "cluster_latin1.yaml").write_bytes(three_edge_cluster_yaml.replace("u1", "\u00fc1").encode("latin-1"))
    (root / "cluster_syntax.yaml").write_text("name: [unclosed\n")

    # A checkpoint whose (L, E) is not the profile's, and one whose weights file is damaged.
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_size": 8}))
    save_file({f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight": np.zeros((2, 2), np.float32)
               for layer in range(2) for e in range(4) for w in ("w1", "w2", "w3")}, str(model / "model.safetensors"))
    damaged = save_tiny("mixtral", root / "damaged_model")
    weights = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    broken = root / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_size": 8}))
    (broken / "model.safetensors").write_bytes(b"garbage" * 10)

    # Things that are not ours, and that are not files.
    user = root / "user_dir"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    report_like = root / "user_docs"
    report_like.mkdir()
    (report_like / "report.md").write_text("# my own report\n")
    (root / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 20)
    (root / "existing.json").write_text('{"mine": true}\n')
    write_results(root / "results.json", {}, {})
    (root / "a_folder").mkdir()
    (root / "a_folder" / "keep.txt").write_text("keep")
    os.mkfifo(root / "fifo")
    (root / "to_devnull").symlink_to("/dev/null")
    (root / "to_fifo").symlink_to(root / "fifo")
    return root


def snapshot(root: Path) -> dict:
    """{path: sha256 | link target | kind} of everything under `root` (a FIFO is never opened)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_fifo():
            out[rel] = "fifo"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


PLAN = ["plan", "--profile", "{d}/prof", "--cluster", "{d}/cluster.yaml", "--out", "{d}/new.json"]
SERVE = ["serve", "--cluster", "{d}/cluster.yaml", "--placement", "{d}/placement.json", "--profile", "{d}/prof",
         "--model", "{d}/model", "--load-users", "1", "--out", "{d}/serve-new.json"]
EVAL = ["evaluate", "--out", "{d}/eval-new.json"]
PROFILE = ["profile", "--model", "{d}/model", "--data", "{d}/text.txt"]

# (case id, argv, a piece of the message that says what to fix)
CASES = [
    # profile: ranges, and outputs that are not ours
    ("profile-tokens-0", [*PROFILE, "--out", "{d}/p1", "--tokens", "0"], "--tokens"),
    ("profile-tokens-negative", [*PROFILE, "--out", "{d}/p1", "--tokens", "-5"], "--tokens"),
    ("profile-tokens-not-int", [*PROFILE, "--out", "{d}/p1", "--tokens", "abc"], "--tokens"),
    ("profile-block-len-0", [*PROFILE, "--out", "{d}/p1", "--block-len", "0"], "--block-len"),
    ("profile-subst-tokens-0", [*PROFILE, "--out", "{d}/p1", "--subst-tokens", "0"], "--subst-tokens"),
    ("profile-tokens-below-block", [*PROFILE, "--out", "{d}/p1", "--tokens", "10", "--block-len", "64"], "--block-len"),
    ("profile-out-user-folder", [*PROFILE, "--out", "{d}/user_dir"], "refusing to replace"),
    ("profile-out-model-folder", [*PROFILE, "--out", "{d}/model"], "refusing to replace"),
    ("profile-out-is-a-file", [*PROFILE, "--out", "{d}/existing.json"], "must be a folder"),
    ("profile-out-equals-report", [*PROFILE, "--out", "{d}/p1", "--report", "{d}/p1"], "same file"),
    ("profile-report-user-folder", [*PROFILE, "--out", "{d}/p1", "--report", "{d}/user_docs"], "refusing to write into"),
    ("profile-model-damaged-weights", ["profile", "--model", "{d}/damaged_model", "--data", "{d}/text.txt",
                                       "--out", "{d}/p1", "--tokens", "64", "--block-len", "32"], "cannot read its weights"),
    ("profile-missing-model", ["profile", "--model", "{d}/nope", "--out", "{d}/p1"], "does not exist"),
    # plan: every --param has a type and a range; unknown keys list the valid ones
    ("plan-time-limit-negative", [*PLAN, "--method", "exact", "--param", "time_limit=-1"], "time_limit"),
    ("plan-time-limit-nan", [*PLAN, "--method", "exact", "--param", "time_limit=nan"], "finite"),
    ("plan-mip-gap-2", [*PLAN, "--method", "exact", "--param", "mip_rel_gap=2"], "mip_rel_gap"),
    ("plan-node-limit-zero", [*PLAN, "--method", "exact", "--param", "node_limit=0"], "node_limit"),
    ("plan-kicks-abc", [*PLAN, "--method", "slimcaching", "--param", "kicks=abc"], "kicks"),
    ("plan-eta-abc", [*PLAN, "--method", "ordermoe", "--param", "eta=abc"], "eta"),
    ("plan-seed-negative", [*PLAN, "--method", "random", "--param", "seed=-1"], "seed"),
    ("plan-max-units-0", [*PLAN, "--method", "slimcaching", "--param", "max_units=0"], "max_units"),
    ("plan-redundancy-maybe", [*PLAN, "--method", "ordermoe", "--param", "redundancy=maybe"], "redundancy"),
    ("plan-unknown-param", [*PLAN, "--method", "ordermoe", "--param", "colour=red"], "valid: mode, algorithm, budget"),
    ("plan-param-no-value", [*PLAN, "--method", "ordermoe", "--param", "novalue"], "key=value"),
    ("plan-param-twice", [*PLAN, "--method", "random", "--param", "seed=1", "--param", "seed=2"], "twice"),
    ("plan-unknown-method", [*PLAN, "--method", "nonsense"], "expected one of"),
    ("plan-missing-method", PLAN, "--method"),
    ("plan-profile-nan", ["plan", "--profile", "{d}/nan_prof", "--cluster", "{d}/cluster.yaml", "--method", "ordermoe",
                          "--out", "{d}/new.json"], "NaN"),
    ("plan-profile-expert-id", ["plan", "--profile", "{d}/oob_prof", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                                "--out", "{d}/new.json"], "'topk'"),
    ("plan-profile-corrupt", ["plan", "--profile", "{d}/corrupt_prof", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                              "--out", "{d}/new.json"], "arrays.safetensors"),
    ("plan-profile-meta-not-utf8", ["plan", "--profile", "{d}/badmeta_prof", "--cluster", "{d}/cluster.yaml",
                                    "--method", "lfu", "--out", "{d}/new.json"], "not UTF-8"),
    ("plan-profile-meta-negative", ["plan", "--profile", "{d}/negmeta_prof", "--cluster", "{d}/cluster.yaml",
                                    "--method", "lfu", "--out", "{d}/new.json"], "num_experts"),
    ("plan-profile-missing", ["plan", "--profile", "{d}/nope", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                              "--out", "{d}/new.json"], "not a profile folder"),
    ("plan-cluster-missing", ["plan", "--profile", "{d}/prof", "--cluster", "{d}/nope.yaml", "--method", "lfu",
                              "--out", "{d}/new.json"], "no such cluster file"),
    ("plan-cluster-not-a-list", [*PLAN[:3], "--cluster", "{d}/cluster_bad.yaml", *PLAN[5:], "--method", "lfu"],
     "nodes: Input should be a valid list"),
    ("plan-cluster-unknown-kind", [*PLAN[:3], "--cluster", "{d}/cluster_kind.yaml", *PLAN[5:], "--method", "lfu"],
     "nodes[2].kind"),
    ("plan-cluster-not-utf8", [*PLAN[:3], "--cluster", "{d}/cluster_latin1.yaml", *PLAN[5:], "--method", "lfu"],
     "cluster_latin1.yaml: cluster file is not UTF-8"),
    ("plan-cluster-syntax", [*PLAN[:3], "--cluster", "{d}/cluster_syntax.yaml", *PLAN[5:], "--method", "lfu"],
     "cannot parse"),
    ("plan-profile-is-a-file", ["plan", "--profile", "{d}/text.txt", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                                "--out", "{d}/new.json"], "not a profile folder"),
    ("plan-out-fifo", ["plan", "--profile", "{d}/prof", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                       "--out", "{d}/fifo"], "FIFO"),
    ("plan-out-link-to-fifo", ["plan", "--profile", "{d}/prof", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                               "--out", "{d}/to_fifo"], "FIFO"),
    ("plan-out-device", ["plan", "--profile", "{d}/prof", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                         "--out", "{d}/to_devnull"], "device"),
    ("plan-out-folder", ["plan", "--profile", "{d}/prof", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                         "--out", "{d}/a_folder"], "folder"),
    ("plan-out-unwritable-folder", [*PLAN[:-1], "/proc/edgemoe-placement.json", "--method", "lfu"], "cannot write in /proc"),
    ("plan-out-equals-map", [*PLAN, "--method", "lfu", "--expert-map", "{d}/new.json"], "same file"),
    # evaluate: method rows are parsed and checked before anything runs
    ("evaluate-method-syntax", [*EVAL, "--method", "nonsense"], "NAME=PLACEMENT:POLICY"),
    ("evaluate-method-twice", [*EVAL, "--method", "a=uniform:exact", "--method", "a=lfu:exact"], "unique"),
    ("evaluate-horizon-100", [*EVAL, "--method", "a=uniform:ordermoe:horizon=100"], "horizon"),
    ("evaluate-budget-negative", [*EVAL, "--method", "a=uniform:exact:budget=-1"], "budget"),
    ("evaluate-unknown-placement", [*EVAL, "--method", "a=nosuch:exact"], "unknown placement"),
    ("evaluate-unknown-policy", [*EVAL, "--method", "a=uniform:nosuch"], "unknown policy"),
    ("evaluate-unknown-policy-param", [*EVAL, "--method", "a=uniform:exact:horizon=1"], "valid: budget"),
    ("evaluate-mode", [*EVAL, "--mode", "sideways"], "--mode"),
    ("evaluate-eval-tokens-0", [*EVAL, "--eval-tokens", "0"], "--eval-tokens"),
    ("evaluate-cluster-missing", [*EVAL, "--cluster", "{d}/nope.yaml"], "no such cluster file"),
    ("evaluate-out-fifo", ["evaluate", "--out", "{d}/fifo"], "FIFO"),
    # serve: everything is checked before Ray starts
    ("serve-wire-int3", [*SERVE, "--wire", "int3"], "--wire"),
    ("serve-mode", [*SERVE, "--mode", "sideways"], "--mode"),
    ("serve-policy-param", [*SERVE, "--policy", "ordermoe", "--param", "horizon=100"], "horizon"),
    ("serve-horizon-beyond-layers", [*SERVE, "--policy", "ordermoe", "--param", "horizon=4"], "at most 3"),
    ("serve-unknown-policy", [*SERVE, "--policy", "nosuch"], "unknown policy"),
    ("serve-load-seconds-0", [*SERVE, "--load-seconds", "0"], "--load-seconds"),
    ("serve-placement-missing-key", [*SERVE[:3], "--placement", "{d}/pl_missing.json", *SERVE[5:]], "missing fields ['hosts']"),
    ("serve-placement-other-model", [*SERVE[:3], "--placement", "{d}/pl_other_model.json", *SERVE[5:]], "(L, E)"),
    ("serve-placement-over-memory", [*SERVE[:3], "--placement", "{d}/pl_over_memory.json", *SERVE[5:]],
     "the cluster gives it"),
    ("serve-placement-over-recorded", [*SERVE[:3], "--placement", "{d}/pl_over_recorded.json", *SERVE[5:]], "capacity"),
    ("serve-placement-bad-id", [*SERVE[:3], "--placement", "{d}/pl_bad_id.json", *SERVE[5:]], "outside [0, 8)"),
    ("serve-placement-not-json", [*SERVE[:3], "--placement", "{d}/not_json.json", *SERVE[5:]], "invalid JSON"),
    ("serve-model-other-shape", SERVE, "give the model the profile was measured on"),
    ("serve-model-corrupt", [*SERVE[:8], "{d}/broken_model", *SERVE[9:]], "cannot read the checkpoint"),
    ("serve-out-fifo", [*SERVE[:-1], "{d}/fifo"], "FIFO"),
    # report, train, demo, cluster, usage
    ("report-missing-results", ["report", "{d}/nope.json", "--out", "{d}/rep"], "not found"),
    ("report-not-json", ["report", "{d}/text.txt", "--out", "{d}/rep"], "invalid JSON"),
    ("report-not-results", ["report", "{d}/existing.json", "--out", "{d}/rep"], "schema"),
    ("report-out-user-folder", ["report", "{d}/results.json", "--out", "{d}/user_dir"], "refusing to write into"),
    ("report-out-user-report", ["report", "{d}/results.json", "--out", "{d}/user_docs"], "refusing to write into"),
    ("train-steps-0", ["train", "--steps", "0", "--out", "{d}/m"], "--steps"),
    ("train-out-user-folder", ["train", "--data", "{d}/user_dir", "--out", "{d}/user_dir"], "refusing to replace"),
    ("train-out-foreign-model", ["train", "--data", "{d}/user_dir", "--out", "{d}/model"], "refusing to replace"),
    ("demo-backend", ["demo", "--backend", "quantum", "--out", "{d}/demo"], "--backend"),
    ("demo-out-user-folder", ["demo", "--out", "{d}/user_dir"], "refusing to write into"),
    ("demo-dilation-below-1", ["demo", "--backend", "ray", "--dilation", "0.5", "--out", "{d}/demo"], "--dilation"),
    ("demo-dilation-word", ["demo", "--backend", "ray", "--dilation", "fast", "--out", "{d}/demo"], "'auto' or a finite"),
    ("demo-dilation-simulate", ["demo", "--dilation", "10", "--out", "{d}/demo"], "--backend ray only"),
    ("cluster-show-missing", ["cluster", "show", "{d}/nope.yaml"], "no such cluster file"),
    ("cluster-show-out-fifo", ["cluster", "show", "{d}/cluster.yaml", "--out", "{d}/fifo"], "FIFO"),
    ("unknown-command", ["bogus"], "No such command"),
    ("unknown-option", ["plan", "--colour", "red"], "No such option"),
]


def test_the_table_is_big_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("argv", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_touches_nothing(d, argv, fix):
    before = snapshot(d)
    result = CliRunner().invoke(app, [a.format(d=d) for a in argv])
    err = result.stderr
    assert result.exit_code == 2, (result.exit_code, err, result.stdout, result.exception)
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert fix in err, err
    assert "Traceback" not in result.output and "internal error" not in err
    assert snapshot(d) == before


def test_unexpected_errors_name_the_traceback_file(d, monkeypatch):
    """A bug is not dressed up as bad input: one line, exit 1, and the traceback kept in a file."""
    import edgemoe.plan.cli as plan_cli

    def boom(*_a, **_k):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(plan_cli, "placement_summary", boom)
    result = CliRunner().invoke(app, [a.format(d=d) for a in PLAN] + ["--method", "lfu"])
    assert result.exit_code == 1
    line = result.stderr.strip()
    assert "\n" not in line and "RuntimeError: simulated bug" in line and "please report it" in line
    path = Path(line.split("the full traceback is in ")[1].split(";")[0])
    assert "Traceback" in path.read_text() and "simulated bug" in path.read_text()
    path.unlink()
    (d / "new.json").unlink()  # the placement was written before the summary failed


def test_single_domain_profile_serves_every_user(d, tmp_path):
    """A profile with one domain plans on a cluster whose users name other domains, without a flag."""
    one = synthetic_profile(num_layers=2, num_experts=4, top_k=2, num_tokens=100, num_domains=1, seed=2)
    one.save(tmp_path / "one")
    result = CliRunner().invoke(app, ["plan", "--profile", str(tmp_path / "one"), "--cluster", str(d / "cluster.yaml"),
                                      "--method", "lfu", "--out", str(tmp_path / "pl.json")])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""  # success is quiet on stderr: no bar, no warning, off a terminal


def test_multi_domain_mismatch_names_the_flag(tmp_path):
    prof = synthetic_profile(num_layers=2, num_experts=4, top_k=2, num_tokens=100, num_domains=2, seed=2)
    prof.save(tmp_path / "p")
    result = CliRunner().invoke(app, ["plan", "--profile", str(tmp_path / "p"), "--cluster", "edge8", "--method", "lfu",
                                      "--out", str(tmp_path / "pl.json")])
    assert result.exit_code == 2 and "--domain-fallback" in result.stderr, result.stderr


def test_ray_that_does_not_start_is_one_line(d, monkeypatch):
    """Inputs that all match; Ray's start times out -> one clear line, exit 2, nothing written."""
    import edgemoe.distributed.serve as serve_mod

    def timeout(*_a, **_k):
        raise TimeoutError("Timed out after 30 seconds waiting for the GCS")

    monkeypatch.setattr(serve_mod, "start_ray", timeout)
    before = snapshot(d)
    result = CliRunner().invoke(app, ["serve", "--cluster", str(d / "cluster.yaml"), "--placement",
                                      str(d / "pl_other_model.json"), "--profile", str(d / "other_prof"),
                                      "--model", str(d / "model"), "--load-users", "1", "--out", str(d / "s.json")])
    assert result.exit_code == 2, (result.stderr, result.exception)
    assert result.stderr.count("\n") == 1 and "Ray did not start" in result.stderr and "--ray-address" in result.stderr
    assert snapshot(d) == before


def test_demo_dilation_reaches_the_experiment(tmp_path, monkeypatch):
    """`edgemoe demo --backend ray --dilation K` forces k for every method (ExperimentConfig.ray_dilation, read by
    the experiment's Ray measurement); 'auto' (the default) leaves it to the calibration (None)."""
    import edgemoe.eval.experiment as experiment
    from edgemoe.errors import EdgeMoEError

    seen = []

    def fake_run_demo(cfg, out, backend="simulate", **_kw):
        seen.append((cfg.ray_dilation, backend))
        raise EdgeMoEError("stop here")

    monkeypatch.setattr(experiment, "run_demo", fake_run_demo)
    for argv, want in ((["--dilation", "12.5"], 12.5), ([], None)):
        result = CliRunner().invoke(app, ["demo", "--backend", "ray", "--quick", "--out", str(tmp_path / f"d{len(seen)}"),
                                          *argv])
        assert result.exit_code == 2 and "stop here" in result.stderr, result.output
        assert seen[-1] == (want, "ray")
