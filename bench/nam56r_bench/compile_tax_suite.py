"""``compile-tax``: wall time to the first logged step of tiny and proxy at micro-batch 8 with an empty portable kernel
cache (`--kernel-cache`, nam56r.training.launcher.kernel_cache), which that run fills, then with the filled cache copied to
another path, as a node it is carried to gets it: the first step a fresh node pays, with and without a carried cache.
Each run is `nam56r_bench.training_suites.train`, the users' training command."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from nam56r_bench.harness import BenchError, Context, Row, require_gpu
from nam56r_bench.training_suites import train

COMPILE_TAX_MODELS = ("tiny", "proxy")
COMPILE_TAX_MBS = 8


def compile_tax(ctx: Context) -> list[Row]:
    """Per model (`--model`, default tiny and proxy at micro-batch 8): the time to the first step with an empty kernel
    cache, which the run fills, then with that cache copied to another path, as a node it is carried to would get it."""
    from nam56r.training.launcher.kernel_cache import read_manifest

    require_gpu("compile-tax")
    rows = []
    for model in ctx.models or COMPILE_TAX_MODELS:
        with tempfile.TemporaryDirectory(prefix="nam56r-bench-compile-") as tmp:
            filled, carried = Path(tmp) / "filled" / "kernel-cache", Path(tmp) / "carried" / "kernel-cache"
            for variant, cache in (("no kernel cache", filled), ("kernel cache carried", carried)):
                if cache == carried:
                    if not filled.is_dir():
                        rows.append(Row(f"{model} mbs {COMPILE_TAX_MBS} time to first step", variant,
                                        extra={"exit": None, "cause": "the run without a cache filled none to carry"}))
                        continue
                    shutil.copytree(filled, carried)
                result = train(model, Path(tmp) / variant.replace(" ", "-"), mbs=COMPILE_TAX_MBS, steps=2,
                               options=("--kernel-cache", str(cache), "--dense-warmup-steps", "1"))
                if result["exit"] != 0 or result["first_step_s"] is None:
                    # a run that never reached its first step measured nothing
                    said = result["cause"] or "\n".join(result["tail"][-15:])
                    raise BenchError(f"{model} mbs {COMPILE_TAX_MBS}, {variant}: the training run exited {result['exit']} "
                                     f"before its first step: {said}")
                manifest = read_manifest(cache)
                seconds = result["first_step_s"]
                rows.append(Row(f"{model} mbs {COMPILE_TAX_MBS} time to first step", variant,
                                time_ms=None if seconds is None else seconds * 1e3,
                                extra={"exit": result["exit"], "wall_s": result["wall_s"], "milestones_s": result["milestones_s"],
                                       "startup_s": result["startup_s"], "cause": result["cause"],
                                       "kernel_cache": None if manifest is None else manifest.weight()}))
    return rows
