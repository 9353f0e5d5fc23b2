"""The engine without HTTP: batching invariance of seeded requests, budgets, sampling and text streaming."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgemoe.distributed.sampling import SamplingParams, filtered_logits, next_token
from edgemoe.serve.engine import Engine, GenerationRequest, run_to_end, slot_kinds
from edgemoe.serve.text import TextStream, plain_chat_prompt

PROMPTS = ["The history of the city", "In the morning", "def main():", "Once upon"]


def _requests(deployment, exact=False):
    tok = deployment.tokenizer
    return [GenerationRequest(tuple(tok(p)["input_ids"]), 10, SamplingParams(1.0, 0.95, 50, seed), user=seed % 3,
                              exact=exact, request_id=f"r{seed}")
            for seed, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("exact", [False, True])
def test_batched_sequences_give_the_texts_they_give_alone(deployment, exact):
    """Queued before the loop starts, the four requests are admitted in one step and decoded as one batch."""
    from edgemoe.serve.telemetry import Telemetry

    reqs = _requests(deployment, exact)
    alone_engine = Engine(deployment, max_running=1, max_queue=0)
    try:
        alone = [run_to_end(alone_engine, r)[0] for r in reqs]
    finally:
        alone_engine.close()
    tele = Telemetry(deployment.ctx.node_names)
    engine = Engine(deployment, max_running=4, max_queue=4, telemetry=tele, start=False)
    events: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.submit(r, events[r.request_id].append)
    engine.start()
    import time

    deadline = time.monotonic() + 300
    while not all(ev and type(ev[-1]).__name__ == "Finished" for ev in events.values()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    engine.close()
    batched = ["".join(e.text for e in events[r.request_id] if type(e).__name__ == "Delta") for r in reqs]
    assert batched == alone
    sizes = {s.labels["le"]: s.value for fam in tele.registry.collect() if fam.name == "edgemoe_batch_size"
             for s in fam.samples if s.name.endswith("_bucket")}
    assert sizes["4.0"] > sizes["2.0"]  # some decode passes ran all four sequences together


def test_request_budget_is_capped_by_the_deployment(deployment):
    engine = Engine(deployment, start=False)
    ceiling = float(engine.policy.allowance[0])
    assert engine.allowance(GenerationRequest((1,), 1, budget=10 * ceiling + 1)) == ceiling
    assert engine.allowance(GenerationRequest((1,), 1, budget=0.0)) == 0.0
    assert engine.allowance(GenerationRequest((1,), 1, exact=True)) == 0.0
    engine.close()


def test_slot_kinds_partition():
    topk = np.array([[1, 2], [3, 4], [5, 6]])
    experts = np.array([[1, 7], [-1, 4], [-1, 6]])
    node = np.array([[0, 0], [-1, 2], [-1, 0]])
    location = np.array([0, 0, 0])
    zeroed = np.array([[False, False], [False, False], [True, False]])
    kinds = slot_kinds(topk, experts, node, location, zeroed)
    # local, substituted / dropped, remote / zeroed, local
    assert kinds.tolist() == [[0, 2], [3, 1], [4, 0]]


def test_sampling_cuts():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filtered_logits(logits, SamplingParams(1.0, 1.0, 2, 0))[2:]).all()
    probs = torch.softmax(logits, 0)  # 0.644, 0.237, 0.087, 0.032
    kept = torch.isfinite(filtered_logits(logits, SamplingParams(1.0, 0.85, 0, 0)))
    assert kept.tolist() == [True, True, False, False] and probs[:2].sum() >= 0.85
    assert next_token(logits, SamplingParams(0.0, 1.0, 0, 0), 0) == 0
    p = SamplingParams(1.0, 1.0, 0, 42)
    a = [next_token(logits, p, i) for i in range(40)]
    assert a == [next_token(logits, p, i) for i in range(40)]  # a draw depends on (seed, index) alone
    assert a[20:] == [next_token(logits, p, i) for i in range(20, 40)]  # so a resumed stream draws the same
    assert a != [next_token(logits, SamplingParams(1.0, 1.0, 0, 43), i) for i in range(40)]
    assert len(set(a)) > 1  # the draws differ from token to token
    with pytest.raises(ValueError):
        SamplingParams(1.0, 0.0, 0, 0)


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-20, 1e-6])
def test_a_tiny_temperature_draws_the_most_likely_token(temperature):
    """Any temperature in (0, 2] is a valid request: scaled logits must stay finite or -inf (1e-300 gave nan)."""
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        logits = torch.randn(50, generator=g) * 10
        for top_p, top_k in ((1.0, 0), (0.5, 5)):
            p = SamplingParams(temperature, top_p, top_k, 0)
            assert not torch.isnan(filtered_logits(logits, p)).any()
            assert next_token(logits, p, 0) == int(torch.argmax(logits))


def test_text_stream_holds_back_a_possible_stop(deployment):
    tok = deployment.tokenizer
    ids = tok("alpha beta gamma delta")["input_ids"]
    s = TextStream(tok, stop=("gamma",))
    pieces = [s.add(i) for i in ids]
    out = "".join(pieces) + s.finish()
    assert out == "alpha beta " and s.stopped_at is not None
    plain = TextStream(tok)
    assert "".join(plain.add(i) for i in ids) + plain.finish() == "alpha beta gamma delta"


def test_plain_chat_template():
    text = plain_chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "System: Be brief.\nUser: Hi\nAssistant:"


def test_routing_log_is_a_trace_profile_reads(deployment, tmp_path):
    """The served routing, logged, becomes a profile of the same model: every token row once, all layers."""
    from edgemoe.models.loader import resolve_model_path
    from edgemoe.profile.trace import trace_profile

    log = tmp_path / "served.jsonl"
    engine = Engine(deployment, log_routing=str(log))
    try:
        finished = [run_to_end(engine, r)[2] for r in _requests(deployment)[:2]]
    finally:
        engine.close()
    ctx = deployment.ctx
    rows = sum(sum(f.stats["expert_slots"].values()) for f in finished) // (ctx.num_layers * ctx.top_k)
    prof, tr = trace_profile([log], resolve_model_path("default"))
    assert (prof.L, prof.E) == (ctx.num_layers, ctx.num_experts)
    assert tr.counts["requests"] == 2 and tr.counts["tokens_dropped_incomplete"] == 0
    assert tr.counts["tokens_kept"] == rows
    assert prof.meta.similarity == "router-logits"


def test_a_tokenizers_own_chat_template_is_used(deployment):
    import copy

    from edgemoe.serve.text import CHAT_STOP, chat_prompt

    msgs = [{"role": "user", "content": "Hi"}]
    assert chat_prompt(deployment.tokenizer, msgs) == (plain_chat_prompt(msgs), CHAT_STOP)
    tok = copy.deepcopy(deployment.tokenizer)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    assert chat_prompt(tok, msgs) == ("<user>Hi<assistant>", ())
