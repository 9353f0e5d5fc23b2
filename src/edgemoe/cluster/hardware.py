"""Named compute specs a cluster file can refer to (`compute: rtx4090`), with where each number came from.

`peak_flops` is the dense 16-bit tensor-core rate with FP32 accumulation (what PyTorch uses for bf16/fp16
matmuls), `mem_bw_Bps` the DRAM bandwidth from the vendor's spec sheet, `overhead_s` the fixed cost of
one expert call (PyTorch eager: three GEMMs plus an activation, host-dispatch bound). Overheads are the
least certain numbers here: the H200 figure is measured (../shared/data/measured/h200_expert_latency.json,
the smallest bf16 batch-1 call minus its weight-streaming time); the others are assumptions stated beside them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Compute:
    """Roofline parameters of one node: time of a call = overhead + max(flops / peak, bytes / bandwidth)."""

    peak_flops: float  # FLOP/s at the model's dtype
    mem_bw_Bps: float  # bytes/s from memory to the compute units
    overhead_s: float = 0.0  # fixed seconds per expert call (launch/dispatch)


# Eager PyTorch dispatch is host-bound, so on x86 hosts the overhead barely depends on the GPU: we reuse
# the H200 measurement (75 us) for every discrete GPU. Jetson's ARM Cortex-A78AE host is assumed 2x slower
# and a phone SoC 4x slower (assumptions, not measured).
CATALOGUE: dict[str, tuple[Compute, str]] = {
    "jetson-agx-orin": (
        Compute(peak_flops=42.5e12, mem_bw_Bps=204.8e9, overhead_s=150e-6),
        "NVIDIA Jetson AGX Orin 64GB datasheet: GPU 170 sparse INT8 TOPS -> 85 dense INT8 -> 42.5 dense FP16 "
        "TFLOPS; LPDDR5 204.8 GB/s. Overhead: 2x the H200 host figure (ARM host, assumption).",
    ),
    "rtx3090": (
        Compute(peak_flops=71e12, mem_bw_Bps=936e9, overhead_s=75e-6),
        "NVIDIA Ampere GA102 whitepaper: RTX 3090 FP16/BF16 tensor, FP32 accumulate, dense 71 TFLOPS; "
        "GDDR6X 936 GB/s. Overhead: H200 measurement reused (x86 host).",
    ),
    "rtx4090": (
        Compute(peak_flops=165.2e12, mem_bw_Bps=1008e9, overhead_s=75e-6),
        "NVIDIA Ada Lovelace whitepaper: RTX 4090 FP16/BF16 tensor, FP32 accumulate, dense 165.2 TFLOPS; "
        "GDDR6X 1008 GB/s. Overhead: H200 measurement reused (x86 host).",
    ),
    "a100-40gb": (
        Compute(peak_flops=312e12, mem_bw_Bps=1555e9, overhead_s=75e-6),
        "NVIDIA A100 datasheet (40GB PCIe): BF16 tensor dense 312 TFLOPS; HBM2 1555 GB/s. "
        "Overhead: H200 measurement reused (x86 host).",
    ),
    "l4": (
        Compute(peak_flops=121e12, mem_bw_Bps=300e9, overhead_s=75e-6),
        "NVIDIA L4 datasheet: FP16/BF16 tensor 242 TFLOPS with sparsity -> 121 dense; GDDR6 300 GB/s. "
        "Overhead: H200 measurement reused (x86 host).",
    ),
    "h200": (
        Compute(peak_flops=989e12, mem_bw_Bps=4.8e12, overhead_s=75e-6),
        "NVIDIA H200 SXM datasheet: BF16 tensor 1979 TFLOPS with sparsity -> 989 dense; HBM3e 4.8 TB/s. "
        "Overhead 75 us measured: olmoe-1b-7b bf16 batch 1 took 77.3 us, of which 2.6 us is streaming 12.6 MB.",
    ),
    "phone-soc": (
        Compute(peak_flops=4e12, mem_bw_Bps=68e9, overhead_s=300e-6),
        "Flagship phone SoC class (order of magnitude): GPU ~4 FP16 TFLOPS; LPDDR5X-8533 on a 64-bit bus "
        "= 68 GB/s. Overhead 4x the H200 host figure (assumption).",
    ),
}


def lookup(name: str) -> Compute:
    """The catalogue's Compute for `name`; KeyError names the known specs."""
    try:
        return CATALOGUE[name][0]
    except KeyError:
        raise KeyError(f"unknown compute spec {name!r}; known: {sorted(CATALOGUE)}") from None
