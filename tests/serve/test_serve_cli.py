"""`edgemoe serve` as a real process, and `edgemoe generate` in-process and against a running server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from edgemoe.cli import app

SRC = Path(__file__).resolve().parents[2] / "src"
SMALL = ["--planner", "uniform", "--calib-tokens", "2048"]  # the conftest deployment's inputs: its cache is hit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_a_public_address_without_a_key(monkeypatch):
    monkeypatch.delenv("EDGEMOE_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "API key" in result.stderr


def test_serve_unknown_backend():
    result = CliRunner().invoke(app, ["serve", "--backend", "grpc"])
    assert result.exit_code == 2 and "--backend" in result.stderr


def test_dial_refuses_to_write_over_its_placement(tmp_path):
    """--out naming the --placement file replaced the placement with the dial once the calibration was done."""
    placement = tmp_path / "placement.json"
    placement.write_text("{}")
    result = CliRunner().invoke(app, ["dial", "--placement", str(placement), "--out", str(placement)])
    assert result.exit_code == 2 and "--out" in result.stderr and "--placement" in result.stderr
    assert placement.read_text() == "{}"


def test_serve_on_ray_refuses_log_routing(tmp_path):
    """The Ray backend never wrote the file it was given (the option was dropped): refused before Ray starts."""
    # a dead --ray-address: were the option not checked first, the run would end at once without Ray
    result = CliRunner().invoke(app, ["serve", "--backend", "ray", "--log-routing", str(tmp_path / "r.jsonl"),
                                      "--ray-address", "127.0.0.1:9", "--placement", str(tmp_path / "p.json"),
                                      "--profile", str(tmp_path)])
    assert result.exit_code == 2 and "--log-routing" in result.stderr and "in-process" in result.stderr


@pytest.mark.parametrize("flag", ["--placement", "--profile"])
def test_serve_refuses_to_log_routing_into_an_input(tmp_path, flag):
    """--log-routing appends trace lines: given the placement file (or a profile's file) it corrupted that input."""
    placement, profile = tmp_path / "placement.json", tmp_path / "prof"
    profile.mkdir()
    placement.write_text("{}")
    (profile / "meta.json").write_text("{}")
    log = placement if flag == "--placement" else profile / "meta.json"
    result = CliRunner().invoke(app, ["serve", "--placement", str(placement), "--profile", str(profile),
                                      "--log-routing", str(log)])
    assert result.exit_code == 2 and "--log-routing" in result.stderr and flag in result.stderr
    assert log.read_text() == "{}"


@pytest.mark.parametrize("device,words", [("bogus", "not a torch device"), ("cuda:99", "cannot use it here")])
def test_serve_refuses_a_device_torch_cannot_use(serve_cache, device, words):
    """Both were internal errors (torch's RuntimeError; a CPU-only torch's AssertionError for cuda)."""
    result = CliRunner().invoke(app, ["serve", "--device", device, "--cache-dir", str(serve_cache), *SMALL])
    assert result.exit_code == 2 and f"--device {device!r}" in result.stderr and words in result.stderr


@pytest.mark.parametrize("args,name", [(["The \udcff river"], "PROMPT"), (["The river", "--stop", "\udcff"], "--stop")])
def test_generate_refuses_text_that_is_not_unicode(args, name):
    """A shell argument that is not UTF-8 reaches Python as lone surrogates (it was an internal error)."""
    result = CliRunner().invoke(app, ["generate", *args, "--max-tokens", "2"])
    assert result.exit_code == 2 and name in result.stderr and "not valid UTF-8" in result.stderr


@pytest.mark.parametrize("flag", ["--budget", "--max-ppl-increase"])
def test_generate_refuses_an_infinite_quality_option(flag):
    """inf passes typer's min=0; sent to a server it was an internal error (no JSON number spells it)."""
    result = CliRunner().invoke(app, ["generate", "The river", "--max-tokens", "2", "--url", "http://127.0.0.1:9",
                                      flag, "inf"])
    assert result.exit_code == 2 and flag in result.stderr and "finite" in result.stderr


@pytest.mark.parametrize("status,answer,words", [
    (200, {"id": "cmpl-1", "choices": [{"text": " x", "index": 0, "finish_reason": "length"}]}, "not an edgemoe"),
    (200, {"choices": []}, "not an edgemoe"),
    (200, [1, 2], "not an edgemoe"),
    (400, {"error": "a plain string"}, "400"),
    # bodies json.loads refuses with other ValueErrors than JSONDecodeError
    (200, b"\xff\xfe{", "not JSON"), (500, b'{"a": ' + b"9" * 5000 + b"}", "not JSON"),
])
def test_generate_against_a_server_that_is_not_edgemoe(status, answer, words):
    """vLLM (or any OpenAI-style server) answers without the edgemoe object: that was an internal error."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from edgemoe.serve.service import ServerThread

    async def completions(_request):
        if isinstance(answer, bytes):
            return Response(answer, status_code=status, media_type="application/json")
        return JSONResponse(answer, status_code=status)

    with ServerThread(Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])) as other:
        result = CliRunner().invoke(app, ["generate", "The river", "--max-tokens", "2", "--url", other.url])
    assert result.exit_code == 2 and words in result.stderr and "internal error" not in result.stderr


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_serve_process_answers_and_stops_on_ctrl_c(serve_cache, deployment, stop):
    """Started with SIGINT ignored, as a background job of a non-interactive shell (or an xdist worker's child)
    is: Ctrl-C and SIGTERM must stop it all the same."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(SRC), EDGEMOE_API_KEY="k1")
    proc = subprocess.Popen([sys.executable, "-c", "from edgemoe.cli import main; main()", "serve", "--port", str(port), "--cache-dir",
                             str(serve_cache), *SMALL], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        body = {"model": "default", "prompt": "Hello", "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401  # EDGEMOE_API_KEY is required
        # generous: on a fresh clone the server's first request may compile the decode path (numba, a minute or
        # more of CPU on a busy host) when no other process has filled numba's cache yet
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k1"}, timeout=900)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=60)
    assert "(cached)" in out and f"127.0.0.1:{port}" in out  # the conftest's profile and placement were reused


def test_generate_in_process_with_explain(serve_cache, deployment):
    result = CliRunner().invoke(app, ["generate", "The history of", "--max-tokens", "4", "--explain", "--exact",
                                      "--cache-dir", str(serve_cache), *SMALL])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("The history of")
    assert lines[1].startswith("token") and len(lines) >= 3
    assert "exact at" in result.stderr


def test_generate_against_a_server(server):
    result = CliRunner().invoke(app, ["generate", "Once upon", "--url", server.url, "--max-tokens", "3", "--explain",
                                      "--user", "u-rtx4090-b-1"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("Once upon") and "rtx4090-b" in result.stderr
    bad = CliRunner().invoke(app, ["generate", "x", "--url", server.url, "--model", "nope"])
    assert bad.exit_code == 2 and "404" in bad.stderr
