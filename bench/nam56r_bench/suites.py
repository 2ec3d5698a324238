"""The bench suites by name, in the order `--list` shows and a full run takes them."""

from __future__ import annotations

from nam56r_bench import kernels, tooling, training
from nam56r_bench.harness import Suite

SUITES = {
    s.name: s
    for s in (
        Suite("tooling", "patch lane: materialize + apply all four series from a warm cache, and a no-op rebuild", False, tooling.run),
        Suite("kernels", "each fused kernel / memory patch vs the upstream or reference path: time, memory, max error", True,
              kernels.run),
        Suite("train-step", "proxy and full NAM56R on one GPU: tokens/s, TFLOP/s, MFU vs a measured GEMM peak, peak memory, top kernels",
              True, training.train_step),
        Suite("microbatch", "largest micro-batch that trains at sequence 4096, proxy and full", True, training.microbatch),
        Suite("compile-tax", "time to first step with empty and with warm Triton/TileLang caches", True, training.compile_tax),
    )
}
