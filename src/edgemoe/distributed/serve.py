"""Ray plumbing: start or join Ray safely, one actor per server, a client with fail-over, closed-loop load.

    from edgemoe.distributed.serve import start_ray, Deployment, Client
    start_ray()                                     # local, 127.0.0.1, token auth, small object store
    dep = Deployment.launch(ServerConfig(ctx, model_path, policy="ordermoe", policy_params=(("budget", 0.05),)))
    client = Client(dep)
    result = client.generate(user=3, prompt=ids, gen_tokens=16)

Every server is an actor named `edgemoe-<node>`, in a Ray namespace of its deployment's own
(`edgemoe-<8 hex>`: two deployments on one Ray cluster never collide), pinned by a 0.01 share of the custom
resource `edgemoe_node_<node>`; the local instance declares one unit of each, a real cluster declares each on
the machine that plays that server (docs/distributed.md). Actors restart after a crash (Ray reruns
their constructor, which reloads their experts); homes probe excluded servers with backoff and
readmit them once they answer with the current configuration.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from edgemoe.errors import EdgeMoEError

from .health import Backoff, Membership
from .server import HomeEngine, ServerConfig, ServerCore, Transport
from .weights import checkpoint_hidden_size
from .wire import ExpertCall, GenerateRequest, GenerateResult

NAMESPACE = "edgemoe"
DEFAULT_OBJECT_STORE_BYTES = 200 * 2**20
log = logging.getLogger("edgemoe.distributed")
# What a server's actor takes of its machine's `edgemoe_node_<name>` unit: a pin, not a reservation, so that
# several deployments (each in its own namespace) can share one Ray cluster.
NODE_SHARE = 0.01


def node_resource(name: str) -> str:
    """The custom resource that pins server `name` to a machine: `edgemoe_node_<name>`."""
    return "edgemoe_node_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def actor_name(name: str) -> str:
    return f"edgemoe-{name}"


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at each line (a program, or a test runner, may swap it)."""

    @property
    def stream(self):
        import sys

        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def log_to_stderr() -> None:
    """Exclusions, failovers and readmissions (logger `edgemoe.distributed`, INFO and up) as one stderr line each,
    unless the program configured that logger itself."""
    if not log.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _ray():
    try:
        import ray
    except ImportError as exc:  # the optional extra
        raise EdgeMoEError("the ray backend needs Ray: pip install -e '.[ray]'") from exc
    return ray


def start_ray(node_names=(), address: str | None = None, num_cpus: int = 2,
              object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES, auth: bool = True) -> dict:
    """Start a local Ray instance bound to 127.0.0.1 with one unit of each server's resource, or join the
    cluster at `address`. Token authentication is switched on (RAY_AUTH_MODE=token) unless auth=False or
    the environment already chose; a local instance generates its own token. Returns what was done."""
    import sys

    from . import RAY_IMPORTED_TOO_EARLY

    if address:
        address = _reachable(address)  # one clear line now, instead of Ray's retries and warnings
    if auth and (os.environ.get("RAY_AUTH_MODE") != "token" or RAY_IMPORTED_TOO_EARLY):
        if "ray" in sys.modules:  # Ray read the mode at import: too late to switch it on here
            raise EdgeMoEError("Ray was imported before token authentication was chosen: import edgemoe.distributed "
                               "before ray, or set RAY_AUTH_MODE=token (or pass auth=False knowingly)")
        os.environ["RAY_AUTH_MODE"] = "token"
    ray = _ray()
    if ray.is_initialized():
        return {"started": False, "address": "already initialised"}
    common = dict(namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    if address:
        # Ray's own wait for a GCS that stops answering is bounded too (its default is a minute of retries)
        os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(int(CONNECT_TIMEOUT_S)))
        # edgemoe.distributed keeps Ray's node address on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); joining a
        # cluster on other machines, this driver's node is the interface that reaches the head (where its raylet is).
        _check_token(address)
        own_ip = _local_ip_towards(address)
        ray.init(address=address, **common, **({"_node_ip_address": own_ip} if own_ip else {}))
        return {"started": False, "address": address, "auth": os.environ.get("RAY_AUTH_MODE", "disabled")}
    # No dashboard, no Ray client server, no job API: the only entry points are Ray's core RPCs, which
    # token authentication guards; with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (set by edgemoe.distributed)
    # they listen on 127.0.0.1 only (docs/distributed.md "Security").
    # address="local": always a fresh instance of our own. Without it Ray joins whatever RAY_ADDRESS or a
    # stale /tmp/ray/ray_current_cluster (left by any earlier `ray start`) names, and then refuses num_cpus.
    from ray._private import ray_constants

    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "1":
        # Ray reads this switch when it is imported: a program that imported Ray before edgemoe.distributed has it
        # on, and Ray then swaps 127.0.0.1 for the machine's address and listens on every interface. Unless the
        # user asked for that (=1), the local instance stays on loopback whatever the import order.
        ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=int(object_store_bytes),
             _node_ip_address="127.0.0.1", resources={node_resource(n): 1.0 for n in node_names}, **common)
    gcs_host = ray.get_runtime_context().gcs_address.rpartition(":")[0]
    if not ray_constants.ENABLE_RAY_CLUSTER and gcs_host != "127.0.0.1":
        ray.shutdown()
        raise EdgeMoEError(f"the local Ray instance came up at {gcs_host}, not on loopback; stopped it")
    return {"started": True, "address": "local", "auth": os.environ.get("RAY_AUTH_MODE", "disabled"),
            "dashboard": False}


CONNECT_TIMEOUT_S = 10.0  # seconds to reach a Ray cluster's GCS port before giving up with one line


def _reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """`address` ("host:port", "ray://host:port" or "auto") if something accepts a TCP connection at its
    host:port within `timeout_s`, else EdgeMoEError saying so. "auto" is resolved the way Ray does
    (RAY_ADDRESS, then the latest local cluster) and returned resolved."""
    import socket

    target = address
    if address == "auto":  # Ray's lookup without importing Ray (token authentication is chosen before that)
        target = os.environ.get("RAY_ADDRESS") or _latest_local_cluster()
        if not target:
            raise EdgeMoEError("--ray-address auto: no running Ray cluster found (no RAY_ADDRESS, no "
                               "/tmp/ray/ray_current_cluster); give host:port")
    hostport = target.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise EdgeMoEError(f"--ray-address {address!r}: expected host:port (or ray://host:port, or auto)")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise EdgeMoEError(f"--ray-address {address}: nothing answers at {host}:{port} within {timeout_s:g} s ({why}); "
                           "check the address and that the Ray cluster runs (`ray status` there)") from None
    return target if address == "auto" else address


def _check_token(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """One GCS call before ray.init: a cluster that refuses this process's auth token is one clear line at once
    (ray.init itself retries for about 20 s and then says only "Failed to connect"). Other failures are left
    to ray.init. Ray Client addresses (ray://) are not GCS addresses: not checked here."""
    if address.startswith("ray://"):
        return
    ray = _ray()
    from ray._raylet import GcsClient

    try:
        GcsClient(address=address, cluster_id=None).internal_kv_get(b"edgemoe-auth-check", None, timeout=timeout_s)
    except ray.exceptions.AuthenticationError:
        if os.environ.get("RAY_AUTH_TOKEN"):
            source = "RAY_AUTH_TOKEN"
        elif os.environ.get("RAY_AUTH_TOKEN_PATH"):
            source = f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
        elif os.path.exists(os.path.expanduser("~/.ray/auth_token")):
            source = "~/.ray/auth_token"
        else:
            source = "none found"
        raise EdgeMoEError(f"--ray-address {address}: the Ray cluster refused this process's auth token (token from: "
                           f"{source}); give the head's token (its ~/.ray/auth_token) as RAY_AUTH_TOKEN, "
                           "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token") from None
    except Exception:  # noqa: BLE001 - anything else: ray.init reports it
        return


def _local_ip_towards(address: str) -> str | None:
    """This machine's IP on the route to `address`'s host (no packet is sent), or None for a loopback host."""
    import ipaddress
    import socket

    host = address.split("://", 1)[-1].rstrip("/").rpartition(":")[0].strip("[]")
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return None


def join_instructions(info: dict, namespace: str, node_names) -> list[str]:
    """What `serve` prints about Ray: the address, the deployment's namespace, how a machine joins."""
    ray = _ray()
    gcs = ray.get_runtime_context().gcs_address
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    lines = [f"ray: {'a private local instance' if info.get('started') else 'joined the cluster'} at {gcs} "
             f"({len(nodes)} node{'s' * (len(nodes) != 1)}, auth {info.get('auth', 'disabled')}); "
             f"this deployment's actors: namespace {namespace!r}, named edgemoe-<node>"]
    res = {n: node_resource(n) for n in node_names}
    if info.get("started"):
        lines.append("ray: the local instance listens on 127.0.0.1 only and takes no other machine; to serve from "
                     "several machines start Ray on each (`ray start --head --node-ip-address IP --resources "
                     f"'{{\"{next(iter(res.values()))}\": 1}}'` on the first) and pass --ray-address IP:6379 "
                     "(docs/distributed.md)")
    else:
        lines.append(f"ray: to add a machine: ray start --address {gcs} --node-ip-address <its IP> --resources "
                     "'{\"edgemoe_node_<name>\": 1}' with this cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token); "
                     f"servers: {', '.join(f'{n} -> {r}' for n, r in res.items())}")
    return lines


def _latest_local_cluster() -> str | None:
    """The address in /tmp/ray/ray_current_cluster (written by `ray start`), or None."""
    from edgemoe.io import read_text

    path = "/tmp/ray/ray_current_cluster"
    if not os.path.exists(path):
        return None
    text = read_text(path, "Ray cluster address file", "host:port", limit=4096).strip()
    return text.splitlines()[0].strip() if text else None


def check_resources(node_names) -> None:
    """EdgeMoEError unless some alive Ray node declares `edgemoe_node_<name>` for every server name: without
    it the server's actor would wait for a machine forever. Names the missing resources and what is declared."""
    declared: set[str] = set()
    for node in _ray().nodes():
        if node.get("Alive"):
            declared.update(k for k in node.get("Resources", {}) if k.startswith("edgemoe_node_"))
    missing = [node_resource(n) for n in node_names if node_resource(n) not in declared]
    if missing:
        raise EdgeMoEError(f"no Ray node declares the resource {', '.join(missing)} (declared: "
                           f"{', '.join(sorted(declared)) or 'none'}); start the machine that plays that server with "
                           f"`ray start --address ... --resources '{{\"{missing[0]}\": 1}}'`")


def ray_address_info() -> dict:
    """The running Ray instance's GCS address and this node's IP (what a machine needs to join it)."""
    ctx = _ray().get_runtime_context()
    return {"gcs_address": ctx.gcs_address, "node_ip": _ray().util.get_node_ip_address()}


def stop_ray() -> None:
    ray = _ray()
    if ray.is_initialized():
        ray.shutdown()


class RayTransport(Transport):
    """Calls other servers' actors by name; calls to this node run on a local thread."""

    def __init__(self, node: int, node_names, local: ServerCore, threads: int = 8, namespace: str = NAMESPACE):
        self.node, self.node_names, self.local, self.namespace = node, tuple(node_names), local, namespace
        self.pool = ThreadPoolExecutor(threads)
        self._handles: dict[int, object] = {}

    def handle(self, n: int):
        if n not in self._handles:
            self._handles[n] = _ray().get_actor(actor_name(self.node_names[n]), namespace=self.namespace)
        return self._handles[n]

    def submit(self, node: int, call: ExpertCall) -> Future:
        if node == self.node:
            return self.pool.submit(self.local.run_experts, call)
        try:
            return self.handle(node).run_experts.remote(call).future()
        except Exception as exc:  # noqa: BLE001 - no such actor (yet): a failed call
            f: Future = Future()
            f.set_exception(exc)
            return f


TRIM_S = 10.0  # seconds between a server's malloc_trim calls (ServerActor._trim_loop)
# What every server process is started with (unless the user's environment chose otherwise), see server_env:
SERVER_ENV = {
    "MALLOC_ARENA_MAX": "2",  # glibc heaps per process (its 128 threads would otherwise get up to 8 per core)
    "MKL_DISABLE_FAST_MM": "1",  # no per-thread MKL buffer pool (each of the 128 threads that runs a matmul keeps one)
}


def malloc_trim():
    """glibc's malloc_trim(0) as a function of no arguments, or None where the C library has none."""
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


def server_env() -> dict:
    """Environment variables of every server process (SERVER_ENV, each unless this process's environment sets
    it). A server actor runs its calls on up to 128 threads, and per-thread memory is what grows: glibc gives
    threads their own heaps (up to 8 per core), where what a thread frees stays for that heap's threads, and
    MKL keeps a buffer pool per thread that ran a matmul. Both grow as more of the threads get work, so the
    RSS creeps up for many minutes under steady load (docs/distributed.md, "Memory")."""
    return {k: os.environ.get(k, v) for k, v in SERVER_ENV.items()}


class ServerActor:
    """One edge server: its experts, and on a home node the backbone and the dispatch.

    Threaded (max_concurrency) so that expert calls from other homes are served while this home waits
    on its own users' calls."""

    def __init__(self, node: int, cfg: ServerConfig):
        import torch

        torch.set_num_threads(1)  # one core's worth per server: eight of them share this machine
        try:  # Ray starts workers at niceness 15: servers would then yield to every other process on the host
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except (OSError, AttributeError):  # not permitted: measured lateness will show it
            pass
        log_to_stderr()  # exclusions and readmissions of this home: one line each in the worker's log
        self.node = int(node)
        self._drop_rate, self._drop_rng = 0.0, np.random.default_rng(0)
        self._configure(cfg)
        self.batcher = None  # made by the first stream (HomeBatcher); it follows self.home across reconfigurations
        self._batcher_lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._probe_loop, daemon=True).start()
        threading.Thread(target=self._trim_loop, name="edgemoe-malloc-trim", daemon=True).start()

    def _configure(self, cfg: ServerConfig) -> None:
        ctx = cfg.ctx
        core = ServerCore(self.node, cfg.model_path, ctx, cfg.links(checkpoint_hidden_size(cfg.model_path)),
                          cfg.make_clock(), cfg.torch_dtype(), cfg.device)
        home = None
        if cfg.home_nodes()[self.node]:
            membership = Membership(ctx.num_nodes, Backoff(cfg.backoff_base_s, cfg.backoff_max_s), ctx.node_names,
                                    f"home {ctx.node_names[self.node]}")
            prev = getattr(self, "home", None)  # same model: keep the loaded backbone (the demo swaps methods)
            same = prev is not None and (prev.cfg.model_path, prev.cfg.dtype, prev.cfg.device) == (cfg.model_path, cfg.dtype,
                                                                                                    cfg.device)
            adapter = prev.adapter if same else None
            home = HomeEngine(cfg, self.node, RayTransport(self.node, ctx.node_names, core, namespace=cfg.namespace),
                              membership, adapter=adapter)
        self.cfg, self.core, self.home = cfg, core, home

    def configure(self, cfg: ServerConfig) -> int:
        """Load a new placement / policy (the demo swaps methods without restarting processes)."""
        self._configure(cfg)
        return cfg.version

    def retime(self, cfg: ServerConfig) -> int:
        """Take `cfg`'s clock (mode, dilation) and load setting without reloading anything; every emulated
        queue starts empty (free times on another clock scale mean nothing)."""
        self.cfg = cfg
        self.core.clock = cfg.make_clock()
        self.core.accelerator.reset()
        if self.home is not None:
            self.home.retime(cfg)
        return cfg.version

    def cpu(self) -> dict:
        """This process's id (the driver reads its CPU time from /proc) and the Ray node it runs on."""
        return {"node": self.node, "pid": os.getpid(), "ray_node": _ray().get_runtime_context().get_node_id()}

    def ping(self) -> dict:
        if self._drop_rate and self._drop_rng.random() < self._drop_rate:
            self._lose_message()
        return {"node": self.node, "version": self.cfg.version, "pid": os.getpid()}

    def run_experts(self, call: ExpertCall):
        if self._drop_rate and self._drop_rng.random() < self._drop_rate:
            self._lose_message()
        return self.core.run_experts(call)

    def set_faults(self, drop_rate: float = 0.0, seed: int = 0) -> None:
        """Fault injection (benchmarks): this node's link loses each incoming message (expert calls and probes)
        with probability drop_rate. A lost message gets no answer: the sender's timeout fires."""
        self._drop_rate, self._drop_rng = float(drop_rate), np.random.default_rng(seed)

    def _lose_message(self) -> None:
        time.sleep(2.0 * self.cfg.call_timeout_s + 2.0)  # longer than any sender waits (calls and probes)
        raise ConnectionError(f"message to {self.cfg.ctx.node_names[self.node]} lost (injected)")

    def generate(self, req: GenerateRequest) -> GenerateResult:
        if self.home is None:
            raise EdgeMoEError(f"server {self.cfg.ctx.node_names[self.node]} is no user's home (it has no backbone)")
        return self.home.generate(req)

    # ---- streams (continuous batching on this home: edgemoe.distributed.batching) --------------------
    def stream_start(self, req) -> int:
        """Queue a StreamRequest on this home's batching loop; returns this process's id."""
        if self.home is None:
            raise EdgeMoEError(f"server {self.cfg.ctx.node_names[self.node]} is no user's home (it has no backbone)")
        if self.batcher is None:
            from .batching import HomeBatcher

            with self._batcher_lock:
                if self.batcher is None:
                    self.batcher = HomeBatcher(lambda: self.home)
        self.batcher.start(req)
        return os.getpid()

    def stream_poll(self, request_id: str, have: int, timeout_s: float = 1.0, seen: tuple = (0, 0)) -> dict:
        """The stream's tokens after the first `have` (waiting up to timeout_s for one), plus, on each answer,
        this home's exclusions and readmissions that the caller has not seen (the ingress's metrics): seen is
        (pid, count), the events of process pid the caller has counted; "membership" is {"pid", "total",
        "events": [(kind, node)] after those}."""
        if self.batcher is None:
            raise EdgeMoEError(f"stream {request_id} is unknown here (this home restarted, or forgot it)")
        out = self.batcher.poll(request_id, int(have), min(float(timeout_s), 10.0))
        if self.home is not None:
            pid = os.getpid()
            events, total = self.home.membership.events_since(int(seen[1]) if int(seen[0]) == pid else 0)
            out["membership"] = {"pid": pid, "total": total, "events": [(kind, n) for _, kind, n in events]}
        return out

    def stream_cancel(self, request_id: str) -> dict | None:
        """Stop a stream at its next step; its counts so far (None: unknown here)."""
        return None if self.batcher is None else self.batcher.cancel(request_id)

    def memory(self) -> dict:
        out = self.core.memory()
        out["backbone_bytes"] = self.home.backbone_bytes if self.home else 0
        return out

    def health(self) -> dict:
        if self.home is None:
            return {}
        alive, version = self.home.membership.snapshot()
        return {"alive": alive.tolist(), "version": version, "events": list(self.home.membership.events),
                "started": self.home.requests.started, "in_flight": self.home.requests.in_flight,
                "served": self.home.requests.served,
                "streams": self.batcher.load() if self.batcher is not None else None}

    def _trim_loop(self) -> None:
        """Every TRIM_S seconds hand the C heap's free pages back to the OS (`malloc_trim`). The actor's threads
        allocate and free tensors and Ray buffers of every size; glibc keeps what they free in its arenas, so
        without this the process's RSS creeps up for many minutes under steady load while the bytes in use stay
        flat (docs/distributed.md, "Memory")."""
        trim = malloc_trim()
        while trim is not None and not self._stop.wait(TRIM_S):
            trim()

    def _probe_loop(self) -> None:
        """Probe excluded servers when due; a server that answers with a stale configuration (it restarted
        from its constructor's) is sent the current one before it is readmitted. Sleeps while nothing is
        excluded (an exclusion wakes it), so an idle server costs no CPU."""
        ray = _ray()
        while not self._stop.is_set():
            home = self.home
            if home is None:
                self._stop.wait(1.0)
                continue
            wait = home.membership.next_probe_in()
            home.membership.wakeup.wait(timeout=1.0 if wait is None else min(max(wait, 0.0), 1.0))
            home.membership.wakeup.clear()
            for n in home.membership.due():
                try:
                    handle = home.transport.handle(n)
                    info = ray.get(handle.ping.remote(), timeout=1.0)
                    if info["version"] != self.cfg.version:
                        ray.get(handle.configure.remote(self.cfg), timeout=120.0)
                    home.membership.readmit(n)
                except Exception:  # noqa: BLE001 - still down: back off further
                    home.membership.exclude(n)


@dataclass
class Deployment:
    """The actors of one cluster, by node index."""

    cfg: ServerConfig
    handles: list
    cfg_ref: object = None  # keeps the constructor's argument alive for restarts

    @classmethod
    def launch(cls, cfg: ServerConfig, max_concurrency: int = 128, ready_timeout_s: float = 300.0,
               namespace: str | None = None) -> Deployment:
        """One actor per node (node-pinned by custom resource), then wait until every one answers.

        namespace: the Ray namespace of this deployment's actors (default a fresh `edgemoe-<8 hex>`). A node
        whose resource no Ray node declares is an EdgeMoEError at once; servers that do not answer within
        `ready_timeout_s` (loading their experts) are one, naming them."""
        ray = _ray()
        cfg = replace(cfg, namespace=namespace or f"edgemoe-{uuid.uuid4().hex[:8]}")
        check_resources(cfg.ctx.node_names)
        remote_cls = ray.remote(ServerActor)
        # One pinned copy of the configuration: restarts rerun the constructor from it (Ray keeps the
        # arguments while this reference lives, see ray-project/ray#53727).
        cfg_ref = ray.put(cfg)
        handles = []
        for n, name in enumerate(cfg.ctx.node_names):
            handles.append(remote_cls.options(
                name=actor_name(name), namespace=cfg.namespace, num_cpus=0, resources={node_resource(name): NODE_SHARE},
                max_concurrency=max_concurrency, max_restarts=-1, max_task_retries=0, lifetime=None,
                runtime_env={"env_vars": server_env()},
            ).remote(n, cfg_ref))
        dep = cls(cfg, handles, cfg_ref)
        try:
            dep._get([h.ping.remote() for h in handles], ready_timeout_s, "start (load their experts)")
        except EdgeMoEError:
            dep.shutdown()
            raise
        return dep

    def _get(self, refs: list, timeout_s: float, what: str) -> list:
        """ray.get of one call per server (refs in node order), bounded: past `timeout_s` one EdgeMoEError
        naming the servers that did not answer; a server's own error is raised as it is."""
        ray = _ray()
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            done = set(ready)
            late = [self.node_names[i] for i, r in enumerate(refs) if r not in done]
            raise EdgeMoEError(f"servers {', '.join(late)} did not {what} within {timeout_s:g} s "
                               f"(Ray namespace {self.cfg.namespace}); see their logs under /tmp/ray/session_latest/logs")
        return ray.get(refs)

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(self.cfg.ctx.node_names)

    def configure(self, cfg: ServerConfig, timeout_s: float = 300.0) -> None:
        """Reconfigure every server (new placement or policy); bumps the version."""
        cfg = replace(cfg, version=self.cfg.version + 1, namespace=self.cfg.namespace)
        self._get([h.configure.remote(cfg) for h in self.handles], timeout_s, "take the new configuration")
        self.cfg = cfg

    def retime(self, clock: str | None = None, dilation: float | None = None, use_load: bool | None = None,
               timeout_s: float = 120.0) -> None:
        """Change the clock / dilation / load setting of every server without reloading weights (bumps the
        version, so a server that restarts is sent this configuration by the homes' probes)."""
        cfg = replace(self.cfg, version=self.cfg.version + 1, clock=self.cfg.clock if clock is None else clock,
                      dilation=self.cfg.dilation if dilation is None else float(dilation),
                      use_load=self.cfg.use_load if use_load is None else bool(use_load))
        self._get([h.retime.remote(cfg) for h in self.handles], timeout_s, "take the new clock")
        self.cfg = cfg

    def pids(self) -> list[int]:
        return [d["pid"] for d in self._get([h.cpu.remote() for h in self.handles], 60.0, "report their process")]

    def memory(self) -> list[dict]:
        return self._get([h.memory.remote() for h in self.handles], 60.0, "report their memory")

    def health(self, node: int) -> dict:
        ray = _ray()
        try:
            return ray.get(self.handles[node].health.remote(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            raise EdgeMoEError(f"server {self.node_names[node]} did not report its health within 30 s") from None

    def kill(self, node: int, restart: bool = True) -> None:
        """Kill server `node`'s process (a crash); Ray restarts it unless restart=False."""
        _ray().kill(self.handles[node], no_restart=not restart)

    def wait_alive(self, node: int, timeout_s: float = 120.0) -> bool:
        ray = _ray()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                ray.get(self.handles[node].ping.remote(), timeout=2.0)
                return True
            except Exception:  # noqa: BLE001 - restarting
                time.sleep(0.2)
        return False

    def shutdown(self) -> None:
        ray = _ray()
        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.handles = []


ANSWERS_KEPT = 1024  # answers a Client remembers for its duplicate check (the latest)
ERRORS_KEPT = 256  # failed requests' messages a Client remembers (the latest)


class Client:
    """Submits requests to users' homes. A home that fails is replaced by the nearest other home (by
    one-way latency) after a backoff; every request id is answered exactly once (a late duplicate among the
    latest ANSWERS_KEPT answers is counted and given the first answer; ids are unique per client, so an
    older one cannot come back)."""

    def __init__(self, deployment: Deployment, request_timeout_s: float = 120.0, max_attempts: int = 4,
                 backoff: Backoff | None = None, home_backoff: Backoff | None = None, probe: bool = True):
        """backoff: the wait before each retry of a request; home_backoff: the probe schedule of an excluded
        home (default the deployment's server backoff); probe=False: no background prober (`probe_homes`
        readmits on demand)."""
        self.dep = deployment
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.backoff = backoff or Backoff(0.2, 2.0)
        cfg = deployment.cfg
        # The ingress's own view of the homes: a home that failed a request is skipped until a probe readmits it.
        self.homes = Membership(cfg.ctx.num_nodes, home_backoff or Backoff(cfg.backoff_base_s, cfg.backoff_max_s),
                                cfg.ctx.node_names, "ingress")
        self._prober: threading.Thread | None = None
        self._probe = probe
        self._closed = threading.Event()
        # Ids unique per client and run: a home answers a seen id from its cache of finished requests, so a
        # second client (or a second load run) on the same deployment must never reuse "req-0".
        self.run_id = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # The latest ANSWERS_KEPT answers by id: an id answered again within them is a duplicate (counted, and
        # the first answer returned); older ones are forgotten, so a long-running client stays bounded.
        self.answers: OrderedDict[str, GenerateResult] = OrderedDict()
        self.duplicates = 0
        self.failovers = 0
        self.errors: deque[str] = deque(maxlen=ERRORS_KEPT)  # the latest failed requests' messages

    @property
    def clock(self):
        """The deployment's clock (it follows `Deployment.retime`)."""
        return self.dep.cfg.make_clock()

    def next_id(self) -> str:
        return f"req-{self.run_id}-{next(self._ids)}"

    def homes_for(self, user: int) -> list[int]:
        """The user's home first, then the other home nodes by one-way latency from it; homes this client
        excluded go last (tried only when no other home is left)."""
        ctx = self.dep.cfg.ctx
        home = int(ctx.user_home[user])
        others = [int(n) for n in np.flatnonzero(self.dep.cfg.home_nodes()) if n != home]
        order = [home, *sorted(others, key=lambda n: ctx.lat_s[home, n])]
        alive, _ = self.homes.snapshot()
        return [n for n in order if alive[n]] + [n for n in order if not alive[n]]

    def generate(self, user: int, prompt, gen_tokens: int, request_id: str | None = None,
                 submit_s: float | None = None, allow_degraded: bool = False) -> GenerateResult:
        """Run one request; submit_s: its nominal arrival (default: now on the deployment's clock; the
        virtual clock needs it). Retries keep the id and the arrival, so failover time counts in TTFT.
        allow_degraded: with the exact policy, accept slots a failure drops (else dispatch.Degraded, a 503)."""
        ray = _ray()
        rid = request_id or self.next_id()
        submit = self.clock.now() if submit_s is None else float(submit_s)
        homes = self.homes_for(user)
        names = self.dep.cfg.ctx.node_names
        last: Exception | None = None
        for attempt in range(self.max_attempts):
            home = homes[min(attempt, len(homes) - 1)]
            if attempt:
                log.warning("ingress: request %s of user %s fails over to home %s (attempt %d)", rid,
                            self.dep.cfg.ctx.user_names[user], names[home], attempt + 1)
                time.sleep(self.backoff.delay_s(attempt))
            req = GenerateRequest(rid, int(user), np.asarray(prompt, np.int64), int(gen_tokens), attempt, submit,
                                  bool(allow_degraded))
            try:
                result = ray.get(self.dep.handles[home].generate.remote(req), timeout=self.request_timeout_s)
            except EdgeMoEError:
                raise
            except Exception as exc:  # noqa: BLE001 - the home died or timed out: fail over
                last = exc
                self._exclude_home(home, exc)
                with self._lock:
                    self.failovers += 1
                continue
            return self._record(result)
        with self._lock:
            self.errors.append(f"{rid}: {type(last).__name__}: {last}")
        raise EdgeMoEError(f"request {rid} failed on {self.max_attempts} attempts: {_first_line(last)}")

    def _exclude_home(self, home: int, exc: Exception) -> None:
        self.homes.exclude(home, why=f"a request failed there: {type(exc).__name__}")
        if self._probe and self._prober is None:
            with self._lock:
                if self._prober is None:
                    self._prober = threading.Thread(target=self._probe_loop, name="edgemoe-ingress-probe", daemon=True)
                    self._prober.start()

    def probe_homes(self, force: bool = False, timeout_s: float = 2.0) -> list[int]:
        """Ping the excluded homes whose probe is due (all of them with force) and readmit those that answer
        with the deployment's configuration (a restarted home is sent it first). Returns the readmitted."""
        ray = _ray()
        back = []
        for n in self.homes.due(float("inf") if force else None):
            try:
                info = ray.get(self.dep.handles[n].ping.remote(), timeout=timeout_s)
                if info["version"] != self.dep.cfg.version:
                    ray.get(self.dep.handles[n].configure.remote(self.dep.cfg), timeout=120.0)
            except Exception:  # noqa: BLE001 - still down: back off further
                self.homes.exclude(n)
                continue
            self.homes.readmit(n)
            back.append(n)
        return back

    def _probe_loop(self) -> None:
        """Probe excluded homes when due; sleeps while none is excluded."""
        while not self._closed.is_set():
            wait = self.homes.next_probe_in()
            self.homes.wakeup.wait(timeout=1.0 if wait is None else min(max(wait, 0.0), 1.0))
            self.homes.wakeup.clear()
            if not self._closed.is_set():
                self.probe_homes()

    def close(self) -> None:
        """Stop the background prober."""
        self._closed.set()
        self.homes.wakeup.set()

    def _record(self, result: GenerateResult) -> GenerateResult:
        with self._lock:
            if result.request_id in self.answers:
                self.duplicates += 1
                return self.answers[result.request_id]
            self.answers[result.request_id] = result
            while len(self.answers) > ANSWERS_KEPT:
                self.answers.popitem(last=False)
        return result


def _first_line(exc: BaseException | None) -> str:
    """An exception's own message, first line (Ray's errors carry whole remote tracebacks)."""
    if exc is None:
        return "no attempt made"
    text = str(getattr(exc, "cause", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


@dataclass(frozen=True)
class LoadRecord:
    """One finished request of a load run; times in nominal seconds from the run's start (links.Clock)."""

    user: int
    submitted_s: float
    finished_s: float
    result: GenerateResult


def closed_loop(client: Client, users, prompts, gen_tokens: int, duration_s: float, think_s: float = 0.0,
                max_requests_per_user: int | None = None) -> tuple[list[LoadRecord], float, list[str]]:
    """Each user keeps one request in flight until `duration_s` (nominal seconds) has passed (a request started
    before the end runs to completion). prompts: list of token-id arrays, used round-robin per user.
    Returns (records, makespan in nominal seconds, errors). Real clock only."""
    if client.clock.virtual:
        raise EdgeMoEError("closed_loop runs on the real clock; drive a virtual-clock deployment request by request")
    records: list[LoadRecord] = []
    errors: list[str] = []
    lock = threading.Lock()
    clock = client.clock
    t0 = clock.now()

    def user_loop(u: int, k: int) -> None:
        i = 0
        while clock.now() - t0 < duration_s and (max_requests_per_user is None or i < max_requests_per_user):
            prompt = prompts[(k + i) % len(prompts)]
            start = clock.now()
            try:
                res = client.generate(u, prompt, gen_tokens, submit_s=start)
            except Exception as exc:  # noqa: BLE001 - reported, the loop goes on
                with lock:
                    errors.append(f"user {u}: {exc}")
                continue
            finally:
                i += 1
            with lock:
                records.append(LoadRecord(u, start - t0, clock.now() - t0, res))
            if think_s:
                time.sleep(think_s * clock.dilation)

    threads = [threading.Thread(target=user_loop, args=(int(u), k)) for k, u in enumerate(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, clock.now() - t0, errors
