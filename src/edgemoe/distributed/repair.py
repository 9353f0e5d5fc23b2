"""Re-route slots whose server is gone: a live replica, else a live substitute, else drop (pure numpy).

Used for calls that failed in flight and as a check on every decision (a policy built before a failure
was noticed may still name the dead server). The policy itself is rebuilt on a `degraded_context`
whenever membership changes, so later decisions plan around the hole.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from edgemoe.runtime.context import RuntimeContext, best_local_substitutes


def degraded_context(ctx: RuntimeContext, alive: np.ndarray) -> RuntimeContext:
    """`ctx` as if the servers with alive [N] False held nothing and served no one."""
    hosts = ctx.hosts.copy()
    hosts[~alive] = False
    usable = ctx.usable.copy()
    usable[:, ~alive] = False
    best_sub, best_err = best_local_substitutes(hosts, ctx.groups.substitute_ids, ctx.subst_err)
    for a in (hosts, usable, best_sub, best_err):
        a.setflags(write=False)
    return replace(ctx, hosts=hosts, usable=usable, best_sub=best_sub, best_sub_err=best_err)


def repair_slots(ctx: RuntimeContext, layer: int, experts: np.ndarray, node: np.ndarray, location: np.ndarray,
                 users: np.ndarray, alive: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Fix slots experts/node [T, K] whose node is dead or lacks the expert.

    A broken slot goes to the live usable replica with the shortest round trip from the token's node
    location [T]; without one, to the best-ranked substitute (the similarity groups' order) that some
    live usable node holds; without one, it is dropped (-1). Returns (experts, node, slots changed).
    """
    experts, node = experts.copy(), node.copy()
    ran = node >= 0
    ok = np.zeros_like(ran)
    ok[ran] = alive[node[ran]] & ctx.hosts[node[ran], layer, experts[ran]]
    broken = np.argwhere(ran & ~ok)
    live_hosts = ctx.hosts[:, layer, :] & alive[:, None]  # [N, E]
    rtt = ctx.round_trip_s
    subs = ctx.groups.substitute_ids[layer]  # [E, S]
    for t, k in broken:
        can = ctx.usable[users[t]] & alive  # [N]
        for cand in (experts[t, k], *[s for s in subs[experts[t, k]] if s >= 0]):
            where = live_hosts[:, cand] & can
            if where.any():
                cost = np.where(where, rtt[location[t]], np.inf)
                experts[t, k], node[t, k] = cand, int(cost.argmin())
                break
        else:
            experts[t, k], node[t, k] = -1, -1
    return experts, node, len(broken)
