"""The bench suites by name, in the order `--list` shows and a full run takes them."""

from __future__ import annotations

from nam56r_bench import compile_tax_suite, kernel_suite, tooling_suite, training_suites
from nam56r_bench.harness import Suite

SUITES = {
    s.name: s
    for s in (
        Suite("tooling", "patch lane: materialize + apply all four series from a warm cache, and a no-op rebuild", False,
              tooling_suite.run),
        Suite("kernels", "each fused kernel / memory patch vs the upstream or reference path: time, memory, max error", True,
              kernel_suite.run),
        Suite("train-step", "proxy and full NAM56R on one GPU: tokens/s, TFLOP/s, MFU vs a measured GEMM peak, peak memory, top kernels",
              True, training_suites.train_step),
        Suite("microbatch", "largest micro-batch that trains at sequence 4096, proxy and full, fused vs upstream LM-head/MTP CE",
              True, training_suites.microbatch),
        Suite("compile-tax", "time to the first step without and with a carried kernel cache (tiny, proxy; mbs 8)", True,
              compile_tax_suite.compile_tax),
    )
}
