"""Fixtures of the serving tests: one deployment of the shipped default model on edge8 (a small profile and
a uniform placement, cached in a temporary folder), its service running OrderMoE, and a real uvicorn server
on a free loopback port, started in a thread and stopped at the end of the session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def serve_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-cache")


@pytest.fixture(scope="session")
def deployment(serve_cache):
    from edgemoe.serve.setup import DeploymentSpec, load_deployment

    # uniform: planned in well under a second (ordermoe's planner takes ~15 s on edge8); the policy still decides
    spec = DeploymentSpec(planner="uniform", cache_dir=str(serve_cache), calib_tokens=2048, policy="ordermoe")
    return load_deployment(spec)


@pytest.fixture(scope="session")
def service(deployment):
    from edgemoe.serve.service import make_service

    svc = make_service(deployment.spec, deployment=deployment, max_running=8, max_queue=32)
    yield svc
    svc.close()


@pytest.fixture(scope="session")
def server(service):
    from edgemoe.serve.service import ServerThread

    with ServerThread(service.app) as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
