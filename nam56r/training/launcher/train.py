"""Train NAM56R: a recipe, lowered to Megatron's flags, launched with torchrun.

    python -m nam56r.training.launcher --recipe proxy-1gpu --dry-run     # print everything, start nothing (any machine)
    python -m nam56r.training.launcher --recipe proxy-1gpu               # one GPU, default data
    python -m nam56r.training.launcher --recipe proxy-1gpu --reference   # its dense reference GPT (nam56r.model.reference)
    python -m nam56r.training.launcher --recipe h200x8-bf16 --steps 2000 --save /ckpt/run1
    python -m nam56r.training.launcher --recipe h200x8-bf16 --load /ckpt/run1 --save /ckpt/run1   # resume
    python -m nam56r.training.launcher --recipe h200x8-bf16 --nodes 4 --slurm-script job.sbatch    # several nodes

Before launching it checks the recipe (`nam56r.training.recipe`), then the data (`nam56r.training.data.checks`): the
--data path exists; each train and valid .idx reads with Megatron's index reader, each .bin holds
exactly the bytes its index points at, opens with Megatron's IndexedDataset and holds tokens; no
token id reaches the model's vocabulary and every document ends in EOD; the tokenizer loads and
fits the vocabulary. Bad data stops the launch before any GPU work with `error: bad data: FILE ...`
naming the fix, and exit status 2, dry runs included. Then Megatron's own parser validates every
flag and derives the model config (which must match ours), and the preflight runs (patches applied
and unmodified, fused kernels importable, a GPU NAM56R trains on). A real run starts torchrun before
those two, so its ranks import torch, Megatron and the kernels meanwhile; they wait at the launch gate
(`nam56r.training.launcher.launch_gate`) and continue only once every check has passed and the data is built,
else they exit having built nothing and the launcher reports what failed. Without `--data` it trains on the default
C/C++ corpus (`python -m nam56r.training.data build`), built on first use. Runs write to `--run-dir`
(default `runs/<recipe>-<time>`): the command, the model config, per-rank logs, TensorBoard
events, and at the end `metrics.jsonl`, `summary.json` and `loss_throughput.png`. Checkpoints are
never deleted; a `--save` directory that already holds a checkpoint is refused unless it is also
`--load` (a resume).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time

from nam56r import CHECKOUT_ROOT, VERBOSE_ENV, show_known_warnings
from nam56r.training.launcher.data_choice import DataChoice, check_data_or_refuse, choose_data, ensure_data
from nam56r.training.launcher.errors import TrainError
from nam56r.training.launcher.flags import (
    RunPaths,
    megatron_flags,
    megatron_validate,
    recompute_mismatches,
    refused_flags,
    trained_model_mismatches,
    transformer_config_from_args,
)
from nam56r.training.launcher.kernel_cache import KernelCacheChoice, KernelCacheError, fill_label, record_fill
from nam56r.training.launcher.launch import LaunchError, Rendezvous, runtime_env, shell_line, slurm_script, torchrun_command
from nam56r.training.launcher.launch_gate import LaunchGate
from nam56r.training.launcher.startup_marks import mark, start_clock
from nam56r.training.launcher.train_args import parse_args, recipe_overrides
from nam56r.training.recipe import RECIPES, Recipe, RecipeError, get_recipe
from nam56r.training.runs.layout import RunDir
from nam56r.training.runs.resume_layout import check_resume
from nam56r.training.settings import banner_lines

ROOT = CHECKOUT_ROOT
CHECKPOINT_MARKER = "latest_checkpointed_iteration.txt"




def recipe_from(args: argparse.Namespace, kernels: bool = True) -> Recipe:
    """The recipe with the command line's overrides, checked (`kernels=False`: without `Recipe.kernel_problems`)."""
    return get_recipe(args.recipe, kernels=kernels, **recipe_overrides(args))


def choose_run_paths(args: argparse.Namespace, recipe: Recipe) -> RunPaths:
    if recipe.parallel.nodes > 1 and not args.slurm_script and args.run_dir is None:
        raise TrainError(
            f"{recipe.parallel.nodes} nodes: pass --run-dir on a filesystem every node shares, the same on each node "
            "(the default name carries the launch time, which differs between nodes)"
        )
    run_dir = args.run_dir or ROOT / "runs" / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.no_save and args.save is not None:
        raise TrainError("--no-save and --save contradict each other: pass one")
    save = None if args.no_save else args.save or RunDir(run_dir).checkpoints
    load = args.load
    if save is not None and (save / CHECKPOINT_MARKER).is_file() and (load is None or load.resolve() != save.resolve()):
        raise TrainError(
            f"--save {save} already holds a checkpoint ({CHECKPOINT_MARKER}); to continue it pass --load {save}, "
            "otherwise choose another --save (checkpoints are never overwritten or deleted)"
        )
    if load is not None and not (load / CHECKPOINT_MARKER).is_file():
        raise TrainError(f"--load {load}: no Megatron checkpoint there ({CHECKPOINT_MARKER} missing)")
    return RunPaths(run_dir=run_dir, save=save, load=load)


def resolve_backend_for(recipe: Recipe, dry_run: bool) -> tuple[str, str | None]:
    """The layer backend, and a problem to report when TE is asked for but absent (a dry run still prints the command)."""
    from nam56r.model.backend import resolve_backend

    try:
        return resolve_backend(recipe.kernels.backend), None
    except RuntimeError as exc:
        if not dry_run:
            raise TrainError(str(exc)) from None
        return "te", str(exc)


def validate_with_megatron(argv: list[str], recipe: Recipe, model) -> tuple[str, argparse.Namespace]:
    """Megatron's parser and config checks over the lowered flags, and our model against what they built: a line
    saying so, and Megatron's parsed args."""
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            margs = megatron_validate(argv, recipe.world_size)
            megatron_cfg = transformer_config_from_args(margs)
        except (AssertionError, ValueError, SystemExit) as exc:
            raise TrainError(f"Megatron's argument checks rejected the lowered flags: {type(exc).__name__}: {exc}") from None
        mismatches = trained_model_mismatches(model, margs, megatron_cfg)
    if mismatches:
        raise TrainError("the flags describe another model than the config:\n  " + "\n  ".join(mismatches))
    if clashes := recompute_mismatches(recipe, megatron_cfg):
        raise TrainError("the flags' activation recompute is not the recipe's:\n  " + "\n  ".join(clashes))
    return (f"validated by Megatron's parser as {recipe.world_size} rank(s); its model config matches {model.name}'s ({len(argv)} args)",
            margs)


def main(argv: list[str] | None = None) -> int:
    start_clock()  # the run's time zero for the startup marks, before anything else the launcher does
    args, extra = parse_args(argv, __doc__)
    if args.verbose:  # for this process, before it imports Megatron; `launch_env` passes it to torchrun's ranks
        os.environ[VERBOSE_ENV] = "1"
        show_known_warnings()
    if args.list:
        for name, make in RECIPES.items():
            r = make()
            shape = f"{r.world_size} GPU  pp={r.parallel.pp} ep={r.parallel.ep} mbs={r.batch.micro_batch} gbs={r.batch.global_batch}"
            warmup = f"dense warm-up {r.phases.dsa.dense_warmup_steps}"
            print(f"{name:14s} {r.model:14s} {shape:34s} {r.kernels.precision:15s} {warmup:18s} {r.description}")
        return 0
    try:
        return run(args, extra)
    except (TrainError, RecipeError, LaunchError, KernelCacheError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, extra: list[str]) -> int:
    # A real run checks the recipe's kernel shapes beside its ranks' start-up (`_prepare`), as they import
    # Megatron and TileLang; a dry run and a Slurm script check them first.
    recipe = recipe_from(args, kernels=bool(args.dry_run or args.slurm_script))
    if refused := refused_flags(extra):
        raise TrainError(f"refused for real runs: {', '.join(refused)}")
    backend, backend_problem = resolve_backend_for(recipe, args.dry_run)
    recipe = recipe.on_backend(backend)
    model = recipe.trained_model(backend)  # NAM56R, or with --reference the preset's reference GPT
    data = choose_data(args, model.vocab_size)
    if not data.ready:
        checked = "not yet: checked at launch, once built"
    elif args.dry_run or args.slurm_script:
        checked = check_data_or_refuse(data, model.vocab_size)
    else:
        checked = "below, while the ranks start"
    run_paths = choose_run_paths(args, recipe)
    megatron_argv = megatron_flags(recipe, model, data.paths, run_paths, backend) + extra
    env = launch_env(args)
    kernel_cache = KernelCacheChoice.from_launcher(args.kernel_cache, args.kernel_cache_mismatch,
                                                  planned_only=bool(args.dry_run or args.slurm_script))
    env |= kernel_cache.env
    rendezvous = Rendezvous(args.rdzv_endpoint, args.node_rank) if args.rdzv_endpoint else None
    cmd = torchrun_command(recipe, megatron_argv, run_paths.layout.logs, rendezvous) if not args.slurm_script else []

    print(f"recipe: {recipe.name} ({recipe.description}); model {model.name}, {recipe.world_size} GPU(s), "
          f"dp={recipe.data_parallel}, seq={model.seq_length}, backend {backend}")
    for line in banner_lines(recipe):
        print(f"  {line}")
    print(f"DSA phases: {recipe.phases.dsa.describe() if not recipe.reference else 'none (the reference GPT has no DSA layers)'}")
    print(f"data: {data.note}")
    print(f"data checked: {checked}")
    if kernel_cache.note:
        print(f"kernel cache: {kernel_cache.note}")
    print(
        f"run dir: {run_paths.run_dir}; checkpoints: " + (f"save {run_paths.save}" if run_paths.save else "none (--no-save)")
        + (f", resume from {run_paths.load}" if run_paths.load else "")
    )
    if args.slurm_script and args.kernel_cache:
        raise TrainError("--kernel-cache is for runs this launcher starts; in a Slurm job export TRITON_CACHE_DIR, "
                         "TILELANG_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR to the cache's triton/, tilelang/ and inductor/ yourself")
    if args.slurm_script or args.dry_run:
        report = _checks(megatron_argv, recipe, model, backend_problem, args.dry_run)
    if args.slurm_script:
        script = slurm_script(recipe, megatron_argv, run_paths.run_dir, ROOT)
        if args.verbose:
            print(f"--verbose: the script does not set {VERBOSE_ENV}; `export {VERBOSE_ENV}=1` before sbatch (srun passes it on)")
        if args.dry_run:
            print(f"slurm script ({args.slurm_script}, not written: dry run):\n{script}")
            return _dry_run_status(report)
        ensure_data(data, model.vocab_size)
        _write_run_files(run_paths, model, recipe, script)
        args.slurm_script.write_text(script)
        print(f"wrote {args.slurm_script}: submit with `sbatch {args.slurm_script}` from a node that shares this filesystem")
        return 0
    print("command:")
    print(shell_line(env, cmd))
    if args.dry_run:
        return _dry_run_status(report)
    return _launch(cmd, env, run_paths,
                   lambda: _prepare(megatron_argv, recipe, model, backend_problem, data, run_paths, cmd, env, kernel_cache),
                   node_rank=args.node_rank, summarize=lambda: _summarize(run_paths, model, recipe, kernel_cache))


def _checks(megatron_argv: list[str], recipe: Recipe, model, backend_problem: str | None, dry_run: bool):
    """The preflight and Megatron's parser over the lowered flags, printed; the report (a dry run reports a
    rejected flag as a failed check instead of raising)."""
    from nam56r.training.launcher.preflight import run_preflight

    report = run_preflight(model)
    if backend_problem:
        report.add("backend", False, backend_problem)
    try:
        validated, margs = validate_with_megatron(megatron_argv, recipe, model)
        print(f"megatron flags: {validated}")
    except TrainError as exc:
        if not dry_run:
            raise
        report.add("megatron flags", False, str(exc))
    else:
        try:
            if (resumes := check_resume(margs)) is not None:
                report.add("resume", True, resumes)
        except ValueError as exc:
            report.add("resume", False, str(exc))
    print("preflight:")
    print(report.format())
    print(f"preflight: {'passed' if not report.failures else f'{len(report.failures)} check(s) failed'}")
    return report


def _prepare(megatron_argv: list[str], recipe: Recipe, model, backend_problem: str | None, data: DataChoice,
             run_paths: RunPaths, cmd: list[str], env: dict[str, str], kernel_cache: KernelCacheChoice) -> None:
    """What a real run needs before its ranks parse a flag: the recipe's kernel shapes, the kernel cache's key
    checked, the data checked (or built and checked), the flags and the preflight passed, the run files written
    (the ranks read the model config)."""
    if problems := recipe.kernel_problems():
        raise RecipeError(recipe.name, problems)
    mark("launcher: kernel shapes checked")
    if kernel_cache.check_at_launch:
        print(f"kernel cache: {kernel_cache.open().message}")
        mark("launcher: kernel cache checked")
    if data.ready:
        print(f"data checked: {check_data_or_refuse(data, model.vocab_size)}")
        mark("launcher: data checked")
    report = _checks(megatron_argv, recipe, model, backend_problem, dry_run=False)
    if report.failures:
        raise TrainError("preflight failed; fix the checks above (the command is printed for reference)")
    mark("launcher: flags validated by Megatron, preflight passed")
    ensure_data(data, model.vocab_size)
    _write_run_files(run_paths, model, recipe, shell_line(env, cmd))


def _launch(cmd: list[str], env: dict[str, str], run_paths: RunPaths, prepare, *, node_rank: int, summarize) -> int:
    """Start torchrun at once and `prepare` while its ranks import (they wait at the launch gate), then open the
    gate; on any failure in `prepare` the gate is refused, the ranks exit having built nothing, and the failure
    is raised."""
    gate = LaunchGate.fresh(run_paths.layout.launch_gate(node_rank))
    proc = subprocess.Popen(cmd, env={**os.environ, **env, **gate.env()}, cwd=ROOT)
    mark("launcher: torchrun started")
    try:
        prepare()
    except BaseException as exc:
        gate.refuse(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        proc.wait()
        raise
    gate.open()
    mark("launcher: launch gate opened")
    code = proc.wait()
    if code == 0 and node_rank == 0:
        summarize()
    return code


def launch_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables the launcher sets for torchrun and its ranks (printed with the command)."""
    return runtime_env(os.environ) | ({VERBOSE_ENV: "1"} if args.verbose else {})


def _dry_run_status(report) -> int:
    """A dry run on a machine without a GPU still succeeds; flags Megatron rejects, and a checkpoint this layout cannot
    resume from, do not."""
    return 1 if any(check.name in ("megatron flags", "resume") for check in report.failures) else 0


def _write_run_files(run: RunPaths, model, recipe: Recipe, command: str) -> None:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    run.layout.model_config.write_text(json.dumps(model.to_dict(), indent=2))
    run.layout.recipe.write_text(json.dumps(recipe.to_dict(), indent=2))
    run.layout.command.write_text(command + "\n")


def _summarize(run: RunPaths, model, recipe: Recipe, kernel_cache: KernelCacheChoice | None = None) -> None:
    from nam56r.training.runs.summary import summarize_run

    if kernel_cache is not None and kernel_cache.env:
        record_fill(kernel_cache.directory, fill_label(recipe.name, recipe.batch.micro_batch, model.seq_length))

    summary = summarize_run(run.layout.tensorboard, model, model.seq_length, recipe.world_size, run.run_dir)
    print(f"summary: {run.layout.summary}; plot: {run.layout.plot}")
    print(summary)

