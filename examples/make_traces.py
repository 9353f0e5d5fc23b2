"""Regenerate the two example routing traces in examples/traces/ (docs/traces.md).

    python examples/make_traces.py [--shared-data ../shared/data]

1. default-model.jsonl.gz: the packaged tiny model (Mixtral format, 4 MoE layers x 16 experts, top-2) run
   with transformers' `output_router_logits=True` on 12 short passages of two domains (Python sources and
   pydoc topics, from the Python standard library), logged by `log_hf_routing` below - the same code as
   the snippet in docs/traces.md. Carries router logits and a domain per token.
2. mixtral-calibrated.jsonl.gz: Mixtral-8x7B dimensions, 240 tokens (12 requests of 20) drawn from the
   routing generator calibrated on the real Mixtral-8x7B expert counts in
   ../shared/data/routing/real_expert_counts.json (edgemoe.profile.calibrated). No router logits and no
   domain: the profile then takes similarity from co-selection and one domain. Needs ../shared/data.

3. default-model.vllm.jsonl and default-model.llamacpp.csv: a few tokens of (1) re-written in the
   formats vLLM and llama.cpp export (docs/traces.md, "Traces from vLLM and llama.cpp"): 3 requests x 8
   tokens as routed_experts arrays, and one request as a 6-token prompt micro-batch then 3 decode steps.

The files are written byte-for-byte reproducibly (fixed seeds, gzip mtime 0).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent / "traces"


def log_hf_routing(model, input_ids, req_ids, domains, out, model_name: str) -> None:
    """Write one `route` line per token and MoE layer of a transformers MoE model's forward pass.

    input_ids: [B, S] LongTensor; req_ids, domains: [B] strings. Mixtral-style routing: softmax over the
    experts, top-K, renormalised over the K (use the model's own rule for other families).
    """
    import torch

    k = model.config.num_experts_per_tok
    with torch.no_grad():
        outputs = model(input_ids, output_router_logits=True)
    B, S = input_ids.shape
    with open(out, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
        f.write((json.dumps({"type": "meta", "model": model_name}) + "\n").encode())
        for b in range(B):
            for t in range(S):
                for layer, logits in enumerate(outputs.router_logits):  # one [B*S, E] tensor per MoE layer
                    row = logits.view(B, S, -1)[b, t].float()
                    w, ids = torch.softmax(row, dim=-1).topk(k)
                    f.write((json.dumps({
                        "type": "route", "req_id": req_ids[b], "token_idx": t, "layer": layer,
                        "topk_ids": ids.tolist(), "topk_weights": [round(x, 4) for x in (w / w.sum()).tolist()],
                        "router_logits": [round(x, 4) for x in row.tolist()], "domain": domains[b],
                    }, separators=(",", ":")) + "\n").encode())


def default_model_trace(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgemoe.data.sources import offline_default
    from edgemoe.models.loader import default_model_path

    folder = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    passages, domains = [], []
    for source in offline_default("heldout"):
        for _, text in source.docs[:6]:
            passages.append(tok(text[:2000])["input_ids"][:32])
            domains.append(source.domain)
    ids = torch.tensor(passages)
    log_hf_routing(model, ids, [f"req-{i:02d}" for i in range(len(passages))], domains, path, "edgemoe default model")


def calibrated_trace(path: Path, shared: Path) -> None:
    import numpy as np

    from edgemoe.profile.calibrated import RoutingModel, load_real_counts
    from edgemoe.profile.specs import model_spec
    from edgemoe.profile.trace import write_trace

    spec = model_spec("mixtral-8x7b")
    gen = RoutingModel(spec, load_real_counts(shared / "routing" / "real_expert_counts.json", "mixtral"), seed=0)
    r = gen.draw(48, seed=7)  # 48 tokens of each of the 5 domains
    rng = np.random.default_rng(7)
    order = np.concatenate([rng.permutation(np.flatnonzero(r.domain == d))[:48] for d in range(5)])
    req = [f"chat-{i // 20:02d}" for i in range(order.size)]  # 12 requests of 20 tokens
    write_trace(path, r.topk[order], r.gates[order], spec.moe_layer_ids, req, np.arange(order.size) % 20,
                model=spec.hf_id)


def foreign_traces(source: Path, vllm_path: Path, csv_path: Path) -> None:
    """Re-write the first tokens of the default model's trace as vLLM routed_experts JSONL and llama.cpp CSV."""
    from edgemoe.io import atomic_write_text
    from edgemoe.models.loader import default_model_path
    from edgemoe.profile.trace import read_trace

    tr = read_trace([source], str(default_model_path() / "config.json"))
    per_req = 32  # tokens per request in default-model.jsonl.gz, in request order
    lines = [json.dumps({"req_id": f"req-{r:02d}", "routed_experts": tr.topk[r * per_req:r * per_req + 8].tolist()},
                        separators=(",", ":")) for r in range(3)]
    atomic_write_text(vllm_path, "\n".join(lines) + "\n")
    rows = ["layer,expert"]
    steps = [range(0, 6), range(6, 7), range(7, 8), range(8, 9)]  # a prompt micro-batch, then one token per step
    for step in steps:
        for j, layer in enumerate(tr.layer_ids):
            rows += [f"{layer},{e}" for t in step for e in tr.topk[t, j]]
    atomic_write_text(csv_path, "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared-data", type=Path, default=Path("../shared/data"))
    args = ap.parse_args()
    HERE.mkdir(parents=True, exist_ok=True)
    default_model_trace(HERE / "default-model.jsonl.gz")
    calibrated_trace(HERE / "mixtral-calibrated.jsonl.gz", args.shared_data)
    foreign_traces(HERE / "default-model.jsonl.gz", HERE / "default-model.vllm.jsonl", HERE / "default-model.llamacpp.csv")
    for p in sorted(HERE.glob("default-model*")):
        print(f"wrote {p} ({p.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
