"""The multi-node check of tests/distributed/test_ray_multinode.py, in a process of its own (the session's
Ray instance of the other tests cannot share a driver with a second cluster).

    python multinode_run.py TINY_MODEL_DIR   -> one JSON line on stdout

A real Ray cluster of three nodes on loopback (ray.cluster_utils.Cluster: three raylets, one GCS), each node
declaring one server's `edgemoe_node_<name>` resource, as `ray start --resources` does on real machines;
the lab3 deployment joins it with `start_ray(address=...)`, behind the HTTP app; then node b's processes
are killed (its raylet and workers) while a stream of b's user is running: the stream resumes on another
home, requests go on, and b is started again and readmitted.
"""

import json
import sys
import threading
import time
from pathlib import Path

import edgemoe.distributed  # noqa: F401  - token auth and loopback before Ray is imported

HERE = Path(__file__).resolve().parent
LONG = 24  # tokens of the stream that is running when node b dies
sys.path.insert(0, str(HERE))


def main(tiny: str) -> dict:
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from ray.cluster_utils import Cluster

    import ray
    from conftest import lab3_context
    from edgemoe.distributed.health import Backoff
    from edgemoe.distributed.serve import Deployment, join_instructions, node_resource, start_ray, stop_ray
    from edgemoe.distributed.server import ServerConfig
    from edgemoe.models import load_tokenizer
    from edgemoe.serve.api import create_app
    from edgemoe.serve.ray_engine import RayEngine
    from edgemoe.serve.service import ServerThread
    from edgemoe.serve.telemetry import Telemetry

    small = dict(num_cpus=1, object_store_memory=80 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(small, resources={node_resource("a"): 1},
                                                                include_dashboard=False))
    out: dict = {"address": cluster.address}
    try:
        nodes = {"a": cluster.head_node}
        for name in ("b", "c"):
            nodes[name] = cluster.add_node(resources={node_resource(name): 1}, **small)
        out["wrong_token"] = _join_with_wrong_token(cluster.address)
        out["ray"] = start_ray(address=cluster.address)
        dep = Deployment.launch(ServerConfig(lab3_context(), tiny, wire="fp32", call_timeout_s=3.0,
                                             backoff_base_s=0.2, backoff_max_s=1.0))
        out["namespace"] = dep.cfg.namespace
        out["join"] = join_instructions(out["ray"], dep.cfg.namespace, ("a", "b", "c"))
        placed = {d["node"]: d["ray_node"] for d in dep._get([h.cpu.remote() for h in dep.handles], 60, "report")}
        out["on_their_nodes"] = all(placed[i] == nodes[n].node_id for i, n in enumerate("abc"))
        engine = RayEngine(dep, load_tokenizer(tiny), telemetry=Telemetry(("a", "b", "c")))
        engine.client.homes.backoff = Backoff(0.2, 1.0)
        prompt = [5, 6, 7, 8, 9, 10, 11]
        with ServerThread(create_app(engine, "tiny")) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=180)

            def ask(user: str, max_tokens: int = 3) -> dict:
                r = c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"edgemoe": {"user": user}})
                return {"text": r.choices[0].text, **r.model_extra["edgemoe"]}

            out["before"] = [ask(u) for u in ("u0", "u1", "u2")]
            out["long_before"] = ask("u1", LONG)
            # a stream of user u1 (home b) is running when machine b's processes die
            first = threading.Event()
            mid: dict = {}

            def stream() -> None:
                try:
                    chunks = c.completions.create(model="tiny", prompt=prompt, max_tokens=LONG, temperature=0,
                                                  stream=True, extra_body={"edgemoe": {"user": "u1"}})
                    pieces = []
                    for ch in chunks:
                        if ch.choices and ch.choices[0].text:
                            pieces.append(ch.choices[0].text)
                            first.set()
                    mid["text"] = "".join(pieces)
                except Exception as exc:  # noqa: BLE001 - a clear error is an allowed outcome: reported
                    mid["error"] = f"{type(exc).__name__}: {exc}"
                finally:
                    first.set()

            t = threading.Thread(target=stream)
            t.start()
            first.wait(120)
            mid["pieces_before_kill"] = True
            cluster.remove_node(nodes["b"], allow_graceful=False)  # machine b's processes die
            t.join(300)
            mid["hung"] = t.is_alive()
            out["mid_stream"] = mid
            out["b_seen_dead"] = _wait_dead(ray, dep.handles[1])  # its worker outlives the raylet a moment
            out["b_down"] = [ask(u) for u in ("u1", "u0", "u1")]
            nodes["b"] = cluster.add_node(resources={node_resource("b"): 1}, **small)  # b comes back
            out["b_back_alive"] = dep.wait_alive(1, timeout_s=240)
            end = time.monotonic() + 240
            while time.monotonic() < end:
                views = [dep.health(n)["alive"] for n in (0, 2)] + [engine.client.homes.snapshot()[0].tolist()]
                if all(v == [True, True, True] for v in views):
                    break
                time.sleep(0.5)
            out["readmitted"] = views
            out["after"] = [ask(u) for u in ("u1",)]
            out["b_node_after"] = dep._get([dep.handles[1].cpu.remote()], 60, "report")[0]["ray_node"] == nodes["b"].node_id
            text = httpx.get(s.url + "/metrics").text
            out["metrics"] = {f"{x.name}{sorted(x.labels.items())}": x.value for fam in text_string_to_metric_families(text)
                              for x in fam.samples if x.name.startswith(("edgemoe_exclusions", "edgemoe_readmissions",
                                                                         "edgemoe_failovers"))}
        engine.close()
        out["failovers"] = engine.client.failovers
        dep.shutdown()
    finally:
        stop_ray()
        cluster.shutdown()
    return out


def _join_with_wrong_token(address: str) -> dict:
    """start_ray(address) in a process holding another token: its error line and how long it took."""
    import os
    import subprocess

    code = ("import time; t = time.monotonic()\n"
            "import edgemoe.distributed\n"
            "from edgemoe.distributed.serve import start_ray\n"
            "from edgemoe.errors import EdgeMoEError\n"
            "try:\n"
            f"    start_ray(address={address!r})\n"
            "except EdgeMoEError as exc:\n"
            "    print(exc)\n"
            "print(time.monotonic() - t)\n")
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    return {"rc": proc.returncode, "message": lines[0] if len(lines) > 1 else "", "seconds": float(lines[-1])}


def _wait_dead(ray, handle, timeout_s: float = 120.0) -> bool:
    """True once the actor stops answering pings (within timeout_s)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            ray.get(handle.ping.remote(), timeout=2.0)
        except Exception:  # noqa: BLE001 - dead or restarting: what we wait for
            return True
        time.sleep(0.2)
    return False


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), default=str))
