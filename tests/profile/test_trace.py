"""Routing traces in: format, errors naming file:line and field, drops, specs, and the profile they give."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import load_profile, synthetic_profile
from edgemoe.profile.specs import BUILTIN, model_spec
from edgemoe.profile.stats import coselection_similarity
from edgemoe.profile.trace import read_trace, trace_profile, write_trace


def _line(**kw) -> str:
    d = {"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, "topk_ids": [0, 1], "topk_weights": [0.6, 0.4]}
    d.update(kw)
    return json.dumps({k: v for k, v in d.items() if v is not None}) + "\n"


def _write(path, lines, gz=False):
    data = "".join(lines)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    return path


# -------------------------------------------------------------------------------------------- specs


def test_builtin_specs_match_published_dimensions():
    want = {  # (MoE layers, E, K, hidden, expert MB in bf16, first MoE layer)
        "mixtral-8x7b": (32, 8, 2, 4096, 352.3, 0),
        "qwen1.5-moe-a2.7b": (24, 60, 4, 2048, 17.3, 0),
        "qwen3-30b-a3b": (48, 128, 8, 2048, 9.4, 0),
        "deepseek-v2-lite": (26, 64, 6, 2048, 17.3, 1),
        "olmoe-1b-7b": (16, 64, 8, 2048, 12.6, 0),
        "switch-base-8": (12, 8, 1, 768, 9.4, 1),
    }
    assert set(BUILTIN) == set(want)
    for name, (L, E, K, H, mb, first) in want.items():
        s = model_spec(name)
        assert (s.num_layers, s.num_experts, s.top_k, s.hidden_size) == (L, E, K, H), name
        assert round(s.expert_bytes()[0, 0] / 1e6, 1) == mb, name
        assert s.moe_layer_ids[0] == first and s.hidden_bytes == 2 * H
        assert (s.expert_flops() == 2 * s.expert_params).all()
    assert model_spec("switch-base-8").moe_layer_ids == (1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23)


def test_spec_from_hf_config_file(tmp_path):
    import edgemoe

    s = model_spec(str(Path(edgemoe.__file__).parent / "assets" / "default_model" / "config.json"))  # no torch import
    assert (s.num_layers, s.num_experts, s.top_k, s.hidden_size) == (4, 16, 2, 128)
    cfg = {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 6, "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert model_spec(str(tmp_path)).moe_layer_ids == (1, 5)  # (i+1) % 2 == 0, minus the dense layer 3
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(EdgeMoEError, match="model_type 'llama'"):
        model_spec(str(tmp_path))
    with pytest.raises(EdgeMoEError, match="not a built-in spec"):
        model_spec("no-such-model")


# -------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("gz", [False, True])
def test_write_then_read_round_trips_routing(tmp_path, gz):
    p = synthetic_profile(num_layers=4, num_experts=16, top_k=2, num_tokens=60, seed=1)
    T = p.num_tokens
    req = [f"q{t // 20}" for t in range(T)]
    path = write_trace(tmp_path / ("t.jsonl.gz" if gz else "t.jsonl"), p.topk, p.gates, range(4), req, np.arange(T) % 20,
                       domain=[p.meta.domains[d] for d in p.domain], router_logits=p.router_logits)
    spec = model_spec(str(_tiny_config(tmp_path)))
    prof, tr = trace_profile([path], spec)
    assert (prof.topk == p.topk).all() and np.allclose(prof.gates, p.gates, atol=1e-4)
    assert prof.meta.similarity == "router-logits" and tr.counts["tokens_dropped_incomplete"] == 0
    assert np.allclose(prof.sim, p.sim, atol=2e-3)  # logits were rounded to 4 decimals on the way
    assert prof.meta.domains == sorted(set(p.meta.domains))
    prof.save(tmp_path / "prof")
    back = load_profile(tmp_path / "prof")
    assert back.meta.source["kind"] == "trace" and back.meta.source["tokens_kept"] == T


def _tiny_config(tmp_path):
    cfg = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
           "num_local_experts": 16, "num_experts_per_tok": 2}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))
    return path


def test_tokens_ordered_by_request_then_position_and_incomplete_dropped(tmp_path):
    spec = model_spec("mixtral-8x7b")
    lines = [json.dumps({"type": "meta", "model": "mistralai/Mixtral-8x7B-v0.1"}) + "\n",
             json.dumps({"type": "stats", "x": 1}) + "\n", "\n"]
    # request b logged first; its tokens arrive out of order; token (a, 1) misses layer 2
    for req, pos, layers, first in [("b", 1, (0, 2), 3), ("b", 0, (0, 2), 4), ("a", 0, (0, 2), 5), ("a", 1, (0,), 6)]:
        lines += [_line(req_id=req, token_idx=pos, layer=layer, topk_ids=[first, layer + 1 if layer + 1 != first else 7])
                  for layer in layers]
    tr = read_trace([_write(tmp_path / "t.jsonl", lines)], spec)
    assert tr.layer_ids == (0, 2)  # the logged layers, not all 32
    assert tr.topk[:, 0, 0].tolist() == [4, 3, 5]  # (b,0), (b,1), (a,0)
    assert tr.counts["tokens_dropped_incomplete"] == 1 and tr.counts["tokens_kept"] == 3
    assert tr.counts["skipped_by_type"] == {"meta": 1, "stats": 1}
    assert tr.domains == ("all",) and tr.router_logits is None
    assert tr.meta_models == ("mistralai/Mixtral-8x7B-v0.1",)


def test_meta_line_names_the_model_when_no_spec(tmp_path):
    lines = [json.dumps({"type": "meta", "model": "allenai/OLMoE-1B-7B-0924"}) + "\n",
             _line(topk_ids=list(range(8)), topk_weights=[0.125] * 8)]
    tr = read_trace([_write(tmp_path / "t.jsonl.gz", lines, gz=True)], None)
    assert tr.spec.name == "olmoe-1b-7b"
    with pytest.raises(EdgeMoEError, match="no --model-spec"):
        read_trace([_write(tmp_path / "u.jsonl", [_line()])], None)


@pytest.mark.parametrize("bad, match", [
    ('{"type": "route", "req_id": "r",', "invalid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (_line(req_id=None), "field 'req_id'"),
    (_line(token_idx=-1), "field 'token_idx' must be an integer >= 0"),
    (_line(token_idx=True), "field 'token_idx'"),
    (_line(layer=40), "field 'layer' is 40, not a MoE layer of mixtral-8x7b; its MoE layers are 0-31"),
    (_line(topk_ids=[0]), "field 'topk_ids' must be a list of 2 numbers, got a list of 1"),
    (_line(topk_ids=[0, 8]), r"expert ids in \[0, 8\)"),
    (_line(topk_ids=[3, 3]), "repeats an expert"),
    (_line(topk_weights=[0.5, "x"]), "field 'topk_weights' must hold finite numbers"),
    (_line(router_logits=[0.0] * 7), "field 'router_logits' must be a list of 8 numbers"),
    (_line(domain=""), "field 'domain' must be a non-empty string"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, bad, match):
    path = _write(tmp_path / "t.jsonl", [_line(token_idx=5), bad.rstrip("\n") + "\n"])
    with pytest.raises(EdgeMoEError, match=match) as exc:
        read_trace([path], "mixtral-8x7b")
    assert f"{path}:2" in str(exc.value)


def test_repeated_token_layer_is_an_error_naming_both_lines(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_line(), _line(layer=1)])
    b = _write(tmp_path / "b.jsonl", [_line(layer=2), _line(layer=1)])
    with pytest.raises(EdgeMoEError, match=rf"{b}:2: \(req_id 'r', token_idx 0, layer 1\) repeats line {a}:2"):
        read_trace([a, b], "mixtral-8x7b")


def test_conflicting_domain_and_empty_and_missing_files(tmp_path):
    path = _write(tmp_path / "t.jsonl", [_line(domain="x"), _line(layer=1, domain="y")])
    with pytest.raises(EdgeMoEError, match="t.jsonl:2: field 'domain' is 'y'"):
        read_trace([path], "mixtral-8x7b")
    with pytest.raises(EdgeMoEError, match="no route lines"):
        read_trace([_write(tmp_path / "m.jsonl", ['{"type": "meta"}\n'])], "mixtral-8x7b")
    with pytest.raises(EdgeMoEError, match="trace file not found"):
        read_trace([tmp_path / "nope.jsonl"], "mixtral-8x7b")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(EdgeMoEError, match="bad.jsonl.gz:1: the trace file is damaged"):
        read_trace([tmp_path / "bad.jsonl.gz"], "mixtral-8x7b")


# ------------------------------------------------------------------------- profile without logits


def test_coselection_similarity_known_answer():
    # layer of 3 experts: tokens pick {0,1} with gates (.5,.5) twice and {0,2} with (1, 0)... (gate 0 means unused)
    topk = np.array([[[0, 1]], [[0, 1]], [[0, 2]]])
    gates = np.array([[[0.5, 0.5]], [[0.5, 0.5]], [[0.8, 0.2]]])
    sim = coselection_similarity(topk, gates, 3)[0]
    # columns: e0 = (.5, .5, .8), e1 = (.5, .5, 0), e2 = (0, 0, .2)
    e0, e1, e2 = np.array([.5, .5, .8]), np.array([.5, .5, 0]), np.array([0, 0, .2])
    cos = lambda a, b: a @ b / np.linalg.norm(a) / np.linalg.norm(b)  # noqa: E731
    assert np.allclose(sim, [[1, cos(e0, e1), cos(e0, e2)], [cos(e0, e1), 1, 0], [cos(e0, e2), 0, 1]])


def test_trace_without_logits_or_domain_plans_on_every_preset(tmp_path):
    p = synthetic_profile(num_layers=4, num_experts=16, top_k=2, num_tokens=200, seed=3)
    path = write_trace(tmp_path / "t.jsonl", p.topk, p.gates, range(4), [f"r{t // 50}" for t in range(200)],
                       np.arange(200) % 50)
    prof, _ = trace_profile([path], model_spec(str(_tiny_config(tmp_path))))
    assert prof.meta.similarity == "co-selection" and prof.router_logits.shape == (0, 4, 16)
    assert prof.meta.subst_err_source.startswith("estimated")
    assert np.allclose(np.diagonal(prof.subst_err, axis1=1, axis2=2), 0) and (prof.subst_err >= 0).all()
    prof.save(tmp_path / "prof")
    prof = load_profile(tmp_path / "prof")
    from edgemoe.cluster.presets import PRESETS

    for preset in PRESETS:  # one domain: every user follows it, no --domain-fallback needed
        problem = plan_problem(prof, preset)
        assert (problem.user_domain == 0).all()
        for method in ("lfu", "greedy", "ordermoe"):
            plan(problem, method)
    from edgemoe.plan.base import planners

    edge8 = plan_problem(prof, "edge8")
    for method in sorted(set(planners()) - {"exact"}):  # every planner (but the slow ILP) takes it
        plan(edge8, method)


def test_cli_takes_several_trace_files_after_one_flag(tmp_path):
    from typer.testing import CliRunner

    from edgemoe.cli import app

    p = synthetic_profile(num_layers=4, num_experts=16, top_k=2, num_tokens=40, seed=4)
    cfg = str(_tiny_config(tmp_path))
    a = write_trace(tmp_path / "a.jsonl", p.topk[:20], p.gates[:20], range(4), ["a"] * 20, np.arange(20))
    b = write_trace(tmp_path / "b.jsonl.gz", p.topk[20:], p.gates[20:], range(4), ["b"] * 20, np.arange(20))
    r = CliRunner().invoke(app, ["profile", "--trace", str(a), str(b), "--model-spec", cfg, "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    assert "40 tokens kept" in r.output and "similarity from co-selection" in r.output
    assert load_profile(tmp_path / "p").num_tokens == 40
    r = CliRunner().invoke(app, ["profile", str(a), "--out", str(tmp_path / "q")])
    assert r.exit_code == 2 and "trace files follow --trace" in r.output


def test_pair_counted_statistics_equal_one_hot_brute_force():
    """coactivation / transitions / co-selection count K x K slot pairs; check against one-hot sets."""
    from edgemoe.profile import stats

    rng = np.random.default_rng(0)
    T, L, E, K = 50, 3, 6, 3
    topk = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)])
    gates = rng.uniform(0.1, 1.0, size=(T, L, K))
    onehot = np.zeros((T, L, E))
    weighted = np.zeros((T, L, E))
    for t in range(T):
        for layer in range(L):
            onehot[t, layer, topk[t, layer]] = 1.0
            weighted[t, layer, topk[t, layer]] = gates[t, layer]
    assert np.array_equal(stats.coactivation(topk, E), np.einsum("tle,tlf->lef", onehot, onehot))
    counts = np.einsum("tle,tlf->lef", onehot[:, :-1], onehot[:, 1:])
    assert np.allclose(stats.transitions(topk, E), counts / counts.sum(2, keepdims=True))
    assert np.allclose(stats.coselection_similarity(topk, gates, E), stats.router_similarity(weighted))


# ------------------------------------------------------- what profile --trace writes, plan accepts (issue 22)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_any_float = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, -1e308, 65504.0, 7e4, 1e4, -0.0, 5e-324])


@st.composite
def _token_lines(draw):
    lines = []
    for t in range(draw(st.integers(1, 4))):
        ids = draw(st.lists(st.integers(0, 7), min_size=2, max_size=2, unique=True))
        line = {"req_id": "r", "token_idx": t, "layer": 0, "topk_ids": ids,
                "topk_weights": draw(st.lists(_any_float, min_size=2, max_size=2))}
        if draw(st.booleans()):
            line["router_logits"] = draw(st.lists(_any_float, min_size=8, max_size=8))
        lines.append(line)
    if any("router_logits" in x for x in lines) and not all("router_logits" in x for x in lines):
        for x in lines:
            x.pop("router_logits", None)
    return lines


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=_token_lines())
def test_whatever_profile_trace_accepts_plan_accepts(tmp_path_factory, lines):
    """Any trace `profile --trace` reads gives a profile that `load_profile` and the planners accept: the
    trace reader refuses every number the profile could not store (NaN, inf, negative or huge gates,
    logits beyond float16), with the file and line."""
    folder = tmp_path_factory.mktemp("prop")
    path = _write(folder / "t.jsonl", [json.dumps({"type": "route", **x}) + "\n" for x in lines])
    try:
        prof, _ = trace_profile([path], "mixtral-8x7b")
    except EdgeMoEError as exc:
        assert "t.jsonl:" in str(exc) and ("topk_weights" in str(exc) or "router_logits" in str(exc)), exc
        return
    prof.save(folder / "p")
    loaded = load_profile(folder / "p")
    placement = plan(plan_problem(loaded, "device-edge-cloud"), "lfu")
    assert placement.hosts.shape[1:] == (1, 8)


def test_profile_trace_reads_stdin_for_a_dash(tmp_path):
    """`edgemoe profile --trace -` reads one trace from stdin (plain or gzip), like a file."""
    from typer.testing import CliRunner

    from edgemoe.cli import app

    text = "".join(_line(req_id=f"r{i}", layer=k, topk_ids=[i % 8, (i + 1) % 8]) for i in range(6) for k in range(32))
    for name, data in (("plain", text.encode()), ("gz", gzip.compress(text.encode(), mtime=0))):
        out = tmp_path / name
        result = CliRunner().invoke(app, ["profile", "--model-spec", "mixtral-8x7b", "--out", str(out), "--trace", "-"],
                                    input=data)
        assert result.exit_code == 0, (result.stderr, result.exception)
        assert load_profile(out).num_tokens == 6
