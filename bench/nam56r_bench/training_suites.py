"""The GPU training suites, each through `python -m nam56r.training.launcher` (the users' command) on this machine:

- ``train-step``: the proxy recipe and the full NAM56R on one GPU, (``--model nam56r-2gpu``) the full NAM56R on
  two GPUs at EP=2, and (``--model nam56r-4gpu``) the 8xH200 recipe on four GPUs at its EP=4: tokens/s/GPU, TFLOP/s/GPU (nam56r.model.flops'
  formula, the run's steady-state window), MFU against a bf16 GEMM peak measured in the same run, peak
  memory, and, from a PyTorch-profiler trace of rank 0's steps 20-22, the top-10 kernels by CUDA time with
  their share of the step and the GPU-idle share (`nam56r_bench.profile_trace`). Each row names the settings
  its run trained with (`run_settings`: micro-batch, CE path, DSA indexer, IndexCache, recompute, backend).
- ``microbatch``: the largest micro-batch that trains 3 steps at sequence 4096, proxy and full, on each memory
  path of the LM head and MTP heads in the same build: Megatron patches 0007/0008's fused linear CE
  (`--linear-ce liger`), our chunked linear CE (`--linear-ce chunked`, patch 0016, the recipes' default) and
  upstream's logits + cross-entropy (`--linear-ce logits`). After micro-batches 1 and 2 it tries the size their
  peak memory predicts for the GPU (`predicted_largest`), then bisects, so a path takes about four runs.
  With `--recompute` (bench option) both suites run each recompute setting named instead (the launcher's
  `--recompute`; `each` is `RECOMPUTE_SETTINGS`), on the default CE path: the micro-batch and TFLOP/s per switch.
  Before a model's search its Mamba-3 MIMO kernels are compiled for `--prewarm-mbs` sizes in parallel
  (`nam56r.training.launcher.kernel_prewarm`), as they are compiled per micro-batch size.

The micro-batch search itself is `nam56r_bench.microbatch_search`; ``compile-tax`` runs through `train` here from
`nam56r_bench.compile_tax_suite`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nam56r.training.launcher.startup_marks import MARK as STARTUP_MARK
from nam56r.training.launcher.startup_marks import STARTUP_T0_ENV, read_marks
from nam56r.training.recipe import settings_of
from nam56r.training.runs.layout import RunDir
from nam56r.training.runs.summary import headline
from nam56r_bench.harness import BenchError, Context, Row, cuda_time_ms, require_gpu
from nam56r_bench.microbatch_search import describe_attempt, failure_reason, largest_micro_batch, try_outcome
from nam56r_bench.profile_trace import profile_breakdown


@dataclass(frozen=True)
class BenchModel:
    """A model the training suites run: the launcher's arguments for it, and the GPUs it trains on (one data-parallel
    rank each: every recipe here has TP = PP = 1)."""

    launcher_args: tuple[str, ...]
    gpus: int = 1
    default: bool = True  # run by a suite given no --model (tiny is for compile-tax alone)


# The full NAM56R on one GPU is the 8-GPU bf16 recipe on one GPU, no expert parallelism; on two GPUs it is the
# 2xH200 recipe (EP=2, distributed optimizer) with the full model; on four GPUs it is the 8-GPU bf16 recipe at its own
# EP=4, each GPU holding the experts and optimizer shards it holds on eight, but data parallel 4.
RECIPES = {
    "tiny": BenchModel(("--recipe", "tiny-1gpu"), default=False),
    "proxy": BenchModel(("--recipe", "proxy-1gpu")),
    "nam56r": BenchModel(("--recipe", "h200x8-bf16", "--gpus-per-node", "1", "--ep", "1")),
    "nam56r-2gpu": BenchModel(("--recipe", "h200x2-ep2", "--model", "nam56r"), gpus=2),
    "nam56r-4gpu": BenchModel(("--recipe", "h200x8-bf16", "--gpus-per-node", "4"), gpus=4),
}
FIRST_STEP = re.compile(r"iteration\s+1/")
# Megatron's print_datetime milestones ("[after model, optimizer, and learning rate scheduler are built] datetime: ..."):
# where the time to the first step goes (initialisation, model build, data loaders, then the first step's compiles).
MILESTONE = re.compile(r"\[(?P<what>after [^\]]+)\] datetime: ")
# An exception a rank printed ("[default0]: torch.OutOfMemoryError: CUDA out of memory. ...", or a bare
# "[default0]:[rank0]: AssertionError" from an assert without a message). A failed run's first one is its cause;
# torchrun's closing ChildFailedError and summary name only the exit codes, and fill the log's tail. The launcher's
# own refusals ("error: ...", exit 2) come before any rank has run.
EXCEPTION_LINE = re.compile(r"^(?:\[[\w ]+\]:?\s*)*(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?:: |\s*$)|^error: ")
# A line a rank printed through torchrun's --tee ("[default0]:..."): what the ranks said last, apart from torchrun's own
RANK_LINE = re.compile(r"^\[default\d+\]:")


def models(ctx: Context) -> tuple[str, ...]:
    """The models a training suite runs: those named with --model, else the one-GPU ones (the proxy alone for --quick)."""
    return ctx.models or (("proxy",) if ctx.quick else tuple(name for name, model in RECIPES.items() if model.gpus == 1 and model.default))


def require_gpus(model: str) -> None:
    """Refuse a model that trains on more GPUs than this machine shows."""
    import torch

    if (needed := RECIPES[model].gpus) > (visible := torch.cuda.device_count()):
        raise BenchError(f"model {model!r} trains on {needed} GPUs and this machine shows {visible}"
                         " (CUDA_VISIBLE_DEVICES may hide some)")


def model_label(model: str) -> str:
    """How a row names a model and its GPUs: 'proxy 1 GPU', 'nam56r-2gpu 2 GPUs'."""
    gpus = RECIPES[model].gpus
    return f"{model} {gpus} GPU{'s' if gpus > 1 else ''}"


def gemm_peak_tflops() -> float:
    """bf16 dense GEMM throughput (8192^3, median of 20) on this GPU: the denominator of MFU."""
    import torch

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = cuda_time_ms(lambda: a @ b, warmup=5, iters=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def train_command(recipe: str, run_dir: Path, *, mbs: int | None, steps: int, options: tuple[str, ...] = (),
                  extra: tuple[str, ...] = ()) -> list[str]:
    """`python -m nam56r.training.launcher` for a bench run: no checkpoint (a proxy checkpoint takes about 44 GiB), a
    one-step learning-rate warm-up, as a run of a few steps needs one shorter than the recipe's (the schedule
    changes neither speed nor memory), and no DSA dense warm-up: the benches measure the sparse steps the run
    spends nearly all its time in. `options`: the launcher's own (e.g. `--linear-ce logits`); `extra`:
    Megatron flags after `--`."""
    model = RECIPES[recipe]
    command = [sys.executable, "-m", "nam56r.training.launcher", *model.launcher_args, "--steps", str(steps), "--warmup", "1",
               "--dense-warmup-steps", "0", "--no-save", "--run-dir", str(run_dir), *options]
    if mbs is not None:  # one micro-batch per data-parallel rank and step
        command += ["--mbs", str(mbs), "--gbs", str(mbs * model.gpus)]
    return command + (["--", *extra] if extra else [])


def train(recipe: str, run_dir: Path, *, mbs: int | None, steps: int, options: tuple[str, ...] = (), extra: tuple[str, ...] = (),
          env: dict | None = None) -> dict:
    """Run the users' training command (`train_command`); returns exit code, wall seconds, seconds to the first
    logged step, Megatron's milestones and the launcher's and rank 0's startup marks (`nam56r.training.launcher.startup_marks`,
    on this function's clock), the run's summary.json (when it finished), the log tail and the first exception a rank
    printed (`cause`, None when none did)."""
    command = train_command(recipe, run_dir, mbs=mbs, steps=steps, options=options, extra=extra)
    print(f"[train] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    first_step_s = None
    milestones: dict[str, float] = {}
    startup_lines: list[str] = []
    tail: list[str] = []
    rank_tail: list[str] = []
    cause: str | None = None
    clock = {STARTUP_T0_ENV: repr(time.time())}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {}), **clock})
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-40:]
        if RANK_LINE.match(line):
            rank_tail = (rank_tail + [line.rstrip()])[-20:]
        if cause is None and EXCEPTION_LINE.search(line) and "ChildFailedError" not in line:
            cause = line.strip()
        if first_step_s is None and STARTUP_MARK.search(line):
            startup_lines.append(line)
        if (milestone := MILESTONE.search(line)) and milestone["what"] not in milestones:
            milestones[milestone["what"]] = round(time.perf_counter() - start, 1)
        if first_step_s is None and FIRST_STEP.search(line):
            first_step_s = time.perf_counter() - start
            print(f"[train] first step after {first_step_s:.1f} s", flush=True)
    code = proc.wait()
    if cause and cause.startswith("error: ") and cause in tail:  # the launcher lists a refusal's reasons below it
        cause = "\n".join([cause, *itertools.takewhile(lambda line: line.startswith("  "), tail[tail.index(cause) + 1:])])
    summary_file = RunDir(run_dir).summary
    summary = json.loads(summary_file.read_text()) if code == 0 and summary_file.exists() else None
    return {"exit": code, "wall_s": time.perf_counter() - start, "first_step_s": first_step_s, "milestones_s": milestones,
            "startup_s": read_marks(startup_lines), "summary": summary, "tail": tail, "rank_tail": rank_tail,
            "cause": cause}


# The launcher options the training suites set themselves, per row (`train_command` and `_train_step_row`).
SUITE_TRAIN_OPTIONS = {"--mbs", "--gbs", "--recompute", "--linear-ce", "--recipe", "--model", "--steps", "--run-dir", "--no-save"}

# The launcher's --recompute settings `--recompute each` runs: none, each family alone, all of them.
RECOMPUTE_SETTINGS = ("none", "mamba", "moe", "attention", "mamba,moe,attention")


def recompute_settings(ctx: Context) -> tuple[str, ...]:
    """The --recompute settings the training suites run (`each`: RECOMPUTE_SETTINGS); () when none were named."""
    named = [setting for name in ctx.recompute for setting in (RECOMPUTE_SETTINGS if name == "each" else (name,))]
    return tuple(dict.fromkeys(named))


def train_step(ctx: Context) -> list[Row]:
    require_gpu("train-step")
    peak = gemm_peak_tflops()
    rows = []
    steps = 12 if ctx.quick else 25
    with tempfile.TemporaryDirectory(prefix="nam56r-bench-train-") as tmp:
        for recipe in models(ctx):
            require_gpus(recipe)
            if ctx.micro_batches and ctx.prewarm_mbs:  # the sizes named, compiled side by side before the runs
                prewarm(recipe, ctx.micro_batches)
            runs = itertools.product(ctx.linear_ce or (None,), recompute_settings(ctx) or (None,), ctx.micro_batches or (None,),
                                     enumerate(ctx.train_args or ("",)))
            for linear_ce, setting, mbs, (variant, train_args) in runs:
                recompute_name = (setting or "recipe").replace(",", "-")
                run_dir = Path(tmp) / f"{recipe}-ce-{linear_ce or 'recipe'}-recompute-{recompute_name}-mbs{mbs or 'recipe'}-args{variant}"
                rows.append(_train_step_row(recipe, mbs, run_dir, steps, peak, ctx, recompute=setting, linear_ce=linear_ce,
                                            train_args=train_args))
    return rows


def split_train_args(train_args: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`--train-args` as (launcher options, Megatron flags after its `--`): the run's command has one `--`, before
    the profiler's Megatron flags and these."""
    words = shlex.split(train_args)
    if "--" not in words:
        return tuple(words), ()
    cut = words.index("--")
    return tuple(words[:cut]), tuple(words[cut + 1 :])


def _train_step_row(recipe: str, mbs: int | None, run_dir: Path, steps: int, peak: float, ctx: Context,
                    recompute: str | None = None, linear_ce: str | None = None, train_args: str = "") -> Row:
    """One train-step row: a run of `steps` at micro-batch `mbs` (None: the recipe's) with the launcher's `--recompute`
    setting and `--linear-ce` path (None: the recipe's) and the launcher options `train_args` (one shell-quoted
    string), profiled unless --quick."""
    profiled = not ctx.quick
    profile = ("--profile", "--use-pytorch-profiler", "--profile-step-start", "20", "--profile-step-end", "22")
    launcher_args, megatron_args = split_train_args(train_args)
    options = ((("--recompute", recompute) if recompute else ()) + (("--linear-ce", linear_ce) if linear_ce else ())
               + launcher_args)
    result = train(recipe, run_dir, mbs=mbs, steps=steps, options=options,
                   extra=(profile if profiled else ()) + megatron_args)
    case = (model_label(recipe) + (f" mbs {mbs}" if mbs else "") + (f" recompute {recompute}" if recompute else "")
            + (f" linear-ce {linear_ce}" if linear_ce else "") + (f" {train_args}" if train_args else ""))
    extra = {"gemm_peak_tflops": round(peak, 1), "exit": result["exit"], "first_step_s": result["first_step_s"],
             "milestones_s": result["milestones_s"], "startup_s": result["startup_s"], **run_settings(run_dir)}
    summary = result["summary"]
    if summary is None:
        return Row(case, "patched", extra={**extra, "error": failure_reason(result), "log_tail": "\n".join(result["tail"][-15:]),
                                           "rank_log_tail": "\n".join(result.get("rank_tail", []))})
    figures, medians = headline(summary), summary["median_over_window"]
    tflops = figures.tflops_per_s_per_gpu
    extra.update(tokens_per_s_per_gpu=figures.tokens_per_s_per_gpu, tflops_per_s_per_gpu=tflops, mfu=tflops / peak,
                 window=summary["window"], global_batch_size=medians["global_batch_size"], losses=summary["losses"])
    print(f"[train-step] {case}: {tflops:.1f} TFLOP/s/GPU, {figures.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
          f"peak {figures.peak_memory_gib:.1f} GiB", flush=True)
    if profiled:
        # The step figures stand on their own: a missing trace is reported in the row, not a lost run.
        try:
            extra["profile"] = profile_breakdown(RunDir(run_dir).torch_profile)
        except BenchError as exc:
            extra["error"] = f"profile: {exc}"
    return Row(case, "patched", time_ms=medians["iteration_time_s"] * 1e3, peak_extra_bytes=summary["peak_memory"]["bytes"],
               extra=extra)


def run_settings(run_dir: Path) -> dict:
    """The settings a row's speed depends on (those declared `recorded`, nam56r.training.recipe_settings), from the
    recipe the launcher wrote into the run directory (what the run trained with, defaults included); {} when the run
    wrote none."""
    recipe_file = RunDir(run_dir).recipe
    if not recipe_file.exists():
        return {}
    return settings_of(json.loads(recipe_file.read_text()))


# The LM head's and MTP heads' loss paths the microbatch suite compares in one build (the launcher's --linear-ce,
# each named): Liger through Megatron patches 0007/0008, our chunked linear CE (the recipes' default), upstream's
# logits + CE. Megatron patch 0002 (per-head index scores) is not among the memory paths: with the TileLang DSA
# backend and the sparse indexer loss (every recipe's) the indexer never calls the `_compute_index_scores` it patches.
CE_PATHS = {
    "Liger fused linear CE (patches 0007/0008)": ("--linear-ce", "liger"),
    "chunked linear CE (nam56r_kernels, patch 0016)": ("--linear-ce", "chunked"),
    "upstream CE (logits + fp32 CE)": ("--linear-ce", "logits"),
}
LINEAR_CE_PATHS = tuple(options[1] for options in CE_PATHS.values())


def microbatch_variants(ctx: Context) -> dict[str, tuple[str, ...]]:
    """What the microbatch suite compares: the CE paths (those named with `--linear-ce`, else every one), or with
    `--recompute` the recompute settings named, on the named CE path (else the recipe's)."""
    ce_paths = {label: options for label, options in CE_PATHS.items() if not ctx.linear_ce or options[1] in ctx.linear_ce}
    if settings := recompute_settings(ctx):
        on_ce = [(f", {label}", options) for label, options in ce_paths.items()] if ctx.linear_ce else [("", ())]
        return {f"recompute {setting}{suffix}": ("--recompute", setting, *ce) for setting in settings for suffix, ce in on_ce}
    return ce_paths


def microbatch(ctx: Context) -> list[Row]:
    require_gpu("microbatch")
    capacity = gpu_capacity_gib()
    rows = []
    with tempfile.TemporaryDirectory(prefix="nam56r-bench-mbs-") as tmp:
        for recipe in models(ctx):
            require_gpus(recipe)
            warmed = {"micro_batches": list(ctx.prewarm_mbs), "seconds": prewarm(recipe, ctx.prewarm_mbs) if ctx.prewarm_mbs else None}
            for side, (variant, options) in enumerate(microbatch_variants(ctx).items()):
                def try_mbs(mbs: int, recipe: str = recipe, side: int = side, variant: str = variant,
                            options: tuple[str, ...] = options) -> dict:
                    result = train(recipe, Path(tmp) / f"{recipe}-v{side}-mbs{mbs}", mbs=mbs, steps=3, options=options)
                    print(f"[microbatch] {recipe} · {variant} · mbs {mbs}: {describe_attempt(try_outcome(result))}", flush=True)
                    return result

                fits, tried = largest_micro_batch(try_mbs, quick=ctx.quick, capacity_gib=capacity)
                rows.append(Row(f"{recipe} seq 4096", variant, extra={"largest_micro_batch": fits, "tried": tried, "prewarm": warmed}))
    return rows


def prewarm_command(recipe: str, sizes: tuple[int, ...]) -> list[str]:
    """`python -m nam56r.training.launcher.kernel_prewarm` for a bench model's recipe and model preset at `sizes`."""
    from nam56r.training.launcher.kernel_prewarm import format_sizes

    launcher = dict(zip(RECIPES[recipe].launcher_args[::2], RECIPES[recipe].launcher_args[1::2], strict=True))
    shape = [arg for flag in ("--recipe", "--model") if flag in launcher for arg in (flag, launcher[flag])]
    return [sys.executable, "-m", "nam56r.training.launcher.kernel_prewarm", *shape, "--mbs", format_sizes(sizes)]


def prewarm(recipe: str, sizes: tuple[int, ...]) -> float:
    """Compile the model's Mamba-3 MIMO kernels at micro-batch `sizes` into TileLang's disk cache before a search
    tries them (each try would otherwise compile its size's kernels one after another in its first step); seconds
    taken. A failed prewarm stops the suite: a search without it would run, only slower, so it says why."""
    command = prewarm_command(recipe, sizes)
    print(f"[prewarm] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    if subprocess.run(command).returncode != 0:
        raise BenchError(f"the kernel prewarm for {recipe} failed (its output is above); --prewarm-mbs none searches without it")
    return time.perf_counter() - start


def gpu_capacity_gib() -> float:
    """The memory of this machine's GPU 0, GiB."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30
