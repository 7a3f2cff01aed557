#!/usr/bin/env python3
"""The card's dense FP8 rate through cuBLAS (torch._scaled_mm, e4m3, per-tensor scales, bf16 out).

A yardstick for the grouped GEMM on the same machine and day: clocks and power vary between
lent machines, and with the operands' values (the tensor cores' power depends on their bits).
Prints one line per kind of data: time and TFLOP/s of an n^3 product (default n = 8192).

Usage: [FP8_BASELINE_ITERS=50] fp8-matmul-baseline.py [N [KIND ...]], KIND in
  randn    torch.randn cast to e4m3 (most values in [-3, 3])
  normal   randn scaled per 128 values so that each block's largest magnitude is 448 (DeepGEMM's
           tests; epmoe bench gemm's default data)
  uniform  random sign, exponent in [-4, 4], every mantissa (epmoe bench gemm's EPMOE_BENCH_GEMM_DATA=uniform)
"""
import os
import statistics
import sys
import threading
import time

import torch

try:  # the SM clock, power and clocks-event reasons beside the time, where pynvml is installed
    import pynvml

    pynvml.nvmlInit()
    _nvml = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    _reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
except Exception:  # noqa: BLE001 (any failure: no samples)
    _nvml = None

iters = int(os.environ.get("FP8_BASELINE_ITERS", "50"))


def sample(stop, into):
    while not stop.is_set():
        into.append((pynvml.nvmlDeviceGetClockInfo(_nvml, pynvml.NVML_CLOCK_SM),
                     pynvml.nvmlDeviceGetPowerUsage(_nvml) / 1000, _reasons(_nvml)))
        time.sleep(0.02)

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
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=sample, args=(stop, samples)) if _nvml is not None else None
    start.record()
    for _ in range(iters):
        run()
    end.record()
    if sampler is not None:
        sampler.start()
    torch.cuda.synchronize()
    if sampler is not None:
        stop.set()
        sampler.join()
    ms = start.elapsed_time(end) / iters
    clocks = ""
    if len(samples) > 2:
        xs = samples[1:-1]
        masks = [x[2] for x in xs]
        clocks = (f", {statistics.median(x[0] for x in xs):.0f} MHz, {statistics.median(x[1] for x in xs):.0f} W, "
                  f"reasons {({hex(m): masks.count(m) for m in sorted(set(masks))})}")
    print(f"torch._scaled_mm fp8 {n}^3 (cuBLAS), data {kind}: {ms * 1e3:.0f} us, "
          f"{2 * n**3 / ms / 1e9:.0f} TFLOP/s{clocks}", flush=True)
