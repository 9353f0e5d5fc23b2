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
    (root / "fifo_prof").mkdir()
    os.mkfifo(root / "fifo_prof" / "meta.json")
    (root / "fifo_prof" / "arrays.safetensors").symlink_to("/dev/zero")
    _hostile_inputs(root, three_edge_cluster_yaml, p)
    return root


def _hostile_inputs(root: Path, cluster_yaml: str, placement: Path) -> None:
    """Round two (issue 22): damaged compression, deep nesting, huge numbers, non-finite values."""
    import gzip

    line = {"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, "topk_ids": [0, 1], "topk_weights": [0.6, 0.4]}
    lines = "".join(json.dumps({**line, "req_id": f"r{i}", "layer": k}) + "\n" for i in range(300) for k in range(32))
    whole = gzip.compress(lines.encode(), mtime=0)
    (root / "trace_cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (root / "trace_ok.jsonl").write_text(lines)
    (root / "trace_deep.jsonl").write_text(json.dumps(line)[:-1] + ', "x": ' + "[" * 50_000 + "]" * 50_000 + "}\n")
    (root / "trace_bigint.jsonl").write_text(json.dumps(line).replace('"token_idx": 0', '"token_idx": ' + "9" * 5000) + "\n")
    deep = "[" * 50_000 + "]" * 50_000
    (root / "deep.json").write_text(deep)
    (root / "bigint.json").write_text('{"schema": ' + "1" * 5000 + "}")
    (root / "cluster_deep.yaml").write_text("name: " + "[" * 50_000 + "\n")
    (root / "cluster_bigint.yaml").write_text(cluster_yaml.replace("memory: 8MB", "memory: " + "9" * 5000))
    (root / "to_zero.yaml").symlink_to("/dev/zero")
    # numbers: non-finite, beyond int64, out of range
    for name, old, new in (
        ("memory_inf", "memory: 8MB", "memory: .inf"),
        ("memory_1e30", "memory: 8MB", "memory: 1.0e+30"),
        ("position_nan", "memory: 8MB,", "memory: 8MB, position_m: [.nan, .nan],"),
        ("arrival_inf", "weight: 3", "arrival_rate: .inf"),
        ("tx_nan", "{src: a, dst: c, latency: 12ms, bandwidth: 50Mbit/s}",
         "{src: a, dst: c, latency: 12ms, wireless: {bandwidth_hz: 1e6, tx_power_dbm: .nan, gain_db: -100}}"),
        ("tx_huge", "{src: a, dst: c, latency: 12ms, bandwidth: 50Mbit/s}",
         "{src: a, dst: c, latency: 12ms, wireless: {bandwidth_hz: 1e6, tx_power_dbm: 1.0e+300, gain_db: -100}}"),
    ):
        text = cluster_yaml.replace(old, new)
        if name == "arrival_inf":
            text = text.replace("weight: 1", "arrival_rate: 1")
        (root / f"cluster_{name}.yaml").write_text(text)
    doc = json.loads(placement.read_text())
    doc["capacity_bytes"]["a"] = 10**30
    (root / "pl_capacity_1e30.json").write_text(json.dumps(doc))
    doc["capacity_bytes"]["a"] = 1e30
    (root / "pl_capacity_float.json").write_text(json.dumps(doc))
    doc = json.loads(placement.read_text())
    doc["expert_bytes"][0][0] = 1.5
    (root / "pl_bytes_float.json").write_text(json.dumps(doc))
    res = json.loads((root / "results.json").read_text())
    res["placements"] = {"lfu": {"copies": [[1, 2], [3]], "bytes_used": [1.0]}}
    (root / "results_ragged.json").write_text(json.dumps(res))
    res["placements"] = {"lfu": {"copies": "abc"}}
    (root / "results_copies_text.json").write_text(json.dumps(res))
    (root / "trace_neg_weight.jsonl").write_text(json.dumps({**line, "topk_weights": [-0.5, 1.5]}) + "\n")
    (root / "trace_huge_weight.jsonl").write_text(json.dumps({**line, "topk_weights": [1e308, 0.5]}) + "\n")
    (root / "trace_logit_f16.jsonl").write_text(json.dumps({**line, "router_logits": [1e5] + [0.0] * 7}) + "\n")
    (root / "trace_nan_weight.jsonl").write_text(json.dumps({**line, "topk_weights": [float("nan"), 0.5]}) + "\n")


@pytest.fixture(scope="module")
def far(tmp_path_factory) -> Path:
    """Inputs too big to hash before and after every case (sparse files: no space on disk)."""
    root = tmp_path_factory.mktemp("far")
    with open(root / "huge.json", "wb") as f:
        f.truncate(300 << 20)
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
TRACE = ["profile", "--model-spec", "mixtral-8x7b", "--out", "{d}/p1", "--trace"]

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
    ("profile-out-model-folder", [*PROFILE, "--out", "{d}/model"], "is also the input --model"),
    ("profile-out-other-model-folder", [*PROFILE, "--out", "{d}/damaged_model"], "refusing to replace"),
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
    ("train-out-user-folder", ["train", "--data", "{d}/user_dir", "--out", "{d}/user_dir"], "is also the input --data"),
    ("train-out-other-user-folder", ["train", "--data", "{d}/text.txt", "--out", "{d}/user_dir"], "refusing to replace"),
    ("train-out-foreign-model", ["train", "--data", "{d}/user_dir", "--out", "{d}/model"], "refusing to replace"),
    ("demo-backend", ["demo", "--backend", "quantum", "--out", "{d}/demo"], "--backend"),
    ("demo-out-user-folder", ["demo", "--out", "{d}/user_dir"], "refusing to write into"),
    ("demo-paper-scale-out-user-folder", ["demo", "--scenario", "paper-scale", "--out", "{d}/user_dir"],
     "refusing to write into"),
    ("demo-paper-scale-out-is-the-data", ["demo", "--scenario", "paper-scale", "--shared-data", "{d}/user_dir",
                                          "--out", "{d}/user_dir"], "is also the input --shared-data"),
    ("demo-dilation-below-1", ["demo", "--backend", "ray", "--dilation", "0.5", "--out", "{d}/demo"], "--dilation"),
    ("demo-dilation-word", ["demo", "--backend", "ray", "--dilation", "fast", "--out", "{d}/demo"], "'auto' or a finite"),
    ("demo-dilation-simulate", ["demo", "--dilation", "10", "--out", "{d}/demo"], "--backend ray only"),
    ("cluster-show-missing", ["cluster", "show", "{d}/nope.yaml"], "no such cluster file"),
    # round two (issue 22), one guarded reader: devices, FIFOs, size caps, damaged gzip, deep nesting, huge integers
    ("profile-trace-dev-zero", [*TRACE, "/dev/zero"], "/dev/zero: is a device"),
    ("profile-trace-fifo", [*TRACE, "{d}/fifo"], "is a FIFO"),
    ("profile-trace-gzip-cut", [*TRACE, "{d}/trace_cut.jsonl.gz"], "trace file is damaged (EOFError"),
    ("profile-trace-deep-json", [*TRACE, "{d}/trace_deep.jsonl"], "trace_deep.jsonl:1: lists or objects nested too deep"),
    ("profile-trace-huge-int", [*TRACE, "{d}/trace_bigint.jsonl"], "trace_bigint.jsonl:1: an integer of 5000 digits"),
    ("cluster-show-dev-zero", ["cluster", "show", "/dev/zero"], "/dev/zero: is a device"),
    ("cluster-show-link-to-dev-zero", ["cluster", "show", "{d}/to_zero.yaml"], "is a device"),
    ("plan-cluster-deep-yaml", [*PLAN[:3], "--cluster", "{d}/cluster_deep.yaml", *PLAN[5:], "--method", "lfu"], "nested too deep"),
    ("plan-cluster-huge-int", [*PLAN[:3], "--cluster", "{d}/cluster_bigint.yaml", *PLAN[5:], "--method", "lfu"],
     "an integer of 5000 digits"),
    ("serve-placement-deep-json", [*SERVE[:3], "--placement", "{d}/deep.json", *SERVE[5:]], "deep.json: lists or objects nested"),
    ("report-results-deep-json", ["report", "{d}/deep.json", "--out", "{d}/rep"], "nested too deep"),
    ("report-results-huge-int", ["report", "{d}/bigint.json", "--out", "{d}/rep"], "an integer of 5000 digits"),
    ("report-results-too-big", ["report", "{far}/huge.json", "--out", "{d}/rep"], "more than the 256 MiB"),
    ("report-results-ragged-copies", ["report", "{d}/results_ragged.json", "--out", "{d}/rep"],
     "placements.lfu.copies: Value error, must be an [L][E] table"),
    ("report-results-copies-text", ["report", "{d}/results_copies_text.json", "--out", "{d}/rep"],
     "placements.lfu.copies"),
    ("report-results-device", ["report", "/dev/zero", "--out", "{d}/rep"], "is a device"),
    # round two, one validation layer: finite, in range, within int64 where it becomes an array
    *[(f"plan-cluster-{name.replace('_', '-')}", [*PLAN[:3], "--cluster", f"{{d}}/cluster_{name}.yaml", *PLAN[5:],
                                                  "--method", "lfu"], fix)
      for name, fix in (("memory_inf", "nodes[2].memory: memory (bytes) must be a finite number"),
                        ("memory_1e30", "nodes[2].memory: memory (bytes) must be <="),
                        ("position_nan", "nodes[2].position_m[0]: Input should be a finite number"),
                        ("arrival_inf", "users[0].arrival_rate: Input should be a finite number"),
                        ("tx_nan", "links[2].wireless.tx_power_dbm: Input should be a finite number"),
                        ("tx_huge", "links[2].wireless: the Shannon rate"))],
    ("serve-cluster-two-errors", ["serve", "--cluster", "{d}/cluster_position_nan.yaml", *SERVE[3:]],
     "position_m[0]: Input should be a finite number; nodes[2].position_m[1]"),
    ("cluster-show-memory-inf", ["cluster", "show", "{d}/cluster_memory_inf.yaml"], "must be a finite number"),
    ("plan-node-limit-2-63", [*PLAN, "--method", "exact", "--param", "node_limit=9223372036854775808"],
     "less than or equal to 2147483647"),
    ("plan-seed-2-63", [*PLAN, "--method", "random", "--param", "seed=9223372036854775808"], "2147483647"),
    ("plan-param-json-huge-int", [*PLAN, "--method", "ordermoe", "--param", "budget=[" + "9" * 5000 + "]"],
     "an integer of 5000 digits"),
    ("serve-placement-capacity-1e30", [*SERVE[:3], "--placement", "{d}/pl_capacity_1e30.json", *SERVE[5:]],
     "pl_capacity_1e30.json: capacity_bytes['a']"),
    ("serve-placement-capacity-float", [*SERVE[:3], "--placement", "{d}/pl_capacity_float.json", *SERVE[5:]],
     "expected an integer in [0,"),
    ("serve-placement-bytes-float", [*SERVE[:3], "--placement", "{d}/pl_bytes_float.json", *SERVE[5:]],
     "expert_bytes must be an [L][E] table of integers"),
    ("profile-trace-negative-weight", [*TRACE, "{d}/trace_neg_weight.jsonl"], "trace_neg_weight.jsonl:1: field 'topk_weights'"),
    ("profile-trace-1e308-weight", [*TRACE, "{d}/trace_huge_weight.jsonl"], "outside [0, 10000]"),
    ("profile-trace-nan-weight", [*TRACE, "{d}/trace_nan_weight.jsonl"], "must hold finite numbers"),
    ("profile-trace-logit-beyond-f16", [*TRACE, "{d}/trace_logit_f16.jsonl"], "field 'router_logits' holds 100000.0"),
    # round two, every output claimed the same way: inputs never overwritten, outputs distinct, folders ours
    ("profile-trace-report-user-folder", [*TRACE, "{d}/trace_ok.jsonl", "--report", "{d}/user_docs"],
     "refusing to write into"),
    ("profile-trace-report-equals-out", [*TRACE[:4], "{d}/p1", "--report", "{d}/p1", "--trace", "{d}/trace_ok.jsonl"],
     "--out and --report name the same file"),
    ("profile-trace-out-is-the-trace", [*TRACE[:4], "{d}/trace_ok.jsonl", "--trace", "{d}/trace_ok.jsonl"],
     "is also the input --trace"),
    ("profile-trace-out-user-folder", [*TRACE[:4], "{d}/user_dir", "--trace", "{d}/trace_ok.jsonl"], "refusing to replace"),
    ("plan-out-is-the-cluster", [*PLAN[:-1], "{d}/cluster.yaml", "--method", "lfu"], "is also the input --cluster"),
    ("plan-map-is-the-cluster", [*PLAN, "--method", "lfu", "--expert-map", "{d}/cluster.yaml"],
     "--expert-map {d}/cluster.yaml is also the input --cluster"),
    ("evaluate-out-is-the-profile", ["evaluate", "--profile", "{d}/prof", "--out", "{d}/prof"], "is also the input --profile"),
    ("evaluate-out-is-a-placement", ["evaluate", "--profile", "{d}/prof", "--cluster", "{d}/cluster.yaml", "--method",
                                     "a={d}/placement.json:exact", "--out", "{d}/placement.json"], "is also the input --method"),
    ("serve-out-is-the-placement", [*SERVE[:-1], "{d}/placement.json"], "is also the input --placement"),
    ("cluster-show-out-is-the-cluster", ["cluster", "show", "{d}/cluster.yaml", "--out", "{d}/cluster.yaml"],
     "is also the input CLUSTER"),
    ("report-out-is-the-results", ["report", "{d}/results.json", "--out", "{d}/results.json"], "is also the input RESULTS"),
    ("plan-profile-meta-fifo", ["plan", "--profile", "{d}/fifo_prof", "--cluster", "{d}/cluster.yaml", "--method", "lfu",
                                "--out", "{d}/new.json"], "not a profile folder"),
    ("cluster-show-out-fifo", ["cluster", "show", "{d}/cluster.yaml", "--out", "{d}/fifo"], "FIFO"),
    ("unknown-command", ["bogus"], "No such command"),
    ("unknown-option", ["plan", "--colour", "red"], "No such option"),
]


def test_the_table_is_big_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("argv", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_touches_nothing(d, far, argv, fix):
    before = snapshot(d)
    result = CliRunner().invoke(app, [a.format(d=d, far=far) for a in argv])
    err = result.stderr
    assert result.exit_code == 2, (result.exit_code, err, result.stdout, result.exception)
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert fix.format(d=d) in err, err
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


def test_report_renders_what_evaluate_profile_wrote(d, tmp_path):
    """`edgemoe report` on the results file of `edgemoe evaluate --profile` (once a KeyError: 'copies')."""
    res = tmp_path / "replay.json"
    run = CliRunner().invoke(app, ["evaluate", "--profile", str(d / "prof"), "--cluster", str(d / "cluster.yaml"),
                                   "--method", "u=uniform:exact", "--requests", "4", "--out", str(res)])
    assert run.exit_code == 0, run.output
    rep = CliRunner().invoke(app, ["report", str(res), "--out", str(tmp_path / "rep")])
    assert rep.exit_code == 0, (rep.stderr, rep.exception)
    assert (tmp_path / "rep" / "report.md").is_file() and (tmp_path / "rep" / "placements.png").is_file()
    # a results file written before replays kept the [L, E] copies renders too (no placements figure)
    doc = json.loads(res.read_text())
    for entry in doc["placements"].values():
        entry.pop("copies")
    (tmp_path / "old.json").write_text(json.dumps(doc))
    rep = CliRunner().invoke(app, ["report", str(tmp_path / "old.json"), "--out", str(tmp_path / "rep2")])
    assert rep.exit_code == 0, (rep.stderr, rep.exception)
    assert not (tmp_path / "rep2" / "placements.png").exists()


def test_a_failed_report_leaves_no_folder(d, tmp_path, monkeypatch):
    import edgemoe.report.render as render

    def broken(*_a, **_k):
        raise EdgeMoEError("the traffic plot failed")

    from edgemoe.errors import EdgeMoEError

    monkeypatch.setattr(render, "plot_traffic", broken)
    result = CliRunner().invoke(app, ["report", str(d / "results.json"), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 2 and "traffic plot failed" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_output_name_of_250_bytes_is_legal(d, tmp_path):
    out = tmp_path / ("p" * 245 + ".json")
    for _ in range(2):  # written, then replaced
        result = CliRunner().invoke(app, ["plan", "--profile", str(d / "prof"), "--cluster", str(d / "cluster.yaml"),
                                          "--method", "lfu", "--out", str(out)])
        assert result.exit_code == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_ray_address_where_nothing_listens_is_one_line_within_the_deadline(d):
    """`serve --ray-address` to a closed port: one clear line after the connect deadline, no Ray retries."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--cluster", str(d / "cluster.yaml"), "--placement",
                                          str(d / "pl_other_model.json"), "--profile", str(d / "other_prof"),
                                          "--model", str(d / "model"), "--load-users", "1", "--out", str(d / "s.json"),
                                          "--ray-address", f"127.0.0.1:{port}"])
    assert result.exit_code == 2, (result.stderr, result.exception)
    assert result.stderr.count("\n") == 1 and f"nothing answers at 127.0.0.1:{port}" in result.stderr, result.stderr
    assert not (d / "s.json").exists()


def test_ray_address_forms_are_checked_without_importing_ray(monkeypatch):
    import socket
    import sys

    from edgemoe.distributed.serve import _reachable
    from edgemoe.errors import EdgeMoEError

    had_ray = "ray" in sys.modules
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        with pytest.raises(EdgeMoEError, match=f"--ray-address auto: nothing answers at 127.0.0.1:{port}"):
            _reachable("auto", timeout_s=2.0)
        with pytest.raises(EdgeMoEError, match="nothing answers"):
            _reachable(f"ray://127.0.0.1:{port}", timeout_s=2.0)
    for bad in ("nonsense", "host:0", "host:99999", "host:port"):
        with pytest.raises(EdgeMoEError, match="expected host:port"):
            _reachable(bad, timeout_s=2.0)
    with socket.socket() as s:  # something listening: the address is returned as given
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert _reachable(f"127.0.0.1:{s.getsockname()[1]}", timeout_s=2.0) == f"127.0.0.1:{s.getsockname()[1]}"
    assert ("ray" in sys.modules) == had_ray
