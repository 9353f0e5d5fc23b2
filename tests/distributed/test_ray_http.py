"""The Ray deployment behind the HTTP app (edgemoe.serve.ray_engine), driven by the openai client."""

import numpy as np
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def test_ray_deployment_answers_through_http(lab3_deployment, tiny_path):
    from edgemoe.distributed.serve import Client
    from edgemoe.models import load_tokenizer
    from edgemoe.serve.api import create_app
    from edgemoe.serve.ray_engine import RayEngine
    from edgemoe.serve.service import ServerThread
    from edgemoe.serve.telemetry import Telemetry

    tok = load_tokenizer(str(tiny_path))
    ctx = lab3_deployment.cfg.ctx
    direct = Client(lab3_deployment).generate(1, np.array(PROMPT), 4).tokens.tolist()
    engine = RayEngine(lab3_deployment, tok, telemetry=Telemetry(ctx.node_names))
    try:
        with ServerThread(create_app(engine, "tiny")) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
            r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                     extra_body={"edgemoe": {"user": "u1"}})
            eos = tok.eos_token_id
            cut = direct[:direct.index(eos)] if eos in direct else direct
            assert r.choices[0].text == tok.decode(cut, skip_special_tokens=True)
            stats = r.model_extra["edgemoe"]
            assert stats["backend"] == "ray" and stats["home"] == "b" and stats["expert_slots"]["slots"] > 0
            chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                               stream=True, extra_body={"edgemoe": {"user": "u1"}}))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
            with pytest.raises(openai.BadRequestError) as err:
                c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)  # temperature 1 by default
            assert "temperature" in err.value.message
    finally:
        engine.close()
