"""Shared fixtures: the shared data folder (skip when absent), small hand-made clusters, tiny models.

Also the thread count of each pytest-xdist worker (set before any test module imports torch or numpy).
"""

import copy
import os
from pathlib import Path

import pytest


def _threads_per_worker() -> int | None:
    """Cores per xdist worker (at least 1), or None outside xdist.

    Why: torch's OpenMP pool and OpenBLAS each start one thread per core in every worker, so `-n 2` on two cores
    runs four spinning pools; on a busy host the spinning dominates (measured: the upcycle training test took
    49 CPU s with two threads and 9 with one). The arithmetic does not change: each test still runs the same ops.
    """
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None
    return max(1, (os.cpu_count() or 1) // max(1, int(workers)))


_THREADS = _threads_per_worker()
if _THREADS is not None:
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_THREADS))  # a value set by the caller wins; child processes inherit it


# --- one compile per function for all xdist workers -----------------------------------------------------------------

def _compile_once_across_workers() -> None:
    """(xdist worker) makes each `njit(cache=True)` compile wait for a file lock of its function, shared by every
    process compiling from this checkout.

    Why: on a fresh clone the workers meet the same compiled functions at nearly the same time (both start
    with OrderMoE tests that call the decode kernel) and each compiled its own copy. With the lock the second worker waits for the first and then finds the function in numba's
    on-disk cache (numba reads the cache index again on every compile), so it loads instead of compiling.
    Nothing changes but who compiles: the lock is keyed by the source file and function, released by the
    kernel if a worker dies, and a function without a disk cache (numba's own overloads) is not locked.
    A call graph is acyclic, so two workers each holding a caller's lock cannot wait for each other.
    """
    try:
        from numba.core import caching, dispatcher
        from numba.core.compiler_lock import global_compiler_lock
    except ImportError:
        return
    compile_ = getattr(dispatcher.Dispatcher, "compile", None)
    if compile_ is None or getattr(compile_, "_edgemoe_locked", False):
        return
    import fcntl
    import hashlib
    import tempfile

    folder = Path(tempfile.gettempdir()) / "edgemoe-numba-compile-locks"
    folder.mkdir(exist_ok=True)

    held = set()  # keys this process holds: a recursive function compiles itself again inside its own compile

    def locked_compile(self, sig):
        func = self.py_func
        key = f"{getattr(func, '__code__', None) and func.__code__.co_filename}:{func.__qualname__}"
        if isinstance(getattr(self, "_cache", None), caching.NullCache) or key in held:
            return compile_(self, sig)
        # numba's own lock first (as compile takes it), so that threads of one process never wait on each other here
        with global_compiler_lock, open(folder / (hashlib.sha1(key.encode()).hexdigest() + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process ends)
            held.add(key)
            try:
                return compile_(self, sig)
            finally:
                held.discard(key)

    locked_compile._edgemoe_locked = True
    dispatcher.Dispatcher.compile = locked_compile


# --- numba's cache filled once for all xdist workers (tests/numba_warm.py says why) ---------------------------------

NUMBA_WARM = Path(__file__).with_name("numba_warm.py")
NUMBA_WAIT_S = 900.0  # a worker never waits longer than this for the warm-up; it then compiles what it needs


def _numba_cache_is_cold() -> bool:
    """True when some module of the package with `njit(cache=True)` has no cache index newer than its source
    (only with EDGEMOE_TEST_NUMBA_WARM=auto; the default "0" and "1" override the answer).

    (With NUMBA_CACHE_DIR set the files are elsewhere: counted as cold, so the warm-up runs and numba itself
    decides what is stale.)"""
    import importlib.util
    import re

    # "0" (default): off, each worker compiles what it meets; "1": always; "auto": when the cache is cold.
    # Off by default: on a fresh clone at load ~2 the suite took 4:41 without the warm-up and 5:12 with it
    # (one run each, stop 25), so the shared warm-up does not pay for the workers' wait on 2 cores.
    switch = os.environ.get("EDGEMOE_TEST_NUMBA_WARM", "0")
    if switch in ("0", "1"):
        return switch == "1"
    if os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0") or importlib.util.find_spec("numba") is None:
        return False
    if os.environ.get("NUMBA_CACHE_DIR"):
        return True
    spec = importlib.util.find_spec("edgemoe")
    for root in spec.submodule_search_locations or ():
        for src in Path(root).rglob("*.py"):
            if not re.search(r"@njit\([^)]*cache=True", src.read_text(encoding="utf-8")):
                continue
            stamp = src.stat().st_mtime
            if not any(f.stat().st_mtime >= stamp for f in (src.parent / "__pycache__").glob(f"{src.stem}.*.nbi")):
                return True
    return False


def pytest_configure(config):
    """(xdist worker) compiles once across workers (`_compile_once_across_workers`); on the xdist controller with a
    cold cache: starts the warm-up groups side by side, and marks a file when all have exited (whatever their
    exit status: a failed group only leaves its compiles to the workers)."""
    if hasattr(config, "workerinput") and os.name == "posix" and os.environ.get("EDGEMOE_TEST_NUMBA_LOCK", "1") != "0":
        _compile_once_across_workers()  # EDGEMOE_TEST_NUMBA_LOCK=0: each worker compiles on its own, as numba does
    if hasattr(config, "workerinput") or config.getoption("dist", "no") == "no" or not _numba_cache_is_cold():
        return
    import subprocess
    import sys
    import tempfile
    import threading
    import time

    folder = Path(tempfile.mkdtemp(prefix="edgemoe-numba-warm-"))
    procs = []
    for group in ("ordermoe", "rest", "decode"):  # numba_warm.GROUPS
        with open(folder / f"{group}.log", "wb") as log:
            procs.append((group, subprocess.Popen([sys.executable, str(NUMBA_WARM), group], stdout=log,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)))

    start = time.monotonic()

    def mark_when_done():
        for _, proc in procs:
            proc.wait()
        (folder / "done").write_text(f"{time.monotonic() - start:.1f}")

    threading.Thread(target=mark_when_done, daemon=True).start()
    config.stash[_WARM_KEY] = (folder, procs)


_WARM_KEY = pytest.StashKey[tuple]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(xdist, controller) tells each worker where the warm-up marks its end."""
    warm = node.config.stash.get(_WARM_KEY, None)
    if warm is not None:
        node.workerinput["edgemoe_numba_warm"] = str(warm[0] / "done")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """(xdist worker) after collecting, waits for the warm-up before the first test; returns None so the normal
    loop runs."""
    import time

    done = getattr(session.config, "workerinput", {}).get("edgemoe_numba_warm")
    if done:
        give_up = time.monotonic() + NUMBA_WAIT_S
        while not os.path.exists(done) and time.monotonic() < give_up:
            time.sleep(0.2)


def pytest_unconfigure(config):
    """(controller) ends a warm-up still running (an interrupted session) and names a group that failed."""
    warm = config.stash.get(_WARM_KEY, None)
    if warm is None:
        return
    import shutil

    folder, procs = warm
    failed = False
    for group, proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        elif proc.returncode != 0:
            failed = True
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"numba warm-up group {group!r} exited {proc.returncode}: see {folder / group}.log"
                                    " (the workers compiled what it missed)")
    done = folder / "done"
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if done.exists() and reporter is not None:
        reporter.write_line(f"numba cache filled by tests/numba_warm.py in {done.read_text()} s wall "
                            "(the xdist workers waited for it after collecting)")
    if not failed:
        shutil.rmtree(folder, ignore_errors=True)


# --- the order the xdist workers start in --------------------------------------------------------------------------

# The tests each worker starts with (node-id prefixes, in order), one entry per lane. Why: `--dist worksteal` deals
# the collection out in consecutive parts, one per worker, and a worker only steals from the end of another's
# queue. On a fresh clone the compiles dominate, and a worker that meets a function another is compiling waits
# for it (`_compile_once_across_workers`): so each worker starts with compiles the others do not need yet.
# Lane one: the rule loop, then the OrderMoE wave loop (the longest compile). Lane two: OrderMoE's decode path,
# then the tests on the session's Ray instance, which call it and run long on little CPU of their own (Ray's
# processes and timeouts); no other worker steals them (`NEVER_STOLEN`), so one worker starts one Ray instance
# and nothing long starts last. Lane three: the multi-node Ray check (a cluster of its own in a subprocess: the
# longest test, mostly waiting on Ray's processes, and the one Ray test that needs no session Ray), so that its
# waits overlap the other lanes' compiles. With fewer workers than lanes, lane i joins worker i % workers (with
# two: the multi-node check after the OrderMoE loop). The other tests follow in runs of their collected order
# (`lane_order` says which run goes where).
FIRST_IN_LANE = (
    ("tests/runtime/sim/test_sim_decision_cost.py::test_decisions_charged_at_the_home_add_their_model_per_layer[fast-0.0]",
     "tests/runtime/policies/test_ordermoe.py::test_tight_and_loose_users_diverge_in_the_simulator_and_stay_within_budget"),
    ("tests/runtime/policies/test_field_baselines.py::test_ordermoe_on_error_groups_substitutes_within_those_groups",
     "tests/distributed/test_ray_backend.py::", "tests/distributed/test_ray_faults.py::",
     "tests/distributed/test_ray_http.py::", "tests/distributed/test_ray_request_policy.py::"),
    ("tests/distributed/test_ray_multinode.py::",),
)


def lane_order(nodeids: list[str], workers: int = 2) -> list[int]:
    """Indices of `nodeids` in run order: worker w's lanes' `FIRST_IN_LANE` tests first in the w-th of `workers`
    parts as worksteal deals them (part w holds `remaining // (workers - w)` of the tests not yet dealt), then a
    run of the other tests in their collected order. Lane i belongs to worker i % workers; nothing is dropped or
    repeated. The runs are dealt from the last part to the first, so the first worker (the rule and OrderMoE
    loops' compiles) goes on with the collection's last tests (runtime/, which call those loops) and the last
    worker with its first ones (cluster/, data/, ...), which need no compile another worker is still doing."""
    workers = max(1, workers)
    heads, taken = [[] for _ in range(workers)], set()
    for lane, prefixes in enumerate(FIRST_IN_LANE):
        for prefix in prefixes:
            for i, nodeid in enumerate(nodeids):
                if i not in taken and nodeid.startswith(prefix):
                    heads[lane % workers].append(i)
                    taken.add(i)
    rest = [i for i in range(len(nodeids)) if i not in taken]
    sizes, left = [], len(nodeids)
    for w in range(workers):
        sizes.append(left // (workers - w) if w < workers - 1 else left)
        left -= sizes[-1]
    runs, used = [[] for _ in range(workers)], 0
    for w in reversed(range(workers)):
        fill = max(0, sizes[w] - len(heads[w]))
        runs[w] = rest[used:used + fill]
        used += fill
    return [i for w in range(workers) for i in heads[w] + runs[w]] + rest[used:]


def pytest_collection_modifyitems(config, items):
    """(xdist worker) puts the tests in `lane_order` (every worker orders the same collection the same way, as
    xdist requires)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or os.environ.get("EDGEMOE_TEST_ORDER", "lanes") != "lanes":
        return  # EDGEMOE_TEST_ORDER=collected: pytest's own order
    order = lane_order([item.nodeid for item in items], int(workers))
    items[:] = [items[i] for i in order]


# Tests that stay on the worker they are dealt to: worksteal never moves them. Why: the Ray tests share one Ray
# instance and one deployment per worker (tests/distributed/conftest.py), so a Ray test stolen by another worker
# starts a second instance and deployment there (about 22 CPU s, a minute on a busy 2-core host) to save the
# few seconds the test itself takes. In the last cold run before this rule the other two workers, idle at the
# end, stole the request-policy module's tests and each started its own.
NEVER_STOLEN = ("tests/distributed/test_ray_",)
try:  # worksteal's own bound: a worker with fewer tests queued than this asks for more
    from xdist.scheduler.worksteal import MIN_PENDING as MIN_QUEUE
except ImportError:  # no xdist (a plain pytest run never steals): the value it has had since 3.x
    MIN_QUEUE = 2


def steal_choice(queues: dict, nodeids: list[str]) -> tuple[object, list[int]]:
    """(victim, the indices to take from it): half of the stealable tests of the worker with the most of them,
    taken from its queue's end, leaving it at least `MIN_QUEUE` queued; (None, []) when nothing can be taken.

    queues: worker -> its queued test indices (into nodeids), in run order. A test whose node id starts with one
    of `NEVER_STOLEN` is not stealable."""
    stealable = {w: [i for i in q if not nodeids[i].startswith(NEVER_STOLEN)] for w, q in queues.items()}
    victim = max(stealable, key=lambda w: len(stealable[w]), default=None)
    if victim is None:
        return None, []
    take = min(len(stealable[victim]) // 2, len(queues[victim]) - MIN_QUEUE)
    return (victim, stealable[victim][len(stealable[victim]) - take:]) if take > 0 else (None, [])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """(xdist controller) `--dist worksteal` whose steals pass over `NEVER_STOLEN` tests (`steal_choice`);
    every other choice is worksteal's own: the tests not yet dealt go to the idle workers in equal shares,
    one steal is asked at a time, and an idle worker with nothing left to take is shut down. It reads
    worksteal's internal state; an xdist that names that state otherwise gets its plain worksteal (None), so
    the suite still runs, only with Ray tests stealable again."""
    if config.getvalue("dist") != "worksteal":
        return None
    from xdist.scheduler import WorkStealingScheduling

    class KeepNeverStolenTests(WorkStealingScheduling):
        def check_schedule(self) -> None:
            queues = {node: q for node, q in self.node2pending.items() if not node.shutting_down}
            idle = [node for node, q in queues.items() if len(q) < MIN_QUEUE]
            if self.pending and idle:
                for k, node in enumerate(idle):
                    self._send_tests(node, len(self.pending) // (len(idle) - k))
                idle = [node for node in idle if len(queues[node]) < MIN_QUEUE]
            if not idle or self.steal_requested_from_node is not None:
                return
            victim, take = steal_choice(queues, self.collection)
            if victim is None:
                for node in idle:
                    node.shutdown()  # it runs what it holds and stops
                return
            victim.send_steal(take)
            self.steal_requested_from_node = victim

    sched = KeepNeverStolenTests(config, log)
    internals = ("node2pending", "pending", "collection", "steal_requested_from_node", "_send_tests")
    return sched if all(hasattr(sched, name) for name in internals) else None


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "wikitext-2").is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (these tests need ../shared/data)")
    return SHARED_DATA


# A three-server cluster file (one user per server) shared by the CLI tests.
THREE_EDGE_CLUSTER_YAML = """
name: three-edge
nodes:
  - {name: a, kind: edge, memory: 12MB, compute: {peak_flops: 10TFLOPS, memory_bandwidth: 500GB/s, overhead: 50us}}
  - {name: b, kind: edge, memory: 12MB, compute: {peak_flops: 20TFLOPS, memory_bandwidth: 900GB/s, overhead: 50us}}
  - {name: c, kind: edge, memory: 8MB, compute: {peak_flops: 5TFLOPS, memory_bandwidth: 200GB/s, overhead: 50us}}
links:
  - {src: a, dst: b, latency: 5ms, bandwidth: 100Mbit/s}
  - {src: b, dst: c, latency: 10ms, bandwidth: 50Mbit/s}
  - {src: a, dst: c, latency: 12ms, bandwidth: 50Mbit/s}
users:
  - {name: u1, home: a, weight: 3, domain: domain0}
  - {name: u2, home: b, weight: 1, domain: domain1}
  - {name: u3, home: c, weight: 1, domain: domain2}
"""


@pytest.fixture(scope="session")
def three_edge_cluster_yaml() -> str:
    """The text of a small three-server cluster file (THREE_EDGE_CLUSTER_YAML)."""
    return THREE_EDGE_CLUSTER_YAML


# Two edge servers and a cloud (the cluster and plan-problem tests); numbers chosen so that answers are easy by hand.
# a <-> b: 10 ms one way, 1 MB/s; a, b <-> cloud: 50 ms, 10 MB/s.
TRIANGLE = {
    "name": "triangle",
    "nodes": [
        {"name": "a", "kind": "edge", "memory": 3_000_000,
         "compute": {"peak_flops": 1e12, "memory_bandwidth": 1e9, "overhead": 1e-4}},
        {"name": "b", "kind": "edge", "memory_fraction": 0.5,
         "compute": {"peak_flops": "2TFLOPS", "memory_bandwidth": "2GB/s", "overhead": "100us"}},
        {"name": "cloud", "kind": "cloud", "compute": "h200"},
    ],
    "links": [
        {"src": "a", "dst": "b", "latency": "10ms", "bandwidth": "1MB/s"},
        {"src": "a", "dst": "cloud", "latency": 0.05, "bandwidth": 1e7},
        {"src": "b", "dst": "cloud", "latency": "50ms", "bandwidth": "80Mbit/s"},
    ],
    "users": [
        {"name": "alice", "home": "a", "weight": 3, "domain": "wiki"},
        {"name": "bob", "home": "b", "weight": 1, "domain": "code"},
    ],
}


@pytest.fixture
def triangle() -> dict:
    return copy.deepcopy(TRIANGLE)


@pytest.fixture
def tiny_comparison_inputs():  # built per test: run_comparison may cache into the profile
    """(adapter, profile, EvalText) of a tiny random Mixtral for `run_comparison` tests: a profile on 8 blocks
    of two domains, 4 x 24 evaluation tokens with their exact scores and routing, 4 x 24 calibration tokens."""
    import numpy as np

    from edgemoe.data import TokenBlocks
    from edgemoe.eval.experiment import EvalText
    from edgemoe.models import adapter_for
    from edgemoe.models.scoring import token_scores
    from edgemoe.models.tiny import TINY_VOCAB, tiny_model
    from edgemoe.profile.collect import collect_profile
    from edgemoe.runtime.local import routing_trace

    adapter = adapter_for(tiny_model("mixtral", seed=5), "mixtral")
    rng = np.random.default_rng(0)
    calib = TokenBlocks(rng.integers(1, TINY_VOCAB, (8, 32)), np.arange(8) % 2, ("a", "b"))
    profile = collect_profile(adapter, calib, "tiny-mixtral", "random", batch_size=4, subst_tokens=64, progress=False)
    ids, cal = rng.integers(1, TINY_VOCAB, (4, 24)), rng.integers(1, TINY_VOCAB, (4, 24))
    nll, top1 = token_scores(adapter, ids)
    topk, gates = routing_trace(adapter, ids)
    text = EvalText(ids=ids, nll=nll, top1=top1, topk=topk, gates=gates, calib_ids=cal,
                    calib_nll=token_scores(adapter, cal)[0])
    return adapter, profile, text


# --- a per-worker timeline (EDGEMOE_TEST_TIMELINE=FILE; off by default) --------------------------------------------

_TIMELINE = os.environ.get("EDGEMOE_TEST_TIMELINE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With EDGEMOE_TEST_TIMELINE=FILE: appends one JSON line per test to FILE.<worker> (wall start and end from
    the epoch, this process's CPU seconds, setup/call/teardown wall), to see where a worker's wall goes."""
    if not _TIMELINE:
        yield
        return
    import json
    import time

    t0, c0, s0 = time.time(), time.process_time(), _schedstat()
    yield
    t1, c1, s1 = time.time(), time.process_time(), _schedstat()
    phases = {r.when: r.duration for r in getattr(item, "_edgemoe_reports", ())}
    # blocked: wall neither on a core nor waiting for one (the main thread's sleeps, waits on other processes)
    blocked = {} if s0 is None or s1 is None else {"blocked": (t1 - t0) - (s1[0] - s0[0]) - (s1[1] - s0[1])}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{_TIMELINE}.{worker}", "a", encoding="utf-8") as out:
        out.write(json.dumps({"id": item.nodeid, "start": t0, "end": t1, "cpu": c1 - c0, **phases, **blocked,
                              "load": os.getloadavg()[0]}) + "\n")


def _schedstat() -> tuple[float, float] | None:
    """(seconds on a core, seconds runnable but waiting for one) of this process's main thread (Linux), or None."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/schedstat", encoding="ascii") as f:
            on_cpu, waiting = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if _TIMELINE:
        item.__dict__.setdefault("_edgemoe_reports", []).append(outcome.get_result())


def pytest_sessionstart(session):
    if _TIMELINE:
        import json
        import time

        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_TIMELINE}.{worker}", "a", encoding="utf-8") as out:
            out.write(json.dumps({"id": "<sessionstart>", "start": time.time(), "end": time.time(), "cpu": time.process_time()}) + "\n")
