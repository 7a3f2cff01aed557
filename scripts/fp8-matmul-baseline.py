#!/usr/bin/env python3
"""The card's dense FP8 rate through cuBLAS (torch._scaled_mm, e4m3, per-tensor scales, bf16 out).

A yardstick for the grouped GEMM on the same machine and day: clocks and power vary between
lent machines. Prints one line: time and TFLOP/s of an n^3 product (default n = 8192).
"""
import sys

import torch

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
one = torch.tensor(1.0, device="cuda")


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
print(f"torch._scaled_mm fp8 {n}^3 (cuBLAS): {ms * 1e3:.0f} us, {2 * n**3 / ms / 1e9:.0f} TFLOP/s")
