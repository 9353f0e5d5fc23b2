"""Several MoE models sharing the cluster's storage, as one PlanProblem (SlimCaching's multi-model case).

Decision: the models are concatenated along the layer axis. Model m's layers become layers
[offset_m, offset_m + L_m) of one problem; each user runs exactly one model. A token of model m has
expert id -1 ("no expert") at every other model's layer, so it costs nothing there, and its user's
frequencies there are zero. Every planner then sees one problem whose per-node knapsack spans all
models' experts: storage is shared, and no planner needs to know about models. Requirements: the
problems describe the same nodes and users (names, kinds, capacities, homes, weights). K may differ (the
shorter Top-K rows are padded with -1) and so may E: a model with fewer experts per layer is padded to
the largest E with *padding experts* of 0 bytes that no token routes to. They cost no memory and are
worth nothing, so no planner's choice changes; coverage gives them a free copy; `make_placement` drops
them (params["experts_per_layer"] [L] says how many experts each layer really has).
Each user's comm_s row is taken from its own model's problem (hidden-state sizes may differ).

Uplink model (documented, not a new term): a user's K parallel calls of one layer each ship the hidden
state; comm_s[u, n] is the round trip of one call, and the layer costs the max over its calls. We assume
per-call channels (the K uploads do not queue behind each other on the user's uplink). Sharing the
uplink would add (number of remote calls - 1) x the upload time to a layer; with the hidden state at
4-16 kB and the per-call compute and backhaul dominating, that term is small, and it is left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.profile.store import Profile, ProfileMeta

from ..base import PlanProblem


def _check_same_cluster(problems: Sequence[PlanProblem]) -> None:
    first = problems[0]
    for i, p in enumerate(problems[1:], start=1):
        for name in ("node_names", "node_kind", "user_names"):
            if getattr(p, name) != getattr(first, name):
                raise EdgeMoEError(f"combine_models: problems[{i}].{name} differs from problems[0].{name}")
        for name in ("user_home", "user_weight"):
            if not np.array_equal(getattr(p, name), getattr(first, name)):
                raise EdgeMoEError(f"combine_models: problems[{i}].{name} differs from problems[0].{name}")
        caches = ~first.is_cloud  # a cloud's capacity is ignored (it holds everything)
        if not np.array_equal(p.capacity_bytes[caches], first.capacity_bytes[caches]):
            raise EdgeMoEError(f"combine_models: problems[{i}].capacity_bytes differs from problems[0].capacity_bytes")



def _block_diag_tokens(profiles: Sequence[Profile], field: str, fill, dtype, K: int) -> np.ndarray:
    """[T_total, L_total, K] per-token arrays, model m's tokens on its own layers, `fill` elsewhere."""
    T = sum(p.num_tokens for p in profiles)
    L = sum(p.L for p in profiles)
    out = np.full((T, L, K), fill, dtype=dtype)
    t0 = l0 = 0
    for p in profiles:
        arr = getattr(p, field)
        out[t0:t0 + p.num_tokens, l0:l0 + p.L, : arr.shape[2]] = arr
        t0, l0 = t0 + p.num_tokens, l0 + p.L
    return out


def _pad(arr: np.ndarray, axes: tuple[int, ...], E: int, fill) -> np.ndarray:
    """arr with each of `axes` padded at the end to length E with `fill`."""
    widths = [(0, E - arr.shape[a]) if a in axes else (0, 0) for a in range(arr.ndim)]
    return np.pad(arr, widths, constant_values=fill)


def pad_experts(profile: Profile, E: int) -> Profile:
    """`profile` with E experts per layer: the added ones have 0 bytes, 0 FLOPs and are never routed to."""
    if profile.E == E:
        return profile
    from dataclasses import replace

    p = profile
    return replace(
        p, meta=replace(p.meta, num_experts=E),
        router_logits=_pad(p.router_logits, (2,), E, 0.0), freq=_pad(p.freq, (1,), E, 0.0),
        freq_by_domain=_pad(p.freq_by_domain, (2,), E, 0.0), coact=_pad(p.coact, (1, 2), E, 0),
        trans=_pad(p.trans, (1, 2), E, 0.0), sim=_pad(p.sim, (1, 2), E, 0.0),
        subst_err=_pad(p.subst_err, (1, 2), E, 2.0), expert_bytes=_pad(p.expert_bytes, (1,), E, 0),
        expert_flops=_pad(p.expert_flops, (1,), E, 0),
    )


def combine_profiles(profiles: Sequence[Profile], names: Sequence[str]) -> Profile:
    """One profile whose layers are the models' layers in order and whose domains are "name:domain"."""
    E = max(p.E for p in profiles)
    profiles = [pad_experts(p, E) for p in profiles]
    K = max(p.K for p in profiles)
    L = sum(p.L for p in profiles)
    topk = _block_diag_tokens(profiles, "topk", -1, np.int16, K)
    gates = _block_diag_tokens(profiles, "gates", 0.0, np.float32, K)
    domain_offset = np.cumsum([0] + [len(p.meta.domains) for p in profiles])
    domain = np.concatenate([p.domain.astype(np.int64) + off for p, off in zip(profiles, domain_offset, strict=False)])
    freq_by_domain = np.zeros((domain_offset[-1], L, E))
    l0 = 0
    for p, off in zip(profiles, domain_offset, strict=False):
        freq_by_domain[off:off + len(p.meta.domains), l0:l0 + p.L] = p.freq_by_domain
        l0 += p.L
    trans = np.zeros((max(L - 1, 0), E, E))
    l0 = 0
    for p in profiles:
        trans[l0:l0 + p.L - 1] = p.trans  # the boundary between two models stays zero
        l0 += p.L
    cat = lambda field: np.concatenate([getattr(p, field) for p in profiles], axis=0)  # noqa: E731
    meta = ProfileMeta(
        model="+".join(names), family="multi", weights_hash="+".join(p.meta.weights_hash for p in profiles),
        num_layers=L, num_experts=E, top_k=K, hidden_size=max(p.meta.hidden_size for p in profiles),
        hidden_bytes=max(p.hidden_bytes for p in profiles), wire_dtype=profiles[0].meta.wire_dtype,
        moe_layer_ids=list(range(L)),
        domains=[f"{n}:{d}" for n, p in zip(names, profiles, strict=True) for d in p.meta.domains],
        data="; ".join(p.meta.data for p in profiles), num_tokens=int(topk.shape[0]),
    )
    return Profile(
        meta=meta, router_logits=np.zeros((topk.shape[0], L, E), np.float16), topk=topk, gates=gates,
        domain=domain.astype(np.int16), freq=cat("freq"), freq_by_domain=freq_by_domain, coact=cat("coact"),
        trans=trans, sim=cat("sim"), subst_err=cat("subst_err"), expert_bytes=cat("expert_bytes"),
        expert_flops=cat("expert_flops"),
    )


def combine_models(problems: Sequence[PlanProblem], user_model: np.ndarray,
                   names: Sequence[str] | None = None) -> PlanProblem:
    """One PlanProblem for several models sharing storage. user_model: [U] model index of each user.

    Returns a problem with L = sum L_m layers; params["layer_model"] [L] and params["user_model"] [U]
    say which model each layer and user belongs to.
    """
    if not problems:
        raise EdgeMoEError("combine_models: need at least one problem")
    _check_same_cluster(problems)
    user_model = np.asarray(user_model, dtype=np.int64)
    U = len(problems[0].user_names)
    if user_model.shape != (U,) or user_model.min() < 0 or user_model.max() >= len(problems):
        raise EdgeMoEError(f"combine_models: user_model must be [{U}] ints in [0, {len(problems)})")
    names = list(names) if names else [f"model{m}" for m in range(len(problems))]
    profile = combine_profiles([p.profile for p in problems], names)
    domain_offset = np.cumsum([0] + [len(p.profile.meta.domains) for p in problems])
    users = np.arange(U)
    user_domain = np.array([problems[m].user_domain[u] + domain_offset[m] for u, m in zip(users, user_model, strict=True)])
    comm = np.stack([problems[m].comm_s[u] for u, m in zip(users, user_model, strict=True)])
    layer_model = np.concatenate([np.full(p.profile.L, m) for m, p in enumerate(problems)])
    E = profile.E
    experts_per_layer = np.concatenate([np.full(p.profile.L, p.profile.E) for p in problems])
    first = problems[0]
    return PlanProblem(
        profile=profile, node_names=first.node_names, node_kind=first.node_kind,
        capacity_bytes=first.capacity_bytes, user_names=first.user_names, user_home=first.user_home,
        user_weight=first.user_weight, user_domain=user_domain.astype(np.int64), comm_s=comm,
        compute_s=np.concatenate([_pad(p.compute_s, (2,), E, 0.0) for p in problems], axis=1),
        expert_bytes=np.concatenate([_pad(p.expert_bytes, (1,), E, 0) for p in problems], axis=0),
        params={"models": names, "layer_model": layer_model.tolist(), "user_model": user_model.tolist(),
                "experts_per_layer": experts_per_layer.tolist()},
    )
