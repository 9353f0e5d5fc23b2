"""Routing traces and workloads for the simulator: who sends which tokens when (pure numpy, seeded).

A request of user u = `prompt_tokens` prompt rows processed together (the prefill pass, which yields the
first generated token) followed by `gen_tokens - 1` decode passes of one row each, one after the other.
Each row's routing (topk/gates at every layer) is a calibration token of the user's domain drawn from the
trace. Arrivals: "poisson" (a total rate over all users, each request's user drawn by weight) or "closed"
(each user keeps one request in flight and sends the next `think_s` after the last one ends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError, require_in_range


@dataclass(frozen=True)
class Trace:
    """Per-token routing. T tokens, L layers, K slots."""

    topk: np.ndarray  # [T, L, K] int64
    gates: np.ndarray  # [T, L, K] float
    domain: np.ndarray  # [T] int domain id

    @classmethod
    def from_profile(cls, profile) -> Trace:
        """The calibration routing recorded in a profile (or recorded from the real model in the same form)."""
        return cls(topk=np.asarray(profile.topk, np.int64), gates=np.asarray(profile.gates, float),
                   domain=np.asarray(profile.domain, np.int64))

    def __post_init__(self):
        if self.topk.ndim != 3 or self.gates.shape != self.topk.shape or self.domain.shape != self.topk.shape[:1]:
            raise EdgeMoEError(f"trace: topk/gates must be [T, L, K] and domain [T]; got {self.topk.shape}, "
                               f"{self.gates.shape}, {self.domain.shape}")


@dataclass(frozen=True)
class Workload:
    """How users load the system. Rates in requests per second."""

    num_requests: int = 64
    prompt_tokens: int = 16
    gen_tokens: int = 16  # generated tokens per request (the first comes out of the prefill pass)
    arrival: str = "poisson"  # "poisson" | "closed"
    rate_per_s: float = 10.0  # poisson: total request rate over all users
    think_s: float = 0.0  # closed: pause between a user's requests
    seed: int = 0

    def __post_init__(self):
        if self.arrival not in ("poisson", "closed"):
            raise EdgeMoEError(f"workload.arrival={self.arrival!r}; expected 'poisson' or 'closed'")
        if self.num_requests < 1 or self.prompt_tokens < 1 or self.gen_tokens < 1:
            raise EdgeMoEError("workload: num_requests, prompt_tokens and gen_tokens must be >= 1, got "
                               f"{self.num_requests}, {self.prompt_tokens}, {self.gen_tokens}")
        if self.arrival == "poisson" and not 0 < self.rate_per_s < math.inf:
            raise EdgeMoEError(f"workload.rate_per_s must be finite and > 0 for poisson arrivals, got {self.rate_per_s}")
        if not 0 <= self.think_s < math.inf:  # (a NaN pause ran the fast engine's loop for ever)
            raise EdgeMoEError(f"workload.think_s must be finite and >= 0, got {self.think_s}")


@dataclass(frozen=True)
class Scenario:
    """Requests, passes and rows of one simulated run. R requests, P passes, Q rows."""

    request_user: np.ndarray  # [R] int
    request_arrival: np.ndarray  # [R] float s: poisson arrival; closed: first request of a user at 0, others nan
    request_first_pass: np.ndarray  # [R] int
    request_next: np.ndarray  # [R] int next request of the same user (closed loop), -1 for none
    pass_request: np.ndarray  # [P] int
    pass_prefill: np.ndarray  # [P] bool
    pass_row_start: np.ndarray  # [P] int first row of the pass
    pass_row_count: np.ndarray  # [P] int
    pass_next: np.ndarray  # [P] int next pass of the same request, -1 after the last
    row_trace: np.ndarray  # [Q] int trace token of each row
    row_user: np.ndarray  # [Q] int
    row_pass: np.ndarray  # [Q] int
    closed: bool
    think_s: float

    def __post_init__(self):
        """Raise EdgeMoEError unless the arrays fit together: the compiled engine follows these indices unchecked
        (a pass_next that pointed back ended the run with NaN latencies and no error). What needs the context or
        the trace (users, trace tokens) `simulate_scenario` checks."""
        R, P, Q = len(self.request_user), len(self.pass_request), len(self.row_trace)
        for names, n in ((("request_user", "request_arrival", "request_first_pass", "request_next"), R),
                         (("pass_request", "pass_prefill", "pass_row_start", "pass_row_count", "pass_next"), P),
                         (("row_trace", "row_user", "row_pass"), Q)):
            for name in names:
                a = getattr(self, name)
                if not isinstance(a, np.ndarray) or a.shape != (n,):
                    raise EdgeMoEError(f"scenario.{name} must be a [{n}] array, got "
                                       f"{a.shape if isinstance(a, np.ndarray) else type(a).__name__}")
        for name, lo, hi in (("request_first_pass", 0, P), ("pass_request", 0, R), ("row_pass", 0, P),
                             ("pass_row_count", 1, Q + 1), ("pass_row_start", 0, Q)):
            require_in_range(getattr(self, name), lo, hi, f"scenario.{name} must hold values")
        if P and (self.pass_row_start + self.pass_row_count).max() > Q:
            raise EdgeMoEError(f"scenario: a pass's rows run past the {Q} rows (pass_row_start + pass_row_count)")
        for name, n in (("request_next", R), ("pass_next", P)):  # -1, or a later entry: no cycle
            a = getattr(self, name)
            if ((a != -1) & ((a <= np.arange(n)) | (a >= n))).any():
                raise EdgeMoEError(f"scenario.{name} must name a later entry or -1 (a link may not point back)")
        arrival = self.request_arrival
        if (np.isinf(arrival) | (arrival < 0)).any() or not 0 <= self.think_s < math.inf:
            raise EdgeMoEError("scenario: request_arrival must be seconds >= 0 (NaN: a closed-loop follow-up) and "
                               f"think_s finite and >= 0, got think_s {self.think_s}")

    @property
    def num_passes(self) -> int:
        return int(self.pass_request.shape[0])

    def rows_of(self, passes: np.ndarray) -> np.ndarray:
        """[rows] indices of all rows of `passes` (concatenated in pass order)."""
        counts = self.pass_row_count[passes]
        starts = self.pass_row_start[passes]
        total = int(counts.sum())
        shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
        return shift + np.arange(total)


def build_scenario(user_weight: np.ndarray, user_domain: np.ndarray, trace: Trace, workload: Workload) -> Scenario:
    """Draw the requests of `workload` for users with `user_weight` [U] and `user_domain` [U] from `trace`."""
    rng = np.random.default_rng(workload.seed)
    U, R = len(user_weight), workload.num_requests
    P_req, G = workload.prompt_tokens, workload.gen_tokens
    weight = np.asarray(user_weight, float) / np.sum(user_weight)
    users = rng.choice(U, size=R, p=weight)
    closed = workload.arrival == "closed"
    if closed:
        arrival = np.full(R, np.nan)
        first_of_user = np.unique(users, return_index=True)[1]
        arrival[first_of_user] = 0.0
        nxt = np.full(R, -1, np.int64)
        for u in np.unique(users):  # per user, once: link each request to the user's next one
            mine = np.flatnonzero(users == u)
            nxt[mine[:-1]] = mine[1:]
    else:
        arrival = np.cumsum(rng.exponential(1.0 / workload.rate_per_s, size=R))
        nxt = np.full(R, -1, np.int64)
    passes_per_req = G  # one prefill + G - 1 decode passes
    rows_per_req = P_req + G - 1
    pass_request = np.repeat(np.arange(R), passes_per_req)
    k = np.tile(np.arange(passes_per_req), R)
    pass_prefill = k == 0
    pass_row_count = np.where(pass_prefill, P_req, 1)
    pass_row_start = np.repeat(np.arange(R) * rows_per_req, passes_per_req) + np.where(pass_prefill, 0, P_req + k - 1)
    pass_next = np.where(k < passes_per_req - 1, np.arange(R * passes_per_req) + 1, -1)
    row_user = np.repeat(users, rows_per_req)
    row_pass = np.repeat(np.arange(R * passes_per_req), pass_row_count)
    row_trace = _draw_rows(rng, trace.domain, np.asarray(user_domain)[users], rows_per_req)
    return Scenario(
        request_user=users, request_arrival=arrival, request_first_pass=np.arange(R) * passes_per_req,
        request_next=nxt, pass_request=pass_request, pass_prefill=pass_prefill, pass_row_start=pass_row_start,
        pass_row_count=pass_row_count, pass_next=pass_next, row_trace=row_trace.ravel(), row_user=row_user,
        row_pass=row_pass, closed=closed, think_s=float(workload.think_s),
    )


def _draw_rows(rng: np.random.Generator, token_domain: np.ndarray, request_domain: np.ndarray, n: int) -> np.ndarray:
    """[R, n] trace tokens for each request: a random contiguous run of its domain's tokens (wrapping).

    Contiguous runs keep the trace's token order (real text); a domain with no tokens uses all tokens.
    """
    out = np.empty((len(request_domain), n), np.int64)
    for d in np.unique(request_domain):
        pool = np.flatnonzero(token_domain == d)
        if pool.size == 0:
            pool = np.arange(len(token_domain))
        mine = np.flatnonzero(request_domain == d)
        start = rng.integers(0, pool.size, size=mine.size)
        out[mine] = pool[(start[:, None] + np.arange(n)[None, :]) % pool.size]
    return out
