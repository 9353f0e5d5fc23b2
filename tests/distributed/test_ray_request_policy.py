"""A request's own `budget`, `exact: true` and `explain: true` on the Ray deployment (the home runs the policy)
give what the in-process engine gives for the same model, context and policy: the same greedy text, the same
slots by kind, the same budget spent and granted, and the same per-token explanation. Driven by the openai
client against a real uvicorn server in front of a real Ray deployment running OrderMoE on lab3."""

import numpy as np
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

PROMPT = (5, 6, 7, 8, 9, 10, 11)
POLICY = ("ordermoe", (("budget", 0.5),))  # a budget at which OrderMoE substitutes, drops and zeroes slots


@pytest.fixture(scope="module")
def in_process(lab3, tiny_path):
    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.serve.engine import Engine
    from edgemoe.serve.setup import Deployment, DeploymentSpec

    spec = DeploymentSpec(model=str(tiny_path), policy=POLICY[0], policy_params=POLICY[1])
    engine = Engine(Deployment(spec, load_moe(str(tiny_path)), load_tokenizer(str(tiny_path)), lab3()))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ray_engine(lab3_deployment, tiny_path):
    """(the session's lab3 deployment running POLICY, its RayEngine); the deployment's own configuration is put
    back when the module's tests are done.

    Why the session's deployment, reconfigured: `configure` gives every server a fresh core and home (new
    policy, empty queues and budgets) without starting processes, where a deployment of this module's own cost
    a second set of server processes (about 17 CPU s, half a minute on a busy 2-core host)."""
    from dataclasses import replace

    from edgemoe.models import load_tokenizer
    from edgemoe.serve.ray_engine import RayEngine

    dep, before = lab3_deployment, lab3_deployment.cfg
    # use_load off: the in-process engine's policy sees no node backlogs, so neither may the homes' (the
    # decisions would otherwise depend on the emulated queues)
    dep.configure(replace(before, policy=POLICY[0], policy_params=POLICY[1], use_load=False))
    engine = RayEngine(dep, load_tokenizer(str(tiny_path)))
    try:
        yield dep, engine
    finally:
        engine.close()
        dep.configure(before)


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ray_client(ray_engine):
    from edgemoe.serve.api import create_app
    from edgemoe.serve.service import ServerThread

    with ServerThread(create_app(ray_engine[1], "tiny")) as s:
        yield _client(s.url)


def local_answer(engine, **edgemoe):
    from edgemoe.distributed.sampling import SamplingParams
    from edgemoe.serve.engine import GenerationRequest, run_to_end

    req = GenerationRequest(PROMPT, 6, SamplingParams(temperature=0.0), user=1, request_id=engine.new_request_id(),
                            **edgemoe)
    text, _, finished = run_to_end(engine, req)
    return text, finished.stats


@pytest.mark.parametrize("edgemoe", [{}, {"budget": 0.05}, {"budget": 0.0}, {"exact": True}, {"explain": True}],
                         ids=["own-budget", "budget-0.05", "budget-0", "exact", "explain"])
def test_request_fields_give_the_in_process_answer(ray_client, in_process, edgemoe):
    text, local = local_answer(in_process, **edgemoe)
    r = ray_client.completions.create(model="tiny", prompt=list(PROMPT), max_tokens=6, temperature=0,
                                      extra_body={"edgemoe": {"user": "u1", **edgemoe}})
    remote = r.model_extra["edgemoe"]
    assert r.choices[0].text == text
    assert remote["policy"] == local["policy"] == ("exact" if edgemoe.get("exact") else "ordermoe")
    slots = {k: remote["expert_slots"][k] for k in local["expert_slots"]}
    assert slots == local["expert_slots"]
    assert remote["budget_spent"] == pytest.approx(local["budget_spent"], rel=1e-6, abs=1e-9)  # float rounding of the gates
    assert remote["budget_granted"] == pytest.approx(local["budget_granted"], rel=1e-12)
    if edgemoe.get("budget") == 0.0 or edgemoe.get("exact"):  # nothing may stand in: every routed expert runs
        assert slots["substituted"] == slots["dropped"] == slots["zeroed"] == 0 and remote["budget_spent"] == 0
    if not edgemoe:  # the deployment's own budget is spent: the budget-0 and exact rows above are a real change
        assert slots["substituted"] + slots["dropped"] + slots["zeroed"] > 0
    assert ("explain" in remote) == bool(edgemoe.get("explain"))
    if edgemoe.get("explain"):
        assert remote["explain"] == local["explain"]
        assert len(remote["explain"]) == r.usage.completion_tokens
        kinds = [slot["kind"] for tok in remote["explain"] for layer in tok["layers"] for slot in layer]
        # the explanation covers the generated tokens' rows only; the counts cover the prompt's rows too
        assert len(kinds) == r.usage.completion_tokens * in_process.ctx.num_layers * 2  # K = 2
        assert all(kinds.count(k) <= local["expert_slots"][k] for k in set(kinds))


def test_a_request_budget_is_capped_by_the_deployment(ray_client, in_process):
    """A budget over the deployment's allowance is the deployment's allowance (the operator's ceiling)."""
    over = ray_client.completions.create(model="tiny", prompt=list(PROMPT), max_tokens=4, temperature=0,
                                         extra_body={"edgemoe": {"user": "u1", "budget": 50.0}})
    own = ray_client.completions.create(model="tiny", prompt=list(PROMPT), max_tokens=4, temperature=0,
                                        extra_body={"edgemoe": {"user": "u1"}})
    a, b = over.model_extra["edgemoe"], own.model_extra["edgemoe"]
    assert over.choices[0].text == own.choices[0].text and a["expert_slots"] == b["expert_slots"]
    assert b["budget_granted"] > 0 and a["budget_granted"] == pytest.approx(b["budget_granted"])
    layers = in_process.ctx.num_layers
    rows = len(PROMPT) + over.usage.completion_tokens - 1  # the prompt's rows, then one row per later token
    assert a["budget_granted"] == pytest.approx(0.5 * layers * rows)
    assert np.isfinite(a["budget_spent"]) and a["budget_spent"] <= a["budget_granted"] + 1e-9


def test_a_dial_calibrated_in_process_serves_max_ppl_increase_on_ray(ray_engine, in_process, tmp_path):
    """A dial file made on the in-process deployment is accepted by the Ray server of the same model, cluster,
    placement, mode and policy (`ray_identity` == `identity`), refused by another policy's, and a request's
    `max_ppl_increase` runs the dial's mixture of two budgets over its token rows as the in-process engine does."""
    from dataclasses import replace

    from edgemoe.distributed.batching import mix_rows
    from edgemoe.errors import EdgeMoEError
    from edgemoe.eval.dial import QualityDial, save_dial
    from edgemoe.serve.api import create_app
    from edgemoe.serve.dial import identity, ray_identity
    from edgemoe.serve.service import ServerThread, deployment_dial

    dep, engine = ray_engine
    assert ray_identity(dep.cfg) == identity(in_process.dep)
    path = tmp_path / "dial.json"
    save_dial(path, QualityDial(np.array([0.0, 0.05, 0.5]), np.array([0.0, 0.02, 0.08]), "ordermoe", 512, "isotonic"),
              identity(in_process.dep))
    dial = deployment_dial(str(path), ray_identity(dep.cfg))
    with pytest.raises(EdgeMoEError, match="policy_params"):
        deployment_dial(str(path), ray_identity(replace(dep.cfg, policy_params=(("budget", 0.25),))))
    # (at 0.03 one slot's near-tie between a substitute and a drop falls the other way on the two backends, from
    # the gates' float rounding: the same budget spent to 1e-8, slots 13/2 vs 14/1; 0.04 has no such tie)
    asked = 0.04
    low, high, share = dial.mix(asked)
    assert (low, high) == (0.05, 0.5) and 0.1 < share < 0.9  # inside a step: a mixture of its two budgets
    with ServerThread(create_app(engine, "tiny", dial=dial)) as s:
        by_dial = _client(s.url).completions.create(model="tiny", prompt=list(PROMPT), max_tokens=6, temperature=0,
                                                    extra_body={"edgemoe": {"user": "u1", "max_ppl_increase": asked}})
    text, local = local_answer(in_process, budget=low, budget_mix=(high, share))  # the same mixture in-process
    a = by_dial.model_extra["edgemoe"]
    assert by_dial.choices[0].text == text
    assert {k: a["expert_slots"][k] for k in local["expert_slots"]} == local["expert_slots"]
    assert a["budget_spent"] == pytest.approx(local["budget_spent"], rel=1e-6, abs=1e-9)
    rows = np.arange(len(PROMPT) + by_dial.usage.completion_tokens - 1)  # the prompt's rows, then one per token
    want = mix_rows(low, high, share, rows).sum() * in_process.ctx.num_layers
    assert a["budget_granted"] == pytest.approx(want) == pytest.approx(local["budget_granted"])
    assert low * len(rows) < want / in_process.ctx.num_layers < high * len(rows)  # both budgets were dealt
