"""A measured load run on a deployment, valid or marked invalid: CPU utilisation beside every result, a
warm-up per configuration, time dilation chosen from a short calibration, and the simulator's replay of the
very requests that ran beside the measurement.

    from edgemoe.distributed.loadrun import measure_load
    out = measure_load(dep, users=[0, 1, 2], prompts=prompts, gen_tokens=16, requests_per_user=4, dilation="auto")

Why dilation: on one small machine every server is a process sharing a few cores. The emulated cluster's
delays (links, queues, accelerators) are deadlines on the clock (links.py); the host's own work (the dense
backbone on CPU, Ray calls, Python) only has to finish before those deadlines. When it does not, the pass
ends late and the measurement is the host's, not the cluster's. With dilation k every emulated delay lasts
k times longer in wall time and every measured time is divided by k, so the host has k times more time per
nominal second. `auto` picks k so that the CPU the run needs fits in about half of the cores that other
processes leave free (k >= margin x CPU seconds per token x users / (simulated seconds per token x free cores))
and so that a pass's own host work, which runs between its layers, is a small share of its latency
(k >= CPU seconds per token / (3% x simulated seconds per token)); `choose_dilation`. The 3% is an estimate's
target, not the lateness measured: a pass's attention and router run inside its dense work's nominal time, so
the measured lateness stays far below it (0.1-0.3% in docs/distributed.md, "The demo on Ray").
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from edgemoe.errors import EdgeMoEError

# A run is invalid when the host could not keep the deadlines: its layers started (and passes ended) later than
# their deadlines by more than this share of the latency in all. Host CPU above MAX_HOST_UTIL is warned about.
MAX_LATE_SHARE = 0.03
MAX_HOST_UTIL = 0.95
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _host_jiffies() -> tuple[float, float]:
    """(busy, total) CPU jiffies of the whole machine since boot (/proc/stat)."""
    try:
        vals = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return float("nan"), float("nan")
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (float(fields[11]) + float(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def ray_pids(dep) -> list[int]:
    """The deployment's actor processes, the driver, and this Ray session's own daemons (raylet, GCS...)."""
    pids = set(dep.pids()) | {os.getpid()}
    try:
        import ray

        session = Path(ray._private.worker.global_worker.node.get_session_dir_path()).name
    except Exception:  # noqa: BLE001 - private API moved: actors and driver only
        session = None
    if session:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if session in (d / "cmdline").read_bytes().decode(errors="replace"):
                        pids.add(int(d.name))
                except OSError:
                    continue
    return sorted(pids)


def ray_cpu_s(dep) -> float:
    """CPU seconds the deployment's Ray processes (its actors and this session's daemons, the driver not
    included) have used since they started: what the driver's own CPU time leaves out. Processes that have
    already exited are not counted, so call it before the deployment shuts down."""
    return float(sum(_proc_cpu_s(p) for p in ray_pids(dep) if p != os.getpid()))


class CpuMeter:
    """Host and Ray CPU use over an interval (Linux /proc): cores busy, and its share of the machine."""

    def __init__(self, pids):
        self.pids = list(pids)
        self.cores = os.cpu_count() or 1

    def __enter__(self) -> CpuMeter:
        self._t = time.monotonic()
        self._host = _host_jiffies()
        self._proc = sum(_proc_cpu_s(p) for p in self.pids)
        self._load = os.getloadavg()[0]
        self.result: dict = {}
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.monotonic() - self._t, 1e-9)
        busy, total = _host_jiffies()
        ours = sum(_proc_cpu_s(p) for p in self.pids) - self._proc
        host_util = (busy - self._host[0]) / max(total - self._host[1], 1e-9)
        self.result = {"wall_s": wall, "cores": self.cores, "host_util": float(host_util),
                       "host_cores_busy": float(host_util * self.cores), "ray_cores_busy": float(ours / wall),
                       "ray_cpu_s": float(ours), "other_cores_busy": float(max(host_util * self.cores - ours / wall, 0.0)),
                       "load_avg_1min_before": self._load, "load_avg_1min_after": os.getloadavg()[0]}


def warm_up(client, dep, prompts, gen_tokens: int) -> None:
    """One request on every home (not measured): the first pass after a (re)configuration pays for lazy
    initialisation (policy tables, torch's first calls) that no later pass pays."""
    ctx = dep.cfg.ctx
    seen = set()
    for u in range(ctx.num_users):
        home = int(ctx.user_home[u])
        if home not in seen:
            seen.add(home)
            client.generate(u, prompts[0], min(gen_tokens, 2))


def choose_dilation(cpu_s_per_token: float, users: int, sim_latency_s: float, free_cores: float,
                    margin: float = 2.0, late_target: float = 0.03, max_k: float = 20000.0) -> float:
    """The larger of two k (rounded up, at least 1):
    - throughput: the run needs about 1/margin of the free cores (users tokens in flight, each taking
      sim_latency_s x k of wall time and cpu_s_per_token of CPU);
    - critical path: a pass's own host work (the dense part and the dispatch run between its layers, at most
      cpu_s_per_token) delays it by about cpu / k nominal seconds, which must stay under late_target of its
      simulated latency."""
    if not (sim_latency_s > 0 and cpu_s_per_token >= 0):
        return 1.0
    throughput = margin * cpu_s_per_token * users / (sim_latency_s * max(free_cores, 0.25))
    critical = cpu_s_per_token / (late_target * sim_latency_s)
    return float(min(max(1.0, math.ceil(max(throughput, critical))), max_k))


def calibrate(dep, client, users, prompts, gen_tokens: int, max_users: int = 4) -> dict:
    """CPU seconds per generated token on this host, from one request for each of up to `max_users` users
    (undilated), and the cores other processes left free meanwhile. Measured once, reused for every method."""
    from .serve import closed_loop

    pids = ray_pids(dep)
    dep.retime(dilation=1.0)
    with CpuMeter(pids) as meter:
        records, _, errors = closed_loop(client, list(users)[:max_users], prompts, gen_tokens, duration_s=1e9,
                                         max_requests_per_user=1)
    if errors:
        raise EdgeMoEError(f"calibration requests failed: {errors[:3]}")
    tokens = sum(len(r.result.tokens) for r in records)
    return {"cpu_s_per_token": meter.result["ray_cpu_s"] / max(tokens, 1), "tokens": tokens,
            "free_cores": meter.result["cores"] - meter.result["other_cores_busy"], "cpu": meter.result}


def measure_load(dep, users, prompts, gen_tokens: int, requests_per_user: int | None = None, duration_s: float = 1e9,
                 dilation: float | str = 1.0, sim_latency_s: float | None = None, warm: bool = True,
                 wire_bytes: int | None = None, client=None, calibration: dict | None = None, margin: float = 2.0) -> dict:
    """A closed-loop run (each user keeps one request in flight; `requests_per_user` each, or until `duration_s`
    nominal seconds) measured on `dep`, with CPU use, validity, and the simulator's replay of the same requests.

    dilation: a number, or "auto": k from `calibration` (measured here when None) and sim_latency_s, the
    simulated seconds per token of this method (see the module docstring)."""
    from .measure import compare, measured_metrics, predicted_metrics
    from .serve import Client, closed_loop

    client = client or Client(dep)
    ctx = dep.cfg.ctx
    if warm:
        warm_up(client, dep, prompts, gen_tokens)
    if dilation == "auto":
        if sim_latency_s is None:
            raise EdgeMoEError("dilation='auto' needs the simulated latency per token (sim_latency_s)")
        calibration = calibration or calibrate(dep, client, users, prompts, gen_tokens)
        dilation = choose_dilation(calibration["cpu_s_per_token"], len(users), sim_latency_s, calibration["free_cores"],
                                   margin)
    dep.retime(dilation=float(dilation))
    with CpuMeter(ray_pids(dep)) as meter:
        records, makespan, errors = closed_loop(client, users, prompts, gen_tokens, duration_s,
                                                max_requests_per_user=requests_per_user)
    measured = measured_metrics(records, makespan, ctx) if records else {"requests": 0}
    predicted = (predicted_metrics(ctx, dep.cfg.policy, dep.cfg.params, records, wire_bytes, dep.cfg.decision_cost)
                 if records else {})
    late = measured.get("late_share", float("nan"))
    reasons = []
    if not late <= MAX_LATE_SHARE:
        reasons.append(f"passes ended {100 * late:.1f}% of the mean latency after their emulated deadlines "
                       f"(> {100 * MAX_LATE_SHARE:.0f}%): the host could not keep up at dilation {dilation:g}")
    warnings = []
    if meter.result["host_util"] > MAX_HOST_UTIL:
        warnings.append(f"host CPU {100 * meter.result['host_util']:.0f}% busy (> {100 * MAX_HOST_UTIL:.0f}%; "
                        f"{meter.result['other_cores_busy']:.2f} cores used by other processes)")
    if errors:
        reasons.append(f"{len(errors)} requests failed")
    return {"users": len(users), "requests_per_user": requests_per_user, "gen_tokens": gen_tokens,
            "dilation": float(dilation), "calibration": calibration, "sim_latency_ms_for_dilation":
            None if sim_latency_s is None else sim_latency_s * 1e3, "cpu": meter.result,
            "valid": not reasons, "invalid_because": reasons, "warnings": warnings, "errors": errors, "duplicates": client.duplicates,
            "failovers": client.failovers, "measured": measured, "predicted": predicted,
            "error_vs_simulator": compare(measured, predicted) if records else {}, "records": records}
