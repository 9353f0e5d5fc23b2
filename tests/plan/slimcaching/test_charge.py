"""SlimCaching's load-aware variant (remote-call charge): the paper's objective is untouched at charge 0, the
gain tables' additive part against a direct computation, the charge bookkeeping, the home-load factor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan
from edgemoe.plan.base import empty_hosts
from edgemoe.plan.objective import (
    charge_per_user,
    charged_model,
    charged_objective,
    expert_latency,
    home_load_factor,
    latency_per_user_from_tau,
    node_charge,
    serving_charge,
    slim_model,
)
from edgemoe.plan.slimcaching.values import set_gains
from edgemoe.plan.synthetic import synthetic_problem

SMALL = dict(num_servers=3, num_users=6, num_layers=2, num_experts=5, slots_per_server=4, num_tokens=400)


def test_zero_charge_is_the_paper_model_and_placement():
    problem = synthetic_problem(seed=1, **SMALL)
    model = slim_model(problem)
    assert charged_model(model, problem, 0.0) is model
    paper = plan(problem, "slimcaching")
    zero = plan(problem, "slimcaching", remote_charge=0.0)
    assert np.array_equal(paper.hosts, zero.hosts)
    assert zero.params["charged_objective_s"] == pytest.approx(zero.params["objective_s"])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "busy", [1.0, 2.0]])
def test_bad_charge_is_a_clear_error(bad):
    problem = synthetic_problem(seed=0, **SMALL)
    with pytest.raises(EdgeMoEError, match="remote_charge"):
        plan(problem, "slimcaching", remote_charge=bad)


def test_serving_charge_follows_the_fastest_holder():
    """The charge of a call is the charge of the server expert_latency picks; home and cloud cost none."""
    problem = synthetic_problem(seed=2, **SMALL)
    model = charged_model(slim_model(problem), problem, 1.5)
    rng = np.random.default_rng(0)
    hosts = rng.random(empty_hosts(problem).shape) < 0.4
    tau, chg = expert_latency(model, hosts), serving_charge(model, hosts)
    home = np.asarray(problem.user_home)
    for u, layer, e in itertools.product(range(model.num_users), range(2), range(5)):
        options = [(model.base_call[u, layer, e], 0.0)]
        for j, n in enumerate(model.edge_nodes):
            if hosts[n, layer, e]:
                expected = 0.0 if n == home[u] else 1.5 * problem.compute_s[n, layer, e]
                options.append((model.edge_call[u, j, layer, e], expected))
        best = min(range(len(options)), key=lambda i: (options[i][0], i))
        assert tau[u, layer, e] == pytest.approx(options[best][0])
        assert chg[u, layer, e] == pytest.approx(options[best][1])
    total = charged_objective(model, tau, chg)
    direct = model.weight @ (latency_per_user_from_tau(model, tau) + charge_per_user(model, chg))
    assert total == pytest.approx(direct)


def test_gain_table_adds_the_credited_charge():
    """G with charges = G of the paper + sum over the masked members of mass x max(charge now - on node, 0)."""
    problem = synthetic_problem(seed=3, **SMALL)
    model = charged_model(slim_model(problem), problem, 2.0)
    node = int(model.edge_nodes[1])
    hosts = empty_hosts(problem)
    hosts[model.edge_nodes[0], :, :3] = True
    users = np.arange(model.num_users)
    tau, chg = expert_latency(model, hosts), serving_charge(model, hosts)
    call, call_chg = model.node_call(node), node_charge(model, node, users)
    layer, sets = 0, model.layers[0].sets
    prob, weight = model.user_set_prob(layer), model.weight
    plain = set_gains(tau[:, layer], call[:, layer], prob, weight, sets)
    charged = set_gains(tau[:, layer], call[:, layer], prob, weight, sets, chg[:, layer], call_chg[:, layer])
    assert np.array_equal(plain.candidates, charged.candidates)
    K = sets.shape[1]
    useful = np.flatnonzero((plain.cand_pos >= 0).any(axis=1))
    assert useful.size == plain.gain.shape[0]
    pad = lambda a: np.concatenate([a, np.zeros((a.shape[0], 1))], axis=1)  # noqa: E731
    tau_p, call_p, chg_p, cc_p = (pad(a[:, layer]) for a in (tau, call, chg, call_chg))
    for row, m in enumerate(np.flatnonzero(((pad(call[:, layer]) < tau_p)[:, sets]).any(axis=(0, 2)))):
        for mask in range(2**K):
            extra = 0.0
            for u in users:
                mass = prob[u, m] * weight[u]
                for k in range(K):
                    e = sets[m, k]
                    if mask >> k & 1 and call_p[u, e] < tau_p[u, e]:
                        extra += mass * max(chg_p[u, e] - cc_p[u, e], 0.0)
            assert charged.gain[row, mask] == pytest.approx(plain.gain[row, mask] + extra, rel=1e-9, abs=1e-15)


def test_home_load_factor():
    """rho = demand homed at the node / the largest, capped at 0.9; factor rho / (1 - rho)."""
    problem = synthetic_problem(seed=0, **SMALL)  # six users round-robin over three edge servers
    weight = np.asarray(problem.user_weight)
    demand = np.bincount(problem.user_home, weight, minlength=len(problem.node_kind))
    rho = np.minimum(0.9, demand / demand.max())
    assert np.allclose(home_load_factor(problem), rho / (1 - rho))
    assert home_load_factor(problem).max() == pytest.approx(9.0)


def test_home_load_placement_is_valid_and_reports_both_objectives():
    problem = synthetic_problem(seed=4, **{**SMALL, "num_layers": 3})
    pl = plan(problem, "slimcaching", remote_charge="home-load", passes=3)
    pl.check_capacity()
    assert pl.params["charged_objective_s"] >= pl.params["objective_s"] - 1e-15
    again = plan(problem, "slimcaching", remote_charge="home-load", passes=3)
    assert np.array_equal(pl.hosts, again.hosts)  # deterministic
