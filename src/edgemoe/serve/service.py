"""One in-process service: deployment + engine + HTTP app. `edgemoe serve` and the serving benchmark run the app
in a front process of its own (edgemoe.serve.front.FrontProcess.of(svc)); ServerThread runs it in a thread of
this process (the tests, and the Ray backend's ingress).

    svc = make_service(DeploymentSpec(policy="ordermoe"))
    with ServerThread(svc.app) as server:          # 127.0.0.1, a free port
        print(server.url)                          # http://127.0.0.1:<port>
    svc.close()
"""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass

from edgemoe.errors import EdgeMoEError

try:
    from .api import Limits, create_app
except ImportError as exc:  # the optional extra
    raise EdgeMoEError(f"the HTTP service needs the serve extra ({exc.name} is missing): pip install -e '.[serve]'") from exc
from .dial import identity
from .engine import Engine
from .setup import Deployment, DeploymentSpec, load_deployment
from .telemetry import Telemetry


@dataclass
class Service:
    deployment: Deployment
    engine: Engine
    app: object  # FastAPI (the in-thread front: ServerThread(app))
    model_name: str
    api_key: str | None = None
    limits: Limits = Limits()
    default_user: int = 0
    dial: object = None  # edgemoe.eval.dial.QualityDial: maps a request's max_ppl_increase (None: no dial)

    def close(self) -> None:
        self.engine.close()


def make_service(spec: DeploymentSpec, api_key: str | None = None, limits: Limits | None = None, max_running: int = 16,
                 max_queue: int = 64, user: str | int | None = None, model_name: str | None = None,
                 deployment: Deployment | None = None, log_routing: str | None = None, log=lambda _m: None,
                 dial: str | None = None) -> Service:
    """Load `spec` (or reuse `deployment`), start its engine, build the app. user: the default user (name or
    index; default the cluster's first); log_routing: a trace file the served routing is appended to; dial: a
    dial file (`edgemoe dial`) calibrated on this deployment, which maps requests' `max_ppl_increase`."""
    dep = deployment or load_deployment(spec, log)
    quality_dial = None if dial is None else deployment_dial(dial, identity(dep))
    ctx = dep.ctx
    default_user = default_user_index(ctx, user)
    tele = Telemetry(ctx.node_names, policies=tuple(sorted({"exact", dep.spec.policy})))
    engine = Engine(dep, max_running=max_running, max_queue=max_queue, telemetry=tele, log_routing=log_routing)
    name = model_name or dep.spec.model
    app = create_app(engine, name, api_key=api_key, limits=limits or Limits(), default_user=default_user,
                     dial=quality_dial)
    return Service(dep, engine, app, name, api_key, limits or Limits(), default_user, quality_dial)


def deployment_dial(path: str, want: dict):
    """The QualityDial of the dial file `path`, checked to be calibrated on the deployment whose identity is
    `want` (edgemoe.serve.dial: `identity` in-process, `ray_identity` on Ray)."""
    from edgemoe.eval.dial import load_dial

    from .dial import check_identity

    quality_dial, found = load_dial(path)
    check_identity(found, want, path)
    return quality_dial


def default_user_index(ctx, user: str | int | None) -> int:
    """--user (a name or an index; None: the cluster's first user) as an index into ctx.user_names."""
    if user is None:
        return 0
    if isinstance(user, int) or str(user).isdigit():
        if not 0 <= int(user) < ctx.num_users:
            raise EdgeMoEError(f"--user {user}: expected an index in [0, {ctx.num_users}) or a user name")
        return int(user)
    if user not in ctx.user_names:
        raise EdgeMoEError(f"--user {user!r} is not a user of cluster {ctx.cluster_name!r}; "
                           f"expected one of {', '.join(ctx.user_names)}")
    return ctx.user_names.index(user)


def check_bind(host: str, api_key: str | None) -> None:
    """Any address other than loopback needs an API key (issue 20, section 6)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not api_key:
        raise EdgeMoEError(f"--host {host}: binding a non-loopback address needs an API key "
                           "(--api-key or EDGEMOE_API_KEY)")


class ServerThread:
    """uvicorn serving `app` on host:port from a background thread; port 0 takes a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # not the main thread: no signal handlers
        self.thread = threading.Thread(target=self.server.run, name="edgemoe-http", daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        import time

        self.thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise EdgeMoEError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
