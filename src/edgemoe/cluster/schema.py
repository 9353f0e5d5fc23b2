"""Cluster files: pydantic at the file boundary, frozen dataclasses inside.

A cluster is nodes (user devices, edge servers, clouds), directed links between them, and users homed on
nodes. `build_cluster` turns a plain dict into a `Cluster`, whose `lat_s [N, N]` and `bw_Bps [N, N]` are
the shortest-latency-path closure of the links (Floyd-Warshall; bandwidth is the bottleneck along the chosen
path). Reading files and preset names is `edgemoe.cluster.load`'s job, above this module and the presets,
so neither imports the other's importer. See docs/cluster.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edgemoe.errors import EdgeMoEError

from . import hardware, radio, units
from .hardware import Compute

NodeKind = Literal["device", "edge", "cloud"]


# ----------------------------------------------------------------------------------------------------------
# File boundary (pydantic). Quantities may carry units; validators turn them into base units and name ranges.
# ----------------------------------------------------------------------------------------------------------


# Upper bounds that keep every number finite and every array it becomes exact: bytes end up in int64 arrays
# and sums of them (2**53 B = 9 PB per node is exact in a float too); a one-way latency above a day is a typo
# that would otherwise turn the path closure into "disconnected"; user loads are normalised by their sum.
MAX_BYTES = 2**53
MAX_LATENCY_S = 86_400.0
MAX_LOAD = 1e12


def _quantity(parser, value: Any, *, minimum: float, what: str, strict: bool = False,
              maximum: float = math.inf) -> float:
    try:
        number = parser(value)
    except units.UnitError as exc:
        raise ValueError(str(exc)) from None
    if not math.isfinite(number):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    if number < minimum or (strict and number == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"{what} must be {bound}, got {value!r}")
    if number > maximum:
        raise ValueError(f"{what} must be <= {maximum:g}, got {value!r}")
    return number


class _Strict(BaseModel):
    # allow_inf_nan=False: every float field of a cluster file is finite (NaN/inf is refused with its path)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ComputeIn(_Strict):
    peak_flops: float
    memory_bandwidth: float
    overhead: float = 0.0

    @field_validator("peak_flops", mode="before")
    @classmethod
    def _flops(cls, v: Any) -> float:
        return _quantity(units.parse_flops, v, minimum=0, strict=True, what="peak FLOP/s")

    @field_validator("memory_bandwidth", mode="before")
    @classmethod
    def _bw(cls, v: Any) -> float:
        return _quantity(units.parse_rate, v, minimum=0, strict=True, what="memory bandwidth (bytes/s)")

    @field_validator("overhead", mode="before")
    @classmethod
    def _overhead(cls, v: Any) -> float:
        return _quantity(units.parse_seconds, v, minimum=0, what="per-call overhead (s)")


class NodeIn(_Strict):
    name: str = Field(min_length=1)
    kind: NodeKind
    memory: float | None = None  # bytes for experts
    memory_fraction: float | None = Field(default=None, ge=0.0, le=1.0)  # of the model's total expert bytes
    compute: str | ComputeIn
    utilisation: float = Field(default=0.0, ge=0.0, lt=1.0)  # rho of an M/M/1 queue at this node
    service_rate: float | None = Field(default=None, gt=0.0)  # mu, expert calls/s; default 1/mean call time
    position_m: tuple[float, float] | None = None  # for wireless_access and drawings
    description: str = ""

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> float | None:
        return None if v is None else _quantity(units.parse_bytes, v, minimum=0, maximum=MAX_BYTES, what="memory (bytes)")

    @field_validator("compute", mode="before")
    @classmethod
    def _compute_name(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in hardware.CATALOGUE:
            raise ValueError(f"unknown compute spec {v!r}; use one of {sorted(hardware.CATALOGUE)} or a mapping "
                             "{peak_flops, memory_bandwidth, overhead}")
        return v

    @model_validator(mode="after")
    def _one_memory(self) -> NodeIn:
        if self.memory is not None and self.memory_fraction is not None:
            raise ValueError("give either memory (bytes) or memory_fraction (of all expert bytes), not both")
        if self.memory is None and self.memory_fraction is None and self.kind != "cloud":
            raise ValueError(f"a {self.kind} node needs memory (bytes >= 0) or memory_fraction (in [0, 1])")
        return self


class WirelessIn(_Strict):
    """Shannon-rate link (SlimCaching §2.3): rate = B log2(1 + p G / (N0 B)) each way."""

    bandwidth_hz: float
    tx_power_dbm: float  # transmitter at src (the forward direction)
    reverse_tx_power_dbm: float | None = None  # transmitter at dst; default tx_power_dbm
    reverse_bandwidth_hz: float | None = None  # default bandwidth_hz
    gain_db: float | None = None  # channel gain; else -path_loss(distance_m) or from node positions
    distance_m: float | None = Field(default=None, ge=0.0)
    noise_dbm_per_hz: float = -174.0

    @field_validator("bandwidth_hz", "reverse_bandwidth_hz", mode="before")
    @classmethod
    def _hz(cls, v: Any) -> float | None:
        return None if v is None else _quantity(units.parse_hz, v, minimum=0, strict=True, what="bandwidth (Hz)")

    @model_validator(mode="after")
    def _one_gain(self) -> WirelessIn:
        if self.gain_db is not None and self.distance_m is not None:
            raise ValueError("give either gain_db or distance_m, not both")
        return self


class LinkIn(_Strict):
    src: str
    dst: str
    latency: float  # one-way seconds
    bandwidth: float | None = None  # bytes/s src -> dst (wired); wireless links compute it
    reverse_latency: float | None = None
    reverse_bandwidth: float | None = None
    symmetric: bool = True  # also create dst -> src (with the reverse_* values where given)
    wireless: WirelessIn | None = None

    @field_validator("latency", "reverse_latency", mode="before")
    @classmethod
    def _latency(cls, v: Any) -> float | None:
        return None if v is None else _quantity(units.parse_seconds, v, minimum=0, maximum=MAX_LATENCY_S,
                                                what="one-way latency (s)")

    @field_validator("bandwidth", "reverse_bandwidth", mode="before")
    @classmethod
    def _bandwidth(cls, v: Any) -> float | None:
        if v is None:
            return None
        return _quantity(units.parse_rate, v, minimum=0, strict=True, what="bandwidth (bytes/s)")

    @model_validator(mode="after")
    def _consistent(self) -> LinkIn:
        if (self.wireless is None) == (self.bandwidth is None):
            raise ValueError("give exactly one of bandwidth (wired) or wireless (Shannon-rate parameters)")
        if self.wireless is not None and self.reverse_bandwidth is not None:
            raise ValueError("a wireless link's reverse rate comes from wireless.reverse_*; drop reverse_bandwidth")
        if not self.symmetric and (self.reverse_latency is not None or self.reverse_bandwidth is not None):
            raise ValueError("reverse_latency/reverse_bandwidth describe dst -> src; they need symmetric: true")
        return self


class WirelessAccessIn(_Strict):
    """Create a wireless link between every device and every edge server within range_m (needs positions)."""

    range_m: float = Field(gt=0.0)
    latency: float = 0.0  # one-way air-interface latency added to each wireless link
    bandwidth_hz: float
    device_tx_power_dbm: float = 23.0
    server_tx_power_dbm: float = 43.0
    noise_dbm_per_hz: float = -174.0

    @field_validator("latency", mode="before")
    @classmethod
    def _latency(cls, v: Any) -> float:
        return _quantity(units.parse_seconds, v, minimum=0, maximum=MAX_LATENCY_S, what="one-way latency (s)")

    @field_validator("bandwidth_hz", mode="before")
    @classmethod
    def _hz(cls, v: Any) -> float:
        return _quantity(units.parse_hz, v, minimum=0, strict=True, what="bandwidth (Hz)")


class UserIn(_Strict):
    name: str = Field(min_length=1)
    home: str
    weight: float | None = Field(default=None, ge=0.0, le=MAX_LOAD)  # share of tokens (normalised over users)
    arrival_rate: float | None = Field(default=None, ge=0.0, le=MAX_LOAD)  # tokens/s; normalised into a weight
    domain: str

    @model_validator(mode="after")
    def _one_load(self) -> UserIn:
        if self.weight is not None and self.arrival_rate is not None:
            raise ValueError("give either weight or arrival_rate, not both")
        return self


class ClusterIn(_Strict):
    name: str = "cluster"
    description: str = ""
    nodes: list[NodeIn] = Field(min_length=1)
    links: list[LinkIn] = Field(default_factory=list)
    wireless_access: WirelessAccessIn | None = None
    users: list[UserIn] = Field(min_length=1)


# ----------------------------------------------------------------------------------------------------------
# Inside (frozen dataclasses)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    name: str
    kind: str  # "device" | "edge" | "cloud"
    compute: Compute
    memory_bytes: int | None = None  # experts' bytes this node may hold (None: use memory_fraction)
    memory_fraction: float | None = None  # of the model's total expert bytes, resolved per model
    utilisation: float = 0.0  # rho in [0, 1) of an M/M/1 queue (0: no queueing)
    service_rate: float | None = None  # mu, calls/s; None: 1 / mean expert call time at this node
    position_m: tuple[float, float] | None = None
    compute_name: str = ""  # catalogue name when the file used one
    description: str = ""

    def capacity_bytes(self, total_expert_bytes: int) -> int:
        """Bytes for experts, resolving memory_fraction against `total_expert_bytes` (cloud: everything)."""
        if self.kind == "cloud":
            return int(total_expert_bytes)
        if self.memory_bytes is not None:
            return int(self.memory_bytes)
        return int(math.floor(self.memory_fraction * total_expert_bytes))


@dataclass(frozen=True)
class Link:
    """One direction of a link."""

    src: str
    dst: str
    latency_s: float
    bandwidth_Bps: float
    medium: str = "wired"  # "wired" | "wireless"


@dataclass(frozen=True)
class User:
    name: str
    home: str  # node where the user's dense part runs
    weight: float  # raw weight or arrival rate; Cluster.user_weight normalises
    domain: str  # a profile domain name, e.g. "wiki"
    arrival_rate: float | None = None  # tokens/s when given in the file


@dataclass(frozen=True, eq=False)
class Cluster:
    """Nodes, directed links and users, plus the all-pairs closure. N nodes, U users."""

    name: str
    nodes: tuple[Node, ...]
    links: tuple[Link, ...]  # directed, as declared (after expanding symmetric links)
    users: tuple[User, ...]
    lat_s: np.ndarray  # [N, N] one-way latency of the shortest-latency path (0 on the diagonal)
    bw_Bps: np.ndarray  # [N, N] bottleneck bandwidth along that path (inf on the diagonal)
    next_hop: np.ndarray  # [N, N] int: first node after i on the path i -> j (j itself if direct)
    description: str = ""
    source: str = ""  # file path or preset name
    _index: dict = field(default_factory=dict, repr=False)

    # -- indices ------------------------------------------------------------------------------------------
    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @property
    def node_kind(self) -> tuple[str, ...]:
        return tuple(n.kind for n in self.nodes)

    @property
    def user_names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.users)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_users(self) -> int:
        return len(self.users)

    @property
    def is_cloud(self) -> np.ndarray:
        """[N] bool."""
        return np.array([n.kind == "cloud" for n in self.nodes])

    @property
    def has_cloud(self) -> bool:
        return bool(self.is_cloud.any())

    def node_index(self, name: str) -> int:
        try:
            return self._index["node"][name]
        except KeyError:
            raise EdgeMoEError(f"cluster {self.name!r}: unknown node {name!r}; known: {list(self.node_names)}") from None

    @property
    def user_home(self) -> np.ndarray:
        """[U] int node index of each user's home."""
        return np.array([self._index["node"][u.home] for u in self.users], dtype=np.int64)

    @property
    def user_weight(self) -> np.ndarray:
        """[U] float, sums to 1 (equal shares if every raw weight is 0)."""
        raw = np.array([u.weight for u in self.users], dtype=float)
        total = raw.sum()
        return raw / total if total > 0 else np.full(len(raw), 1.0 / len(raw))

    def capacity_bytes(self, total_expert_bytes: int) -> np.ndarray:
        """[N] int64 bytes for experts per node, memory_fraction resolved against the model's total."""
        return np.array([n.capacity_bytes(total_expert_bytes) for n in self.nodes], dtype=np.int64)

    def path(self, src: str, dst: str) -> list[str]:
        """Node names along the shortest-latency path src -> dst (both ends included)."""
        i, j = self.node_index(src), self.node_index(dst)
        hops = [i]
        while hops[-1] != j:
            hops.append(int(self.next_hop[hops[-1], j]))
        return [self.nodes[k].name for k in hops]

    def direct_matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """([N, N] latency, [N, N] bandwidth) of declared links only: inf / 0 where there is none."""
        return _direct_matrices(self.nodes, self.links)


# ----------------------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------------------


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _pydantic_error(exc: ValidationError, source: str) -> EdgeMoEError:
    lines = []
    for err in exc.errors():
        if err["type"] == "string_type" and err["loc"][-1] == "str":
            continue  # the mapping branch of a `str | mapping` field reports the real problem
        # Drop pydantic's union-branch tags (e.g. "str", "ComputeIn") so the path reads like the file.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and (p[:1].isupper() or p in {"str", "float", "int"})))
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{_loc(loc) or '(top level)'}: {msg}")
    return EdgeMoEError(f"{source}: invalid cluster file\n  " + "\n  ".join(lines))


def build_cluster(data: dict, source: str = "<dict>") -> Cluster:
    """Validate a cluster description (the parsed file) and build the Cluster with its closure."""
    try:
        spec = ClusterIn.model_validate(data)
    except ValidationError as exc:
        raise _pydantic_error(exc, source) from None
    nodes = tuple(_node(n) for n in spec.nodes)
    names = _unique([n.name for n in nodes], "nodes", source)
    links = _links(spec, nodes, names, source)
    users = _users(spec, names, source)
    # User devices originate and terminate traffic but never relay other nodes' traffic.
    transit = np.array([n.kind != "device" for n in nodes])
    lat, bw, nxt = shortest_paths(*_direct_matrices(nodes, links), transit=transit)
    _check_connected(lat, nodes, source)
    for a in (lat, bw, nxt):
        a.setflags(write=False)
    return Cluster(
        name=spec.name, description=spec.description, nodes=nodes, links=links, users=users,
        lat_s=lat, bw_Bps=bw, next_hop=nxt, source=source,
        _index={"node": names, "user": {u.name: i for i, u in enumerate(users)}},
    )


def _node(n: NodeIn) -> Node:
    if isinstance(n.compute, str):
        compute, compute_name = hardware.lookup(n.compute), n.compute
    else:
        compute = Compute(peak_flops=n.compute.peak_flops, mem_bw_Bps=n.compute.memory_bandwidth,
                          overhead_s=n.compute.overhead)
        compute_name = ""
    return Node(
        name=n.name, kind=n.kind, compute=compute,
        memory_bytes=None if n.memory is None else int(n.memory), memory_fraction=n.memory_fraction,
        utilisation=n.utilisation, service_rate=n.service_rate, position_m=n.position_m,
        compute_name=compute_name, description=n.description,
    )


def _unique(names: list[str], what: str, source: str) -> dict[str, int]:
    index: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in index:
            raise EdgeMoEError(f"{source}: {what}[{i}].name: duplicate name {name!r} (also {what}[{index[name]}])")
        index[name] = i
    return index


def _known(name: str, names: dict[str, int], where: str, source: str) -> None:
    if name not in names:
        raise EdgeMoEError(f"{source}: {where}: unknown node {name!r}; known nodes: {list(names)}")


def _links(spec: ClusterIn, nodes: tuple[Node, ...], names: dict[str, int], source: str) -> tuple[Link, ...]:
    links: list[Link] = []
    for i, link in enumerate(spec.links):
        where = f"links[{i}]"
        _known(link.src, names, f"{where}.src", source)
        _known(link.dst, names, f"{where}.dst", source)
        if link.src == link.dst:
            raise EdgeMoEError(f"{source}: {where}: src and dst are both {link.src!r}; a link joins two nodes")
        links += _expand_link(link, nodes[names[link.src]], nodes[names[link.dst]], where, source)
    if spec.wireless_access is not None:
        links += _wireless_access(spec.wireless_access, nodes, source)
    seen: dict[tuple[str, str], int] = {}
    for k, link in enumerate(links):
        key = (link.src, link.dst)
        if key in seen:
            raise EdgeMoEError(f"{source}: links: {link.src} -> {link.dst} is declared twice "
                               "(a symmetric link already covers the reverse direction)")
        seen[key] = k
    return tuple(links)


def _expand_link(link: LinkIn, src: Node, dst: Node, where: str, source: str) -> list[Link]:
    back_latency = link.latency if link.reverse_latency is None else link.reverse_latency
    if link.wireless is None:
        forward = Link(src.name, dst.name, link.latency, link.bandwidth)
        back_bw = link.bandwidth if link.reverse_bandwidth is None else link.reverse_bandwidth
        backward = Link(dst.name, src.name, back_latency, back_bw)
    else:
        w = link.wireless
        gain = _gain_db(w, src, dst, where, source)
        rate_fwd = _rate(w.bandwidth_hz, w.tx_power_dbm, gain, w.noise_dbm_per_hz, f"{where}.wireless", source)
        rate_back = _rate(w.reverse_bandwidth_hz or w.bandwidth_hz,
                          w.tx_power_dbm if w.reverse_tx_power_dbm is None else w.reverse_tx_power_dbm, gain,
                          w.noise_dbm_per_hz, f"{where}.wireless (reverse)", source)
        forward = Link(src.name, dst.name, link.latency, rate_fwd, "wireless")
        backward = Link(dst.name, src.name, back_latency, rate_back, "wireless")
    return [forward, backward] if link.symmetric else [forward]


def _rate(bandwidth_hz: float, tx_power_dbm: float, gain_db: float, noise_dbm_per_hz: float, where: str,
          source: str) -> float:
    """The Shannon rate (bytes/s) of one direction; a rate that is not a finite positive number (powers or
    gains so extreme that the float arithmetic overflows or underflows) is an error naming the link."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        rate = float(radio.shannon_rate_Bps(bandwidth_hz, tx_power_dbm, gain_db, noise_dbm_per_hz))
    if not math.isfinite(rate) or rate <= 0:
        raise EdgeMoEError(f"{source}: {where}: the Shannon rate of tx power {tx_power_dbm:g} dBm, gain {gain_db:g} dB, "
                           f"noise {noise_dbm_per_hz:g} dBm/Hz over {bandwidth_hz:g} Hz is {rate:g} bytes/s; "
                           "expected a finite positive rate (check the powers and gains)")
    return rate


def _gain_db(w: WirelessIn, src: Node, dst: Node, where: str, source: str) -> float:
    if w.gain_db is not None:
        return w.gain_db
    if w.distance_m is not None:
        return -float(radio.path_loss_db(w.distance_m))
    if src.position_m is None or dst.position_m is None:
        raise EdgeMoEError(f"{source}: {where}.wireless: give gain_db or distance_m, or position_m on both nodes")
    return -float(radio.path_loss_db(math.dist(src.position_m, dst.position_m)))


def _wireless_access(spec: WirelessAccessIn, nodes: tuple[Node, ...], source: str) -> list[Link]:
    devices = [n for n in nodes if n.kind == "device"]
    servers = [n for n in nodes if n.kind == "edge"]
    for n in devices + servers:
        if n.position_m is None:
            raise EdgeMoEError(f"{source}: nodes[{n.name!r}].position_m: wireless_access needs positions "
                               "of every device and edge node")
    links = []
    for dev in devices:
        for srv in servers:
            d = math.dist(dev.position_m, srv.position_m)
            if d > spec.range_m:
                continue
            gain = -float(radio.path_loss_db(d))
            where = f"wireless_access ({dev.name} <-> {srv.name})"
            up = _rate(spec.bandwidth_hz, spec.device_tx_power_dbm, gain, spec.noise_dbm_per_hz, where, source)
            down = _rate(spec.bandwidth_hz, spec.server_tx_power_dbm, gain, spec.noise_dbm_per_hz, where, source)
            links += [Link(dev.name, srv.name, spec.latency, up, "wireless"),
                      Link(srv.name, dev.name, spec.latency, down, "wireless")]
    return links


def _users(spec: ClusterIn, names: dict[str, int], source: str) -> tuple[User, ...]:
    _unique([u.name for u in spec.users], "users", source)
    with_rate = [u.arrival_rate is not None for u in spec.users]
    if any(with_rate) and not all(with_rate):
        raise EdgeMoEError(f"{source}: users: give arrival_rate for every user or for none "
                           f"(users[{with_rate.index(False)}] has none)")
    users = []
    for i, u in enumerate(spec.users):
        _known(u.home, names, f"users[{i}].home", source)
        weight = u.arrival_rate if u.arrival_rate is not None else (1.0 if u.weight is None else u.weight)
        users.append(User(name=u.name, home=u.home, weight=float(weight), domain=u.domain, arrival_rate=u.arrival_rate))
    return tuple(users)


def _direct_matrices(nodes: tuple[Node, ...], links: tuple[Link, ...]) -> tuple[np.ndarray, np.ndarray]:
    index = {n.name: i for i, n in enumerate(nodes)}
    N = len(nodes)
    lat = np.full((N, N), np.inf)
    bw = np.zeros((N, N))
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    for link in links:
        lat[index[link.src], index[link.dst]] = link.latency_s
        bw[index[link.src], index[link.dst]] = link.bandwidth_Bps
    return lat, bw


def shortest_paths(
    lat: np.ndarray, bw: np.ndarray, transit: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Floyd-Warshall closure on one-way latency; bandwidth is the bottleneck along the chosen path.

    lat: [N, N] direct one-way latency (inf: no link, 0 on the diagonal); bw: [N, N] direct bandwidth;
    transit: [N] bool, nodes that may relay traffic (default all). Returns (lat_s [N, N], bw_Bps [N, N],
    next_hop [N, N] int, -1 where unreachable). A detour replaces a path only when strictly faster, so
    direct links win ties. Each pass over an intermediate k is one vectorised [N, N] update, O(N^3) in all.
    """
    lat, bw = lat.astype(float).copy(), bw.astype(float).copy()
    N = lat.shape[0]
    transit = np.ones(N, dtype=bool) if transit is None else np.asarray(transit, dtype=bool)
    nxt = np.where(np.isfinite(lat), np.arange(N)[None, :], -1)
    for k in np.flatnonzero(transit):
        via = lat[:, k, None] + lat[None, k, :]
        better = via < lat
        lat = np.where(better, via, lat)
        bw = np.where(better, np.minimum(bw[:, k, None], bw[None, k, :]), bw)
        nxt = np.where(better, nxt[:, k, None], nxt)
    return lat, bw, nxt


def _check_connected(lat: np.ndarray, nodes: tuple[Node, ...], source: str) -> None:
    src, dst = np.nonzero(~np.isfinite(lat))
    if len(src):
        pairs = ", ".join(f"{nodes[i].name} -> {nodes[j].name}" for i, j in list(zip(src, dst, strict=True))[:5])
        more = f" (and {len(src) - 5} more)" if len(src) > 5 else ""
        raise EdgeMoEError(f"{source}: links: nodes are disconnected, no path for {pairs}{more}; "
                           "every node must reach every other node (add links)")


# ----------------------------------------------------------------------------------------------------------
# Model checks
# ----------------------------------------------------------------------------------------------------------


def validate_for_model(cluster: Cluster, expert_bytes: np.ndarray) -> np.ndarray:
    """Check the cluster can serve a model with experts of `expert_bytes` [L, E]; return capacity [N] int64.

    Without a cloud, the edge servers must hold every expert once. Devices do not count: a device's cache
    serves only its own user (SlimCaching). With equal-sized experts the check counts whole expert slots
    (exact); otherwise it compares bytes (necessary, not sufficient) and that the largest expert fits.
    """
    expert_bytes = np.asarray(expert_bytes, dtype=np.int64)
    if expert_bytes.ndim != 2 or (expert_bytes <= 0).any():
        raise EdgeMoEError(f"expert_bytes must be a [L, E] array of positive sizes, got shape {expert_bytes.shape}")
    total = int(expert_bytes.sum())
    capacity = cluster.capacity_bytes(total)
    if cluster.has_cloud:
        return capacity
    edge = np.array([n.kind == "edge" for n in cluster.nodes])
    need = f"{expert_bytes.size} experts, {total} bytes"
    sizes = np.unique(expert_bytes)
    if len(sizes) == 1:
        slots = int((capacity[edge] // sizes[0]).sum())
        if slots < expert_bytes.size:
            raise EdgeMoEError(
                f"cluster {cluster.name!r}: nodes[*].memory: no cloud, and the edge servers hold {slots} expert "
                f"slots of {int(sizes[0])} bytes, fewer than the model's {need}; total edge memory must be >= "
                f"{total} bytes (or add a cloud node)")
    elif capacity[edge].sum() < total or (edge.any() and capacity[edge].max() < expert_bytes.max()):
        raise EdgeMoEError(
            f"cluster {cluster.name!r}: nodes[*].memory: no cloud, and the edge servers' {int(capacity[edge].sum())} "
            f"bytes cannot hold the model's {need} (largest {int(expert_bytes.max())}); add memory or a cloud node")
    return capacity
