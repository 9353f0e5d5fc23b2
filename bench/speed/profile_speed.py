"""Profiling speed on the default model: tokens per second of `edgemoe profile`'s collection step.

Writes bench/results/profile_speed.json and prints a table. Target: 50k tokens in under 2 minutes.
    python -m bench.speed.profile_speed [--tokens 50000]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from bench.common import environment
from edgemoe.data import shared_corpus, stdlib_code
from edgemoe.io import atomic_write_json
from edgemoe.models import load_moe, load_tokenizer
from edgemoe.profile.collect import collect_profile, profile_blocks_for

OUT = Path(__file__).resolve().parents[1] / "results" / "profile_speed.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=50_000)
    args = ap.parse_args()
    adapter, tok = load_moe("default"), load_tokenizer("default")
    shared = Path(__file__).resolve().parents[3] / "shared" / "data"
    # The shared corpus' held-out split (four domains) when present, else the stdlib sources alone.
    sources = shared_corpus(shared, "heldout") if shared.is_dir() else [stdlib_code()]
    blocks = profile_blocks_for(sources, tok, args.tokens, 256)
    t0 = time.perf_counter()
    prof = collect_profile(adapter, blocks, "default", sources[0].name, progress=False)
    seconds = time.perf_counter() - t0
    result = {
        "what": "edgemoe profile collection on the default model (router sample, statistics, substitution error)",
        "command": f"python -m bench.speed.profile_speed --tokens {args.tokens}",
        "tokens": prof.num_tokens,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(prof.num_tokens / seconds, 1),
        "target": "50k tokens in under 120 s",
        "seconds_per_50k_tokens": round(seconds * 50_000 / prof.num_tokens, 2),
        "met": bool(seconds * 50_000 / prof.num_tokens < 120),
        "environment": {**environment(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "cpu_count": os.cpu_count()},
    }
    atomic_write_json(OUT, result)
    print(f"{'tokens':>8} {'seconds':>8} {'tok/s':>8} target met")
    print(f"{result['tokens']:>8} {result['seconds']:>8} {result['tokens_per_second']:>8} {result['met']}")


if __name__ == "__main__":
    main()
