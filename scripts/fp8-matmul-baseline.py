#!/usr/bin/env python3
"""The card's dense FP8 rate through cuBLAS (torch._scaled_mm, e4m3, per-tensor scales, bf16 out).

A yardstick for the grouped GEMM on the same machine and day: clocks and power vary between
lent machines, and with the operands' values (the tensor cores' power depends on their bits).
Prints one line per kind of data: time and TFLOP/s of an n^3 product (default n = 8192).

Usage: fp8-matmul-baseline.py [N [KIND ...]], KIND in
  randn    torch.randn cast to e4m3 (most values in [-3, 3])
  normal   randn scaled per 128 values so that each block's largest magnitude is 448 (DeepGEMM's
           tests; epmoe bench gemm's default data)
  uniform  random sign, exponent in [-4, 4], every mantissa (epmoe bench gemm's EPMOE_BENCH_GEMM_DATA=uniform)
"""
import sys

import torch

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
kinds = sys.argv[2:] or ["randn", "normal", "uniform"]
one = torch.tensor(1.0, device="cuda")


def make(kind):
    if kind == "randn":
        return torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    if kind == "normal":
        x = torch.randn(n, n // 128, 128, device="cuda")
        amax = x.abs().amax(dim=2, keepdim=True).clamp(min=1e-4)
        return (x * (448.0 / amax)).view(n, n).to(torch.float8_e4m3fn)
    if kind == "uniform":
        r = torch.randint(0, 256, (n, n), device="cuda", dtype=torch.int32)
        code = ((r & 1) << 7) | ((3 + (r >> 4) % 9) << 3) | ((r >> 1) & 7)
        return code.to(torch.uint8).view(torch.float8_e4m3fn)
    raise SystemExit(f"unknown kind {kind!r}")


for kind in kinds:
    a, b = make(kind), make(kind)

    def run():
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    for _ in range(20):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        run()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 50
    print(f"torch._scaled_mm fp8 {n}^3 (cuBLAS), data {kind}: {ms * 1e3:.0f} us, "
          f"{2 * n**3 / ms / 1e9:.0f} TFLOP/s", flush=True)
