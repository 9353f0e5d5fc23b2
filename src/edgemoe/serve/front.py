"""The HTTP front in a process of its own: uvicorn and the API (edgemoe.serve.api) in one process, the engine in
another, one pipe between them.

Why: in one process the engine thread and the event loop share one GIL. Each token makes the loop thread wake,
frame an SSE chunk and write a socket, and every one of those steps takes the GIL back from the engine in
the middle of its step; on a busy host the thread holding it may also wait for a core. In two processes the
engine's only per-token work for HTTP is one JSON line written to a pipe; parsing, validation, tokenising,
SSE framing and the sockets run in the front's process, beside it.

    engine process (EngineHost)                    front process (front_main)
      Engine.submit(req, sink) <- {"op": "submit"}   <- RemoteEngine.submit_async <- POST /v1/completions
      sink(event) ---------------> {"k": "d"|"f"|"x"} -> the request's asyncio queue (read in the event loop)
      cancel, state, metrics   <-> their replies         /health, /metrics, a client that went away

Messages are JSON objects, one per line, over a Unix socket pair (no pickles; the front reads it as an asyncio
protocol: one read per wake-up however many lines it brings). The front holds its own tokenizer (loaded from
the model spec) for prompts, chat templates and logprob token texts; the engine sends text pieces and token
ids exactly as it hands them to an in-process sink. Metrics: the front counts HTTP requests and 429s in its
own registry, and `/metrics` appends the engine's families, fetched over the pipe at each scrape.

    svc = make_service(DeploymentSpec())
    with FrontProcess.of(svc) as front:            # 127.0.0.1, a free port
        print(front.url)
    svc.close()
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict
from types import SimpleNamespace

from edgemoe.distributed.sampling import SamplingParams
from edgemoe.errors import EdgeMoEError

from .engine import Busy, Closed, Delta, Failed, Finished, GenerationRequest, TokenInfo


# ---- the wire ------------------------------------------------------------------------------------------------
def request_to_wire(req: GenerationRequest) -> dict:
    return asdict(req)


def request_from_wire(d: dict) -> GenerationRequest:
    d = dict(d)
    d["sampling"] = SamplingParams(**d["sampling"])
    d["prompt_ids"], d["stop"] = tuple(d["prompt_ids"]), tuple(d["stop"])
    if d.get("budget_mix") is not None:
        d["budget_mix"] = tuple(d["budget_mix"])
    return GenerationRequest(**d)


def event_to_wire(sid: int, ev, generated: list[int]) -> dict:
    """One engine event of stream `sid`; generated: the sequence's token ids (sent with Finished: the usage)."""
    if isinstance(ev, Delta):
        return {"k": "d", "i": sid, "t": ev.text, "tok": [[t.token, t.logprob, t.top] for t in ev.tokens]}
    if isinstance(ev, Finished):
        return {"k": "f", "i": sid, "r": ev.reason, "s": ev.stats, "g": generated}
    return {"k": "x", "i": sid, "st": ev.status, "m": ev.message}


def event_from_wire(m: dict):
    if m["k"] == "d":
        return Delta(m["t"], [TokenInfo(t, lp, [tuple(p) for p in top]) for t, lp, top in m["tok"]])
    if m["k"] == "f":
        return Finished(m["r"], m["s"])
    return Failed(m["st"], m["m"])


def _encode(obj) -> bytes:
    """One message: a JSON line (json.dumps escapes newlines inside strings)."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _lines(buf: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines of buf + data, and the incomplete rest."""
    *lines, rest = (buf + data).split(b"\n")
    return lines, rest


# ---- the engine process's side -------------------------------------------------------------------------------
class EngineHost:
    """Serves one front's connection from a thread of the engine process: submits its requests to `engine`
    and sends each request's events back from the engine thread (the sink)."""

    def __init__(self, engine, sock: socket.socket):
        self.engine, self.sock = engine, sock
        self._lock = threading.Lock()  # the engine thread (events) and this thread (replies) both send
        # held across a submit and the recording of its Sequence, so that a sink ending the stream finds it
        # recorded (the engine emits events outside its own lock: no lock-order cycle)
        self._recording = threading.Lock()
        self._seqs: dict[int, object] = {}  # stream id -> the engine's Sequence
        self._thread = threading.Thread(target=self._serve, name="edgemoe-front-host", daemon=True)

    def start(self) -> EngineHost:
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _send(self, obj) -> None:
        data = _encode(obj)
        with self._lock:
            self.sock.sendall(data)

    def _sink(self, sid: int):
        def sink(ev):  # engine thread; an exception (front gone) cancels the sequence (Sequence.emit)
            generated: list[int] = []
            if not isinstance(ev, Delta):
                with self._recording:  # waits until _handle has recorded the sequence its submit returned
                    seq = self._seqs.pop(sid, None)
                generated = list(seq.generated) if seq is not None else []
            self._send(event_to_wire(sid, ev, generated))

        return sink

    def _serve(self) -> None:
        buf = b""
        try:
            while data := self.sock.recv(1 << 16):
                lines, buf = _lines(buf, data)
                for line in lines:
                    self._handle(json.loads(line))
        except OSError:
            pass
        for seq in list(self._seqs.values()):  # the front is gone: nobody reads these streams
            seq.cancelled = True
        self._seqs.clear()

    def _handle(self, msg: dict) -> None:
        op, cid = msg["op"], msg.get("id")
        if op == "submit":
            with self._recording:
                try:
                    req = request_from_wire(msg["req"])
                    seq = self.engine.submit(req, self._sink(cid))
                except Busy as exc:
                    return self._send({"op": "refused", "id": cid, "status": 429, "message": str(exc),
                                       "retry_after": exc.retry_after_s})
                except Closed as exc:
                    return self._send({"op": "refused", "id": cid, "status": 503, "message": str(exc)})
                except EdgeMoEError as exc:
                    return self._send({"op": "refused", "id": cid, "status": 400, "message": str(exc)})
                self._seqs[cid] = seq  # its sink forgets it at its end
            self._send({"op": "submitted", "id": cid})
        elif op == "cancel":
            seq = self._seqs.get(cid)
            if seq is not None:
                seq.cancelled = True
        elif op == "state":
            e = self.engine
            self._send({"op": "state", "id": cid, "failure": e.failure, "alive": e.alive, "load": e.load()})
        elif op == "metrics":
            tele = self.engine.telemetry
            text = tele.render_engine().decode() if tele is not None else ""
            self._send({"op": "metrics", "id": cid, "text": text})


def engine_info(engine) -> dict:
    """What the front needs to know of the deployment (JSON): its context's names and sizes."""
    ctx = engine.ctx
    return {"ctx": {"num_users": ctx.num_users, "user_names": list(ctx.user_names), "cluster_name": ctx.cluster_name,
                    "placement_method": ctx.placement_method, "mode": ctx.mode, "node_names": list(ctx.node_names)},
            "dep": {"context_length": engine.dep.context_length, "vocab_size": engine.dep.vocab_size},
            "policy_name": engine.policy_name, "failure": engine.failure, "alive": engine.alive}


# ---- the front process's side --------------------------------------------------------------------------------
class RemoteSequence:
    """The app's handle of a request that runs in the engine process (the fields api.py reads)."""

    def __init__(self, remote: RemoteEngine, sid: int, req: GenerationRequest, sink):
        self.remote, self.sid, self.req, self.sink = remote, sid, req, sink
        self.generated: list[int] = []
        self.done = False
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        if value and not self._cancelled and not self.done:
            self.remote.send({"op": "cancel", "id": self.sid})
        self._cancelled = self._cancelled or bool(value)


class RemoteEngine:
    """The engine as create_app sees it, in the front process: requests and events over `sock`, read by the
    event loop itself (an asyncio protocol), so an event reaches its request's queue without a thread hop."""

    remote = True

    def __init__(self, sock: socket.socket, info: dict, tokenizer, telemetry):
        self.sock = sock
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._gone = False
        self.ctx = SimpleNamespace(**info["ctx"])
        self.dep = SimpleNamespace(**info["dep"])
        self.policy_name = info["policy_name"]
        self.failure: str | None = info["failure"]
        self.alive: bool = info["alive"]
        self.tokenizer = tokenizer
        self.telemetry = telemetry
        self._load = {"running": 0, "queued": 0}
        self._ids = itertools.count()
        self._run_id = secrets.token_hex(4)
        self._streams: dict[int, RemoteSequence] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_lost = lambda: None  # called once when the engine process is gone (front_main stops the server)

    async def attach(self) -> None:
        """Start reading the engine's messages in the running event loop."""
        self._loop = asyncio.get_running_loop()
        await self._loop.connect_accepted_socket(lambda: _EngineLink(self), self.sock)

    def new_request_id(self, prefix: str = "cmpl") -> str:
        return f"{prefix}-{self._run_id}{next(self._ids):06d}"

    def load(self) -> dict:
        return dict(self._load)

    def send(self, obj) -> None:
        if self.transport is None or self.transport.is_closing():
            self._lost()
        else:
            self.transport.write(_encode(obj))

    async def _call(self, msg: dict) -> dict:
        fut = self._loop.create_future()
        self._calls[msg["id"]] = fut
        self.send(msg)
        return await fut

    async def submit_async(self, req: GenerationRequest, sink) -> RemoteSequence:
        """Queue `req` in the engine process; events go to sink(event) in the event loop. Raises Busy, Closed or
        EdgeMoEError as Engine.submit does."""
        if self.failure or not self.alive:
            raise Closed(self.failure or "the engine is not running")
        sid = next(self._ids)
        seq = RemoteSequence(self, sid, req, sink)
        self._streams[sid] = seq  # before the request leaves: its first events may come before the reply
        reply = await self._call({"op": "submit", "id": sid, "req": request_to_wire(req)})
        if reply["op"] == "submitted":
            return seq
        self._streams.pop(sid, None)
        status, message = reply["status"], reply["message"]
        if status == 429:
            raise Busy(message, int(reply["retry_after"]))
        if status == 503:
            self.failure = self.failure or message
            raise Closed(message)
        raise EdgeMoEError(message)

    async def refresh(self) -> None:
        """Fetch the engine's failure, liveness and load (for /health)."""
        if not self.alive:
            return
        reply = await self._call({"op": "state", "id": next(self._ids)})
        if reply["op"] == "state":
            self.failure, self.alive, self._load = reply["failure"], reply["alive"], reply["load"]

    async def metrics_text(self) -> bytes:
        """The engine's metric families (Prometheus text), empty once the engine process is gone."""
        if not self.alive:
            return b""
        reply = await self._call({"op": "metrics", "id": next(self._ids)})
        return reply.get("text", "").encode()

    def received(self, data: bytes) -> None:
        lines, self._buf = _lines(self._buf, data)
        for line in lines:
            self._dispatch(json.loads(line))

    def _dispatch(self, m: dict) -> None:
        kind = m.get("k")
        if kind is None:  # a reply to a call
            fut = self._calls.pop(m["id"], None)
            if fut is not None and not fut.done():
                fut.set_result(m)
            return
        seq = self._streams.get(m["i"])
        if seq is None:
            return
        if kind != "d":
            self._streams.pop(m["i"], None)
            seq.done = True
            seq.generated = m.get("g", [])
        seq.sink(event_from_wire(m))

    def _lost(self) -> None:
        if self._gone:
            return
        self._gone = True
        self.failure = self.failure or "the engine process is gone"
        self.alive = False
        for seq in list(self._streams.values()):
            seq.done = True
            seq.sink(Failed(503, self.failure))
        self._streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_result({"op": "refused", "status": 503, "message": self.failure})
        self._calls.clear()
        self.on_lost()


class _EngineLink(asyncio.Protocol):
    """The front's end of the socket pair: lines to RemoteEngine.received."""

    def __init__(self, remote: RemoteEngine):
        self.remote = remote

    def connection_made(self, transport) -> None:
        self.remote.transport = transport

    def data_received(self, data: bytes) -> None:
        self.remote.received(data)

    def connection_lost(self, exc) -> None:
        self.remote._lost()


def front_main(conn, status, settings: dict) -> None:
    """The front process: load the tokenizer, build the app over a RemoteEngine, bind, report the port on
    `status` (or the error), serve until SIGTERM/SIGINT or until the engine process goes away."""
    try:
        import uvicorn

        from edgemoe.models import load_tokenizer

        from .api import Limits, create_app
        from .telemetry import HttpTelemetry

        tokenizer = load_tokenizer(settings["model"])
        remote = RemoteEngine(socket.socket(fileno=os.dup(conn.fileno())), settings["info"], tokenizer, HttpTelemetry())
        conn.close()
        from edgemoe.eval.dial import QualityDial

        dial = None if settings.get("dial") is None else QualityDial.from_dict(settings["dial"])
        app = create_app(remote, settings["model_name"], api_key=settings["api_key"], limits=Limits(**settings["limits"]),
                         default_user=settings["default_user"], dial=dial)
        host = settings["host"]
        # proto IPPROTO_TCP, as asyncio's own listeners have: asyncio sets TCP_NODELAY only on connections of
        # such sockets, and without it a keep-alive connection's small writes wait out the peer's delayed ACK
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, settings["port"]))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        status.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def main() -> None:
        await remote.attach()
        remote.on_lost = lambda: setattr(server, "should_exit", True)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        status.send({"port": sock.getsockname()[1]} if server.started else {"error": "the HTTP server did not start"})
        await serving

    asyncio.run(main())


class FrontProcess:
    """The HTTP front of an engine of this process, served by a spawned process (front_main) on host:port
    (0: a free port). start() returns once it listens; stop() ends it (SIGTERM: uvicorn's graceful stop)."""

    def __init__(self, engine, model: str, model_name: str, api_key: str | None = None, limits=None,
                 default_user: int = 0, host: str = "127.0.0.1", port: int = 0, dial=None):
        from .api import Limits

        self.engine = engine
        self.host, self.port = host, port
        self.settings = {"model": model, "model_name": model_name, "api_key": api_key,
                         "limits": asdict(limits or Limits()), "default_user": default_user, "host": host, "port": port,
                         "dial": None if dial is None else dial.to_dict()}
        self.proc = None
        self.host_thread: EngineHost | None = None

    @classmethod
    def of(cls, svc, host: str = "127.0.0.1", port: int = 0) -> FrontProcess:
        """The front of a Service (edgemoe.serve.service.make_service), with its API key, limits and user."""
        return cls(svc.engine, svc.deployment.spec.model, svc.model_name, svc.api_key, svc.limits, svc.default_user,
                   host, port, svc.dial)

    def start(self, timeout_s: float = 120.0) -> FrontProcess:
        mp = multiprocessing.get_context("spawn")
        mine, theirs = mp.Pipe()
        status_in, status_out = mp.Pipe(duplex=False)
        settings = dict(self.settings, info=engine_info(self.engine))
        self.proc = mp.Process(target=front_main, args=(theirs, status_out, settings), name="edgemoe-front", daemon=True)
        self.proc.start()
        theirs.close()
        status_out.close()
        self.sock = socket.socket(fileno=os.dup(mine.fileno()))
        mine.close()
        self.host_thread = EngineHost(self.engine, self.sock).start()
        end = time.monotonic() + timeout_s
        while not status_in.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() > end:
                self.stop()
                raise EdgeMoEError(f"the HTTP front did not start on {self.host}:{self.port}")
        msg = status_in.recv()
        if "error" in msg:
            self.stop()
            raise EdgeMoEError(f"the HTTP front could not serve on {self.host}:{self.port}: {msg['error']}")
        self.port = msg["port"]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def cpu_s(self) -> float:
        """CPU seconds the front process has used (Linux: /proc; 0.0 elsewhere or once it has ended)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, AttributeError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def wait(self) -> None:
        """Until the front process ends (Ctrl-C reaches it too: uvicorn stops gracefully)."""
        self.proc.join()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout_s)
        if self.host_thread is not None:
            self.host_thread.join(timeout_s)  # the front's end of the pipe closed with it: the host's recv ended
            self.sock.close()
            self.host_thread = None

    def __enter__(self) -> FrontProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
