"""Hidden states on the wire: torch [R, H] <-> a numpy array in the wire dtype, plus the message types.

Only numpy arrays and frozen dataclasses of plain values cross between our processes. bf16 travels as
its raw 16-bit pattern in an int16 array (numpy has no bf16), so the receiver sees exactly the bits the
sender rounded to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def encode(hidden: torch.Tensor, wire: str) -> np.ndarray:
    """[R, H] tensor -> numpy array holding it in the wire dtype."""
    if wire not in WIRE_DTYPES:
        raise EdgeMoEError(f"wire dtype {wire!r}; expected one of {sorted(WIRE_DTYPES)}")
    t = hidden.detach().to("cpu", WIRE_DTYPES[wire]).contiguous()
    return t.view(torch.int16).numpy() if wire == "bf16" else t.numpy()


def decode(arr: np.ndarray, wire: str) -> torch.Tensor:
    """The inverse of `encode`, as float32 [R, H]."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return (t.view(torch.bfloat16) if wire == "bf16" else t).float()


def row_bytes(hidden_size: int, wire: str) -> int:
    return int(hidden_size) * torch.empty((), dtype=WIRE_DTYPES[wire]).element_size()


@dataclass(frozen=True)
class ExpertCall:
    """One home -> server message: R slot rows of one MoE layer."""

    layer: int
    hidden: np.ndarray  # [R, H] wire dtype
    experts: np.ndarray  # [R] expert to run on each row
    src: np.ndarray  # [R] node the token sits at (the inbound leg starts there)
    dst: np.ndarray  # [R] meeting node (the outbound leg ends there)
    wire: str = "bf16"
    sent: float = float("nan")  # nominal send time (links.Clock); nan: the callee's now


@dataclass(frozen=True)
class ExpertReply:
    """The outputs and the emulated times of every row (nominal seconds, links.Clock)."""

    out: np.ndarray  # [R, H] wire dtype, expert outputs with gate 1
    node: int
    inbound_s: float  # the slowest row's inbound leg (emulated seconds)
    outbound_s: float  # the slowest row's outbound leg
    bytes_in: int  # bytes that crossed an emulated link
    bytes_out: int
    compute_s: float  # wall seconds of the expert arithmetic (host CPU; it sets no clock)
    arrival: np.ndarray = None  # [R] when each row reached this node
    start: np.ndarray = None  # [R] when the node's accelerator started it (FIFO)
    end: np.ndarray = None  # [R] when it finished
    back_s: np.ndarray = None  # [R] outbound leg of each row to its meeting node
    free_at: float = float("nan")  # the node's accelerator is busy until then (a load estimate for homes)


@dataclass(frozen=True)
class GenerateRequest:
    """A client's request: greedy generation of gen_tokens after prompt [P] for user u."""

    request_id: str
    user: int
    prompt: np.ndarray  # [P] token ids
    gen_tokens: int
    attempt: int = 0
    submit_s: float = float("nan")  # nominal time the client submitted it (nan: the home's now)
    allow_degraded: bool = False  # exact policy: accept slots a failure drops or substitutes (else Degraded)


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    user: int
    tokens: np.ndarray  # [G] generated ids
    served_by: int  # home node that ran the dense part
    queued_s: float  # nominal seconds from submission to the prefill's start
    prefill_s: float  # nominal seconds of the prefill pass (queueing excluded)
    decode_s: np.ndarray  # [G-1] nominal seconds of each decode pass (measured: wall / dilation)
    counts: dict  # slots, remote, substituted, dropped, repaired, link_bytes, process_bytes, emulated_s
    topk: np.ndarray  # [P+G-1, L, K] routing of every row (for the simulator's replay)
    gates: np.ndarray  # [P+G-1, L, K]
    replayed: bool = False  # answered from the home's cache of finished requests (a client retry)
    extra: dict = field(default_factory=dict)
    arrival_s: float = float("nan")  # nominal submit time (what the simulator's replay uses)
    pass_begin_s: np.ndarray = None  # [G] nominal start of each pass (prefill first)
    pass_end_s: np.ndarray = None  # [G] nominal end as measured (the deadline, or later if the host was late)
    pass_deadline_s: np.ndarray = None  # [G] pass end less the host's lateness within the pass (= end when on time)
    events: np.ndarray = None  # [J, 10] per expert job: pass, layer, node, row, slot, sent, arrival, start, end, done
    node_busy_s: np.ndarray = None  # [N] emulated accelerator seconds this request's jobs used per node
    dense_events: np.ndarray = None  # [P*L, 6] per pass and layer, the dense work on the home's backbone queue:
    #                                  pass, layer, node, arrival, start, end (none when the dense part is off)
