"""The quality dial of a served deployment (issue 19, section 3): a request states quality as
`max_ppl_increase` (a maximum relative perplexity increase) and the server turns it into the request's budget.

`edgemoe dial` calibrates the dial of one deployment and writes a dial file (`edgemoe.eval.dial.save_dial`);
`edgemoe serve --dial FILE` (and `edgemoe generate --dial FILE`) reads it, checks that it was calibrated on this
deployment (`check_identity`) and maps each request's `max_ppl_increase` with it (`QualityDial.budget`).

Why it is calibrated as the server runs, not as the study's per-budget policies: every request of a deployment
shares one policy, whose quality price and budget grid come from the deployment's `budget` parameter, and a
request's own budget is set on its rows after `start`, capped at the deployment's (`edgemoe.serve.engine`). So
each grid point here is a fresh policy built exactly as the server builds it, scored on blocks of calibration
text whose rows get the grid point as their own budget (`score_local(row_allowance=)`). The grid is fractions
of the deployment's budget (`DIAL_FRACTIONS`): a request can never be granted more. Assumption, as in
`edgemoe.eval.dial`: the dial aims at the point estimate on the calibration text, so the increase on other text
scatters around the asked value; the calibration text should look like what the server will be sent.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.eval.dial import QualityDial, calibrate_dial

# grid budgets as shares of the deployment's budget, spread over three orders of magnitude: a deployment budget is
# set for its largest asked value, and the small ones (+1%) sit at a thousandth of it (with 2 nats per token-layer:
# 0.002 ... 2, the study's calibrated grid)
DIAL_FRACTIONS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
DIAL_REFINE = 4  # extra grid points at the calibration curve's sharpest turns (calibrate_dial(refine=))
DIAL_TOKENS = 4096  # calibration tokens of `edgemoe dial` (the study's dial uses 8192: fewer to fit a start-up)


def identity(dep) -> dict:
    """What a dial file must match to be used on the deployment `dep` (edgemoe.serve.setup.Deployment): the
    model's weights (`checkpoint_digest` of its files and the dtype it computes in), the cluster, the placement
    (a digest of which experts each node hosts), the mode, the policy and its parameters (the budget among
    them), all as strict JSON values."""
    from edgemoe.models import checkpoint_digest

    spec = dep.spec
    return _identity(dep.ctx, checkpoint_digest(spec.model, dep.adapter.compute_dtype), spec.mode, spec.policy,
                     spec.params)


def ray_identity(cfg) -> dict:
    """`identity` of a Ray deployment (edgemoe.distributed.server.ServerConfig): the same fields, the weights
    named from the checkpoint's files and the servers' dtype, so that a dial calibrated in-process on the same
    model, cluster, placement, mode and policy is accepted by the Ray server and no other. Nothing is loaded: the
    front process of a Ray deployment never holds the model."""
    from edgemoe.models import checkpoint_digest

    return _identity(cfg.ctx, checkpoint_digest(cfg.model_path, cfg.torch_dtype()), cfg.ctx.mode, cfg.policy,
                     cfg.params)


def _identity(ctx, weights_hash: str, mode: str, policy: str, params) -> dict:
    from edgemoe.io import jsonable

    hosts = hashlib.sha256(np.ascontiguousarray(ctx.hosts, dtype=bool).tobytes()).hexdigest()[:16]
    ident = {"weights": weights_hash[:16], "cluster": ctx.cluster_name, "placement": hosts, "mode": mode,
             "policy": policy, "policy_params": dict(params)}
    return json.loads(json.dumps(jsonable(ident)))


def check_identity(found: dict, want: dict, path) -> None:
    """Raise an EdgeMoEError naming every field where the dial file's deployment `found` differs from this
    server's `want` (`identity` / `ray_identity`)."""
    diff = [k for k in want if found.get(k) != want[k]]
    if diff:
        parts = "; ".join(f"{k}: file {found.get(k)!r}, this server {want[k]!r}" for k in diff)
        raise EdgeMoEError(f"--dial {path}: calibrated on another deployment ({parts}); run `edgemoe dial` with "
                           "this server's options")


def deployment_budget(policy) -> float:
    """The deployment's budget per token-layer (its policy's largest allowance): the most a request is granted."""
    top = float(np.max(policy.allowance)) if policy.name != "exact" else 0.0
    if not top > 0:
        raise EdgeMoEError(f"a quality dial needs a policy with a budget > 0 (got policy {policy.name!r} with budget "
                           f"{top:g}): a request is never granted more than the deployment's budget")
    return top


def calibrate_serving_dial(dep, data, tokens: int = DIAL_TOKENS, fractions=DIAL_FRACTIONS,
                           refine: int = DIAL_REFINE, log=lambda _m: None) -> QualityDial:
    """The dial of deployment `dep` on the first `tokens` tokens of the text `data` (an edgemoe.data spec, or a
    list of its TextSources), cut into the deployment's blocks; every block's rows are a request of user (block
    index mod users)."""
    from edgemoe.data import resolve, tokenize_blocks
    from edgemoe.models.scoring import token_scores
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.local import score_local

    spec = dep.spec
    top = deployment_budget(make_policy(spec.policy, dep.ctx, **spec.params))
    fr = np.asarray(fractions, dtype=float)
    if fr.ndim != 1 or len(fr) == 0 or not ((fr > 0) & (fr <= 1)).all():
        raise EdgeMoEError(f"dial: fractions must be shares of the deployment's budget in (0, 1], got {fractions}")
    block = dep.spec.block_len
    sources = resolve(data) if isinstance(data, str) else list(data)
    ids = tokenize_blocks(sources, dep.tokenizer, block, max_tokens_per_source=tokens).ids[: max(1, tokens // block)]
    if len(ids) == 0:
        raise EdgeMoEError(f"dial: the text {data!r} gave no block of {block} tokens")
    exact = token_scores(dep.adapter, ids)[0].astype(np.float64)
    users = np.arange(len(ids)) % dep.ctx.num_users

    def rise_at(budget: float) -> float:
        policy = make_policy(spec.policy, dep.ctx, **spec.params)  # fresh: no adaptive state carried over
        nll = score_local(dep.adapter, policy, ids, users, row_allowance=np.full(len(ids), budget))[0]
        rise = float(np.expm1((nll.astype(np.float64) - exact).mean()))
        log(f"  budget {budget:.4g}: {100 * rise:+.2f}% perplexity on {ids.size} calibration tokens")
        return rise

    return calibrate_dial(rise_at, top * fr, policy=spec.policy, calib_tokens=int(ids.size), curve="isotonic",
                          refine=refine, up_to=0.3)

