#!/usr/bin/env python3
"""cuBLAS's FP8 GEMM with DeepSeek's block scales (1 x 128 activations, 128 x 128 weights) through
torch.nn.functional.scaled_mm (and, unscaled, torch._scaled_mm): a second implementation of the grouped GEMM's math, timed on the same machine
and day as `epmoe bench gemm` (issue 4's yardstick beside DeepGEMM's anchors).

One dense product per shape (M x N x K, one "group"), operands quantized the way DeepGEMM's tests
and the bench's `normal` data are (randn scaled so that each block's largest magnitude is 448), bf16
out. Each timed call follows an 8 GB memset, as DeepGEMM's bench_kineto and the bench's burst timing
do. Prints one JSON object per line: shape, scaling, time, TFLOP/s, or the error when this PyTorch /
cuBLAS refuses the scaling.

Usage: [FP8_BASELINE_ITERS=30] fp8-blockwise-baseline.py [MxNxK ...]
       (default: 32768x4096x7168 32768x7168x2048)
"""
import json
import os
import sys

import torch


def quantize(x, block_rows, block_cols):
    """e4m3 codes and f32 scales of x [R, C] per block_rows x block_cols block (amax -> 448)."""
    r, c = x.shape
    blocks = x.view(r // block_rows, block_rows, c // block_cols, block_cols)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    scale = amax / 448.0
    codes = (blocks / scale).to(torch.float8_e4m3fn).view(r, c)
    return codes, scale.view(r // block_rows, c // block_cols).float()


def timed(fn, iters):
    flush = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    del flush
    times.sort()
    return times[len(times) // 2], times[0]


def main():
    iters = int(os.environ.get("FP8_BASELINE_ITERS", "30"))
    shapes = sys.argv[1:] or ["32768x4096x7168", "32768x7168x2048"]
    torch.manual_seed(0)
    for shape in shapes:
        m, n, k = (int(v) for v in shape.split("x"))
        a, sa = quantize(torch.randn(m, k, device="cuda"), 1, 128)  # sa [M, K/128]
        w, sw = quantize(torch.randn(n, k, device="cuda"), 128, 128)  # sw [N/128, K/128]
        b = w.t()  # [K, N], column-major, as _scaled_mm wants its second operand
        one = torch.ones((), device="cuda")

        def inferred(scale_a, scale_b):
            """torch._scaled_mm, which infers the scaling from the scales' shapes."""
            return lambda: torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)

        tries = {
            # per-tensor scales: cuBLAS's plain FP8 rate on the same bits (no block scaling)
            "per_tensor": inferred(one, one),
            # 1 x 128 and 128 x 128 blocks in the layouts session 32 tried (each refused by the inference:
            # "Invalid scaling configuration"; kept to show whether a later PyTorch takes them)
            "blockwise_mmajor": inferred(sa.t().contiguous().t(), sw.t().contiguous()),
            "blockwise_kmajor": inferred(sa, sw.t().contiguous()),
            "blockwise_kmajor_wT": inferred(sa, sw),
        }
        # The explicit-recipe entry point (PyTorch >= 2.9), which takes them: the activation scales M-major
        # (a transposed view of a contiguous [K/128, M]), the weight scales as the transposed view of their
        # [N/128, K/128] storage (K/128 and M multiples of 4, as cuBLAS wants them).
        F = torch.nn.functional
        if hasattr(F, "scaled_mm"):
            sa_m_major = sa.t().contiguous().t()
            tries["blockwise_recipes"] = lambda: F.scaled_mm(
                a, b, sa_m_major, F.ScalingType.BlockWise1x128, sw.t(), F.ScalingType.BlockWise128x128,
                output_dtype=torch.bfloat16)
        for name, fn in tries.items():
            row = {"shape": shape, "m": m, "n": n, "k": k, "scaling": name}
            try:
                out = fn()
                if name != "per_tensor":  # a spot check of the math against the dequantized operands
                    ref = (a[:64].float().view(64, k // 128, 128) * sa[:64].view(64, k // 128, 1)).view(64, k) @ (
                        w[:128].float().view(1, 128, k // 128, 128) * sw[:1].view(1, 1, k // 128, 1)).view(128, k).t()
                    got = out[:64, :128].float()
                    row["rel_l2_spot"] = float((got - ref).norm() / ref.norm())
                median_us, min_us = timed(fn, iters)
                row.update(time_us=round(median_us, 1), min_us=round(min_us, 1),
                           tflops=round(2.0 * m * n * k / median_us / 1e6, 1))
            except Exception as e:  # noqa: BLE001 (report what this build refuses)
                row["error"] = str(e).splitlines()[0][:200]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
