"""Preset clusters (files in edgemoe/assets/clusters/) and a generator of N servers / U users.

Every number in the presets and in the generator's defaults is documented in docs/cluster.md with where it
came from; the generator describes its cluster as a plain dict that goes through the same validation as files.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError

from .schema import Cluster, build_cluster

PRESETS = {"edge8": "edge8.yaml", "device-edge-cloud": "device-edge-cloud.yaml", "testbed8": "testbed8.yaml"}

# The default model's profile domains (the texts it is calibrated on).
DEFAULT_DOMAINS = ("wiki", "gutenberg", "shakespeare", "code")

# (catalogue name, access-link bandwidth bit/s, access one-way latency s) of the GPU classes the generator
# draws from; the same tiers as edge8 (docs/cluster.md, "edge8").
SERVER_TIERS = (
    ("jetson-agx-orin", 50e6, 3e-3),
    ("rtx3090", 100e6, 1e-3),
    ("rtx4090", 200e6, 1e-3),
    ("a100-40gb", 500e6, 0.5e-3),
)
FIBRE_S_PER_KM = 5e-6  # light in fibre travels ~200,000 km/s
ROUTE_INFLATION = 1.5  # internet paths are ~1.5-2x the great-circle distance


def preset_path(name: str) -> Path:
    """Path of the file behind a preset name."""
    if name not in PRESETS:
        raise EdgeMoEError(f"unknown cluster preset {name!r}; presets: {sorted(PRESETS)}")
    return Path(str(resources.files("edgemoe") / "assets" / "clusters" / PRESETS[name]))


def generate(
    num_servers: int,
    num_users: int,
    seed: int = 0,
    *,
    topology: str = "internet",
    copies: float = 1.8,
    with_cloud: bool | None = None,
    domains: tuple[str, ...] = DEFAULT_DOMAINS,
    region_km: float = 2000.0,
    area_m: float = 500.0,
    radio_range_m: float = 300.0,
) -> Cluster:
    """A random cluster for scaling studies (built through the same validation as files).

    topology "internet" (OrderMoE): edge servers drawn from four GPU tiers at random places in a
    region_km square, fully meshed; latency = access delays + distance x 5 us/km x 1.5; bandwidth =
    the slower access link; users homed round-robin on servers. Memory fractions scatter around
    copies / num_servers so all servers together hold about `copies` copies of the model.
    topology "device-edge-cloud" (SlimCaching): servers and one device per user in an area_m square,
    devices reach servers within radio_range_m by Shannon-rate links, servers reach the cloud over a
    20 ms / 1 Gbit/s backhaul. Cloud by default only in this topology.
    """
    return build_cluster(generate_dict(num_servers, num_users, seed, topology=topology, copies=copies,
                                       with_cloud=with_cloud, domains=domains, region_km=region_km,
                                       area_m=area_m, radio_range_m=radio_range_m),
                         source=f"generate({num_servers}, {num_users}, seed={seed}, topology={topology!r})")


def generate_dict(num_servers: int, num_users: int, seed: int = 0, *, topology: str = "internet",
                  copies: float = 1.8, with_cloud: bool | None = None, domains: tuple[str, ...] = DEFAULT_DOMAINS,
                  region_km: float = 2000.0, area_m: float = 500.0, radio_range_m: float = 300.0) -> dict:
    """The cluster-file dict that `generate` builds (write it as YAML to get a reusable file)."""
    if num_servers < 1 or num_users < 1:
        raise EdgeMoEError(f"generate: num_servers and num_users must be >= 1, got {num_servers}, {num_users}")
    if topology not in {"internet", "device-edge-cloud"}:
        raise EdgeMoEError(f"generate: topology must be 'internet' or 'device-edge-cloud', got {topology!r}")
    rng = np.random.default_rng(seed)
    with_cloud = (topology == "device-edge-cloud") if with_cloud is None else with_cloud
    tier = rng.integers(0, len(SERVER_TIERS), size=num_servers)
    fraction = np.clip(copies / num_servers * rng.uniform(0.6, 1.4, size=num_servers), 0.0, 1.0)
    servers = [f"s{i:02d}" for i in range(num_servers)]
    nodes = [{"name": s, "kind": "edge", "compute": SERVER_TIERS[t][0], "memory_fraction": round(float(f), 4)}
             for s, t, f in zip(servers, tier, fraction, strict=True)]
    weights = rng.lognormal(0.0, 0.5, size=num_users)
    if topology == "internet":
        links = _mesh_links(servers, tier, rng.uniform(0, region_km, size=(num_servers, 2)))
        homes = [servers[u % num_servers] for u in range(num_users)]
        wireless = None
    else:
        links, homes, wireless = _device_edge(nodes, num_users, rng, area_m, radio_range_m)
    if topology == "device-edge-cloud" and not with_cloud:
        # No cloud to relay through: join the servers by metro fibre (1 ms, 1 Gbit/s) so all stay reachable.
        links += [{"src": a, "dst": b, "latency": 0.001, "bandwidth": 1e9 / 8}
                  for i, a in enumerate(servers) for b in servers[i + 1:]]
    if with_cloud:
        nodes.append({"name": "cloud", "kind": "cloud", "compute": "h200"})
        links += [{"src": s, "dst": "cloud", "latency": 0.020, "bandwidth": 1e9 / 8} for s in servers]
    users = [{"name": f"u{u:03d}", "home": h, "weight": round(float(w), 4), "domain": domains[u % len(domains)]}
             for u, (h, w) in enumerate(zip(homes, weights, strict=True))]
    out = {"name": f"generated-{topology}-{num_servers}x{num_users}-seed{seed}", "nodes": nodes,
           "links": links, "users": users}
    if wireless is not None:
        out["wireless_access"] = wireless
    return out


def _mesh_links(servers: list[str], tier: np.ndarray, xy_km: np.ndarray) -> list[dict]:
    access_bw = np.array([SERVER_TIERS[t][1] for t in tier]) / 8
    access_lat = np.array([SERVER_TIERS[t][2] for t in tier])
    dist = np.linalg.norm(xy_km[:, None] - xy_km[None], axis=-1)
    lat = access_lat[:, None] + access_lat[None] + dist * FIBRE_S_PER_KM * ROUTE_INFLATION
    bw = np.minimum(access_bw[:, None], access_bw[None])
    n = len(servers)
    return [{"src": servers[i], "dst": servers[j], "latency": round(float(lat[i, j]), 6), "bandwidth": float(bw[i, j])}
            for i in range(n) for j in range(i + 1, n)]


def _device_edge(nodes: list[dict], num_users: int, rng: np.random.Generator, area_m: float,
                 radio_range_m: float) -> tuple[list[dict], list[str], dict]:
    server_xy = rng.uniform(0, area_m, size=(len(nodes), 2))
    for node, xy in zip(nodes, server_xy, strict=True):
        node["position_m"] = [round(float(v), 1) for v in xy]
    device_xy = rng.uniform(0, area_m, size=(num_users, 2))
    # Every device must reach a server: put a device that reaches none next to its nearest server.
    dist = np.linalg.norm(device_xy[:, None] - server_xy[None], axis=-1)
    lonely = dist.min(axis=1) > radio_range_m
    nearest = server_xy[dist.argmin(axis=1)]
    device_xy[lonely] = nearest[lonely] + 0.5 * radio_range_m * (device_xy[lonely] - nearest[lonely]) / dist.min(axis=1)[lonely, None]
    homes = [f"d{u:03d}" for u in range(num_users)]
    for name, xy in zip(homes, device_xy, strict=True):
        nodes.append({"name": name, "kind": "device", "compute": "phone-soc", "memory_fraction": 0.05,
                      "position_m": [round(float(v), 1) for v in xy]})
    wireless = {"range_m": radio_range_m, "latency": 0.004, "bandwidth_hz": 10e6,
                "device_tx_power_dbm": 23.0, "server_tx_power_dbm": 43.0, "noise_dbm_per_hz": -174.0}
    return [], homes, wireless
