"""nam56r_bench.training_suites: the users' training command each run takes, the models a suite runs, what a
micro-batch try reports, and the top kernels read from profiler traces, and where Megatron writes them."""

from __future__ import annotations

import fnmatch
import gzip
import json
import sys
from pathlib import Path

import pytest
from nam56r_bench.harness import BenchError, Context
from nam56r_bench.microbatch_search import describe_attempt, failure_reason, largest_micro_batch, predicted_largest, try_outcome
from nam56r_bench.profile_trace import TRACE_GLOB, profile_breakdown, profile_step
from nam56r_bench.training_suites import (
    CE_PATHS,
    LINEAR_CE_PATHS,
    RECIPES,
    RECOMPUTE_SETTINGS,
    microbatch_variants,
    models,
    prewarm_command,
    recompute_settings,
    run_settings,
    split_train_args,
    train_command,
)

ROOT = Path(__file__).resolve().parents[2]


def _write_trace(path: Path, events: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_profile_breakdown_ranks_kernels_and_counts_gpu_idle_time(tmp_path: Path) -> None:
    # Two profiled steps over 1000 us; kernels on two streams overlap (counted once as busy); one kernel and
    # one memcpy fall outside the steps.
    # Each step is annotated on the host and again on the GPU timeline, as a CUDA trace does.
    steps = [{"name": f"ProfilerStep#{20 + i}", "cat": cat, "ts": 500 * i, "dur": 500}
             for i in range(2) for cat in ("user_annotation", "gpu_user_annotation")]
    gpu = [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 300}, {"cat": "kernel", "name": "softmax", "ts": 200, "dur": 200},
           {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 600, "dur": 100}, {"cat": "kernel", "name": "gemm", "ts": 800, "dur": 100},
           {"cat": "kernel", "name": "late", "ts": 5000, "dur": 100}, {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900}]
    _write_trace(tmp_path / "rank-0.json.gz", steps + gpu)
    out = profile_breakdown(tmp_path, count=2)
    assert (out["steps"], out["step_ms"]) == (2, 0.5)
    assert abs(out["gpu_busy_share"] - 0.6) < 1e-9 and abs(out["gpu_idle_share"] - 0.4) < 1e-9  # [0,400) + [600,700) + [800,900)
    assert [(k["kernel"], k["total_ms"], k["calls"]) for k in out["top_kernels"]] == [("gemm", 0.4, 2), ("softmax", 0.2, 1)]
    assert abs(out["top_kernels"][0]["share_of_step"] - 0.4) < 1e-9 and abs(out["kernel_share"] - 0.6) < 1e-9


def test_profile_breakdown_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match=r"no PyTorch profiler trace \(rank-\*\.json\.gz\)"):
        profile_breakdown(tmp_path)
    _write_trace(tmp_path / "rank-0.json.gz", [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 5}])
    with pytest.raises(BenchError, match="no ProfilerStep# annotation"):
        profile_breakdown(tmp_path)


def test_profile_breakdown_reads_a_real_profiler_trace_written_as_megatron_writes_it(tmp_path: Path) -> None:
    """torch.profiler with Megatron's schedule and export (`export_chrome_trace` to rank-<r>.json.gz): the steps
    are found; on CPU the trace has no CUDA kernel, which is said."""
    import torch

    def trace_handler(p: torch.profiler.profile) -> None:
        p.export_chrome_trace(str(tmp_path / "rank-0.json.gz"))

    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule, on_trace_ready=trace_handler) as prof:
        for _ in range(5):
            torch.randn(64, 64) @ torch.randn(64, 64)
            prof.step()
    with pytest.raises(BenchError, match="holds no CUDA kernel in its profiled steps"):
        profile_breakdown(tmp_path)


def test_the_trace_directory_is_where_megatron_writes_for_our_flags(megatron_built) -> None:
    """Megatron's train() (the pinned source) writes its PyTorch-profiler trace to a path made from
    --tensorboard-dir; with the flags our launcher passes, that path is RunDir.torch_profile."""
    import inspect
    import re

    from megatron.training import training

    from nam56r.training.data.layout import DataDir, DataPaths
    from nam56r.training.launcher.flags import RunPaths, megatron_flags
    from nam56r.training.recipe import get_recipe
    from nam56r.training.runs.layout import RunDir

    source = inspect.getsource(training.train)
    directory = re.search(r'profile_dir = Path\(f"\{args\.tensorboard_dir\}([^"]*)"\)', source)
    assert directory and 'export_chrome_trace(f"{profile_dir}/rank-{torch.distributed.get_rank()}.json.gz")' in source
    recipe, data = get_recipe("proxy-1gpu"), DataDir(Path("/data"))
    argv = megatron_flags(recipe, recipe.model_config(), DataPaths(data.train_prefix, data.valid_prefix, data.tokenizer_dir),
                          RunPaths(Path("/runs/r"), None, None), "local")
    tensorboard_dir = argv[argv.index("--tensorboard-dir") + 1]
    written = Path(tensorboard_dir + directory.group(1))
    assert written.resolve() == RunDir(Path("/runs/r")).torch_profile.resolve()
    assert fnmatch.fnmatch("rank-0.json.gz", TRACE_GLOB)


@pytest.mark.parametrize(("recipe", "global_batch"), [("proxy", 2), ("nam56r", 2), ("nam56r-2gpu", 4), ("nam56r-4gpu", 8)])
def test_bench_training_runs_save_no_checkpoint(recipe: str, global_batch: int, tmp_path: Path, megatron_built,
                                                capsys: pytest.CaptureFixture) -> None:
    """Each bench run is the users' command, which nam56r.training.launcher's own parser and Megatron's accept
    (dry run); it saves nothing (a proxy checkpoint takes about 44 GiB, several would fill a node's disk). A step
    is one micro-batch per data-parallel rank."""
    from nam56r.training.launcher.train import main as train_main

    command = train_command(recipe, tmp_path / "run", mbs=2, steps=3)
    assert command[1:3] == ["-m", "nam56r.training.launcher"]
    assert train_main([*command[3:], "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: none (--no-save)" in out
    assert "--micro-batch-size 2 " in out and f"--global-batch-size {global_batch} " in out and "--save " not in out
    assert f"--nproc-per-node {RECIPES[recipe].gpus} " in out


def test_train_args_with_megatron_flags_make_one_command_the_launcher_and_megatron_accept(
        tmp_path: Path, megatron_built, capsys: pytest.CaptureFixture) -> None:
    """`--train-args '--recompute moe -- --grad-reduce-in-bf16'`: launcher options before the run's one `--`, Megatron
    flags after it beside the profiler's."""
    from nam56r.training.launcher.train import main as train_main

    launcher, megatron = split_train_args("--recompute moe -- --grad-reduce-in-bf16")
    assert (launcher, megatron) == (("--recompute", "moe"), ("--grad-reduce-in-bf16",))
    assert split_train_args("--recompute moe") == (("--recompute", "moe"), ())
    profile = ("--profile", "--use-pytorch-profiler", "--profile-step-start", "20", "--profile-step-end", "22")
    command = train_command("proxy", tmp_path / "run", mbs=1, steps=3, options=(*launcher, "--dry-run"),
                            extra=profile + megatron)
    assert command.count("--") == 1
    assert train_main(command[3:]) == 0
    assert "--grad-reduce-in-bf16" in capsys.readouterr().out


def test_a_micro_batch_try_reads_a_real_run_summary() -> None:
    summary = json.loads((ROOT / "docs" / "train" / "proxy-1gpu-h200.json").read_text())
    tried = try_outcome({"exit": 0, "summary": summary, "first_step_s": 202.0, "tail": []})
    assert tried == {"exit": 0, "peak_memory_gib": summary["peak_memory"]["gib"],
                     "tflops_per_s_per_gpu": summary["median_over_window"]["tflops_per_s_per_gpu"], "first_step_s": 202.0}
    assert 60 < tried["peak_memory_gib"] < 70
    line = describe_attempt(tried)
    assert line.startswith(f"trains, peak {tried['peak_memory_gib']:.1f} GiB, ") and line.endswith("first step after 202 s")


def test_a_micro_batch_try_that_ran_out_of_memory_says_so() -> None:
    tail = ["[default0]: step 1", "[default0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB", "exit"]
    assert try_outcome({"exit": 1, "summary": None, "first_step_s": None, "tail": tail}) == {
        "exit": 1, "error": "[default0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"}
    assert describe_attempt(try_outcome({"exit": 1, "summary": None, "first_step_s": None, "tail": tail})) == (
        "exit 1: [default0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB")


def test_model_option_picks_the_training_suites_models(tmp_path: Path) -> None:
    assert models(Context(tmp_path, quick=False)) == ("proxy", "nam56r")  # the one-GPU models
    assert models(Context(tmp_path, quick=False, models=("nam56r-2gpu",))) == ("nam56r-2gpu",)
    assert models(Context(tmp_path, quick=True)) == ("proxy",)
    assert models(Context(tmp_path, quick=False, models=("nam56r",))) == ("nam56r",)


def test_the_upstream_ce_side_is_a_launcher_option_megatron_accepts(tmp_path: Path, megatron_built, capsys: pytest.CaptureFixture) -> None:
    """The microbatch suite's CE paths run in one build: the users' command with `--linear-ce chunked` adds patch
    0016's implementation flag, `--linear-ce logits` drops patch 0007's flag, and nam56r.training.launcher's parser and
    Megatron's accept each (dry run)."""
    from nam56r.training.launcher.train import main as train_main

    liger, chunked, upstream = CE_PATHS.values()
    for side, (options, fused, impl) in enumerate(((liger, True, False), (chunked, True, True), (upstream, False, False))):
        command = train_command("proxy", tmp_path / f"run-{side}", mbs=1, steps=3, options=options)
        assert train_main([*command[3:], "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert ("--fused-linear-cross-entropy " in out) is fused and ("--fused-linear-cross-entropy-impl" in out) is impl


def _runs_up_to(largest: int):
    def try_mbs(mbs: int) -> dict:
        tail = [] if mbs <= largest else ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
        return {"exit": 0 if mbs <= largest else 1, "summary": None, "first_step_s": None, "tail": tail}

    return try_mbs


@pytest.mark.parametrize("largest", [0, 1, 2, 3, 5, 8, 13])
def test_the_search_finds_the_largest_micro_batch_that_trains(largest: int) -> None:
    fits, tried = largest_micro_batch(_runs_up_to(largest))
    assert fits == largest
    assert all((mbs <= largest) == (t["exit"] == 0) for mbs, t in tried.items())
    assert largest == 0 or largest + 1 in tried  # the failure that bounds it was tried


def _runs_with_memory(base_gib: float, per_sample_gib: float, oom_from: int):
    """Tries whose peak grows linearly with the micro-batch, running out of memory from `oom_from` on."""

    def try_mbs(mbs: int) -> dict:
        if mbs >= oom_from:
            return {"exit": 1, "summary": None, "first_step_s": None, "tail": ["torch.OutOfMemoryError: CUDA out of memory."]}
        peak = base_gib + per_sample_gib * mbs
        summary = {"peak_memory": {"gib": peak, "bytes": int(peak * 2**30)},
                   "median_over_window": {"tokens_per_s_per_gpu": 1.0, "tflops_per_s_per_gpu": 1.0}}
        return {"exit": 0, "summary": summary, "first_step_s": 1.0, "tail": []}

    return try_mbs


def test_the_search_tries_the_micro_batch_the_memory_line_predicts() -> None:
    # 60 GiB + 9 GiB per sample on a 141 GiB GPU: 1 and 2 fit, the line predicts 8 (132 GiB), 9 (141 GiB) fails.
    fits, tried = largest_micro_batch(_runs_with_memory(60, 9, oom_from=9), capacity_gib=141)
    assert fits == 8 and sorted(tried) == [1, 2, 8, 9]
    # Doubling without a capacity takes more tries to the same answer.
    fits_doubling, tried_doubling = largest_micro_batch(_runs_with_memory(60, 9, oom_from=9))
    assert fits_doubling == 8 and len(tried_doubling) > len(tried)


@pytest.mark.parametrize("oom_from", [3, 5, 7, 12])
def test_a_wrong_prediction_still_ends_between_a_fit_and_a_failure(oom_from: int) -> None:
    """Memory that does not follow the line (fragmentation, a buffer that appears at some size): the prediction
    only picks the sizes tried; the answer is still the largest that trains, bounded by the next failing."""
    fits, tried = largest_micro_batch(_runs_with_memory(60, 9, oom_from=oom_from), capacity_gib=141)
    assert fits == oom_from - 1 and tried[oom_from]["exit"] == 1


def test_the_prediction_needs_two_fitting_tries_and_a_growing_peak() -> None:
    one = {1: {"exit": 0, "peak_memory_gib": 70.0}}
    assert predicted_largest(one, 141) is None
    assert predicted_largest({**one, 2: {"exit": 0, "peak_memory_gib": 79.0}}, None) is None
    assert predicted_largest({**one, 2: {"exit": 0, "peak_memory_gib": 70.0}}, 141) is None
    assert predicted_largest({**one, 2: {"exit": 0, "peak_memory_gib": 79.0}, 4: {"exit": 1, "error": "oom"}}, 141) == 8


def test_recompute_settings_run_through_the_launchers_option(tmp_path: Path, megatron_built, capsys: pytest.CaptureFixture) -> None:
    """`--recompute each` makes the training suites run every setting of RECOMPUTE_SETTINGS (the microbatch suite instead
    of its CE paths), each the users' command with the launcher's `--recompute`, which its parser and Megatron's accept."""
    from nam56r.training.launcher.train import main as train_main

    assert recompute_settings(Context(tmp_path, quick=False)) == ()
    assert microbatch_variants(Context(tmp_path, quick=False)) == CE_PATHS
    ctx = Context(tmp_path, quick=False, recompute=("each", "moe"))
    assert recompute_settings(ctx) == RECOMPUTE_SETTINGS and "none" in RECOMPUTE_SETTINGS
    variants = microbatch_variants(ctx)
    assert list(variants.values()) == [("--recompute", setting) for setting in RECOMPUTE_SETTINGS]
    expected = {"none": [], "mamba": [], "moe": ["moe"], "attention": ["core_attn", "mla_up_proj"]}
    for setting, modules in expected.items():
        command = train_command("proxy", tmp_path / setting, mbs=1, steps=3, options=variants[f"recompute {setting}"])
        assert train_main([*command[3:], "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"recompute {setting}" in out
        assert (f"--recompute-modules {' '.join(modules)} " in out) if modules else "--recompute-modules" not in out


def test_the_ce_paths_a_suite_runs_are_those_named(tmp_path: Path, megatron_built) -> None:
    """`--linear-ce PATH` (repeatable) picks the CE paths: the microbatch suite's subset of CE_PATHS (so a long comparison
    can run in parts), each recompute setting on each named path; the bench parser takes exactly the launcher's paths."""
    from typing import get_args

    from nam56r_bench.cli import _parser

    from nam56r.training.recipe_settings import LinearCE

    assert sorted(LINEAR_CE_PATHS) == sorted(get_args(LinearCE))
    assert _parser().parse_args(["--linear-ce", "logits", "--linear-ce", "chunked"]).linear_ce == ["logits", "chunked"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["--linear-ce", "cce"])
    picked = microbatch_variants(Context(tmp_path, quick=False, linear_ce=("logits",)))
    assert picked == {"upstream CE (logits + fp32 CE)": ("--linear-ce", "logits")}
    both = microbatch_variants(Context(tmp_path, quick=False, recompute=("moe",), linear_ce=("chunked", "logits")))
    assert list(both.values()) == [("--recompute", "moe", "--linear-ce", "chunked"), ("--recompute", "moe", "--linear-ce", "logits")]
    assert microbatch_variants(Context(tmp_path, quick=False, recompute=("moe",))) == {"recompute moe": ("--recompute", "moe")}


def test_milestones_are_read_from_megatrons_print_datetime_lines(megatron_built) -> None:
    """compile-tax and train-step split the time to the first step at Megatron's print_datetime milestones; the line
    format is the pinned print_datetime's, and the milestones are the ones its train() prints."""
    import inspect

    from megatron.training import training
    from nam56r_bench.training_suites import MILESTONE

    assert "f'[{string}] datetime: {time_str} '" in inspect.getsource(training.print_datetime)
    for what in ("after megatron is initialized", "after model, optimizer, and learning rate scheduler are built",
                 "after dataloaders are built"):
        assert what in inspect.getsource(training.pretrain).replace("' '", "")
        line = f"[default0]:[{what}] datetime: 2026-11-25 10:14:01.123456 "
        assert MILESTONE.search(line)["what"] == what
    assert MILESTONE.search("[before the start of training step] datetime: 2026-11-25 10:14:01.1 ") is None


def test_a_train_step_row_names_the_settings_its_run_trained_with(tmp_path: Path, megatron_built) -> None:
    """The recipe the launcher writes (here through its real `_write_run_files`) names the CE path, indexer and
    the rest, defaults included, so a row says which paths it measured."""
    from nam56r.training.launcher.flags import RunPaths
    from nam56r.training.launcher.train import _write_run_files
    from nam56r.training.recipe import get_recipe

    assert run_settings(tmp_path / "none") == {}
    recipe = get_recipe("proxy-1gpu", micro_batch=8, global_batch=8).on_backend("local")
    _write_run_files(RunPaths(tmp_path / "run", None, None), recipe.model_config("local"), recipe, "cmd")
    settings = run_settings(tmp_path / "run")
    assert settings["micro_batch"] == 8 and settings["linear_ce"] == recipe.kernels.linear_ce
    assert settings["dsa_indexer"] == "fused-tilelang-loss"
    assert settings["moe_dispatch"] == "fused-permute" and settings["index_cache"] is True
    assert settings["expert_activation"] == "fused" and settings["router_gating"] == recipe.kernels.router_gating == "fused"
    assert settings["moe_routing"] == recipe.kernels.moe_routing == "fused" and settings["residual_norm"] == "fused"
    assert settings["overlap_dp_comm"] is False and settings["moe_shared_expert_overlap"] is False
    assert set(settings) == {"micro_batch", "linear_ce", "dsa_indexer", "moe_dispatch", "expert_activation", "router_gating",
                             "moe_routing", "residual_norm", "index_cache", "recompute", "overlap_dp_comm",
                             "moe_shared_expert_overlap", "backend"}


def test_a_model_is_prewarmed_for_its_recipe_and_preset_through_the_prewarm_command_line() -> None:
    from nam56r.training.launcher.kernel_prewarm import build_parser

    for model, recipe, preset in (("proxy", "proxy-1gpu", None), ("nam56r", "h200x8-bf16", None), ("nam56r-2gpu", "h200x2-ep2", "nam56r"),
                                  ("nam56r-4gpu", "h200x8-bf16", None)):
        command = prewarm_command(model, (1, 2, 3, 4))
        assert command[1:3] == ["-m", "nam56r.training.launcher.kernel_prewarm"]
        args = build_parser().parse_args(command[3:])
        assert (args.recipe, args.model, args.mbs) == (recipe, preset, (1, 2, 3, 4))


def test_the_microbatch_search_prewarms_each_model_before_its_first_try(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nam56r_bench import training_suites
    from nam56r_bench.cli import _parser

    assert _parser().parse_args([]).prewarm_mbs == tuple(range(1, 17))
    assert _parser().parse_args(["--prewarm-mbs", "none"]).prewarm_mbs == ()
    events: list[tuple] = []
    monkeypatch.setattr(training_suites, "require_gpu", lambda suite: None)
    monkeypatch.setattr(training_suites, "require_gpus", lambda model: None)
    monkeypatch.setattr(training_suites, "gpu_capacity_gib", lambda: 140.0)
    monkeypatch.setattr(training_suites, "prewarm", lambda model, sizes: events.append(("prewarm", model, sizes)) or 12.5)
    try_mbs = _runs_up_to(0)
    monkeypatch.setattr(training_suites, "train", lambda model, run_dir, *, mbs, **kw: events.append(("train", model, mbs)) or try_mbs(mbs))
    ctx = Context(tmp_path, quick=False, models=("proxy",), linear_ce=("chunked", "logits"), prewarm_mbs=(1, 2))
    rows = training_suites.microbatch(ctx)
    assert events == [("prewarm", "proxy", (1, 2)), ("train", "proxy", 1), ("train", "proxy", 1)]
    assert [row.extra["prewarm"] for row in rows] == [{"micro_batches": [1, 2], "seconds": 12.5}] * 2
    events.clear()
    training_suites.microbatch(Context(tmp_path, quick=False, models=("proxy",), linear_ce=("chunked",)))
    assert [event[0] for event in events] == ["train"]


def test_a_bench_step_profiled_here_is_read_as_megatrons_traces_are() -> None:
    """`profile_step` writes its trace where `profile_breakdown` reads it, with ProfilerStep# annotations; on a CPU
    host the breakdown then finds no CUDA kernel and says so."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the kernels suite's profiled MoE row is the check")
    weight = torch.randn(32, 32, requires_grad=True)
    with pytest.raises(BenchError, match="holds no CUDA kernel"):
        profile_step(lambda: (weight @ weight).sum().backward())


def test_train_step_prewarms_the_sizes_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nam56r_bench import training_suites

    events: list[tuple] = []
    monkeypatch.setattr(training_suites, "require_gpu", lambda suite: None)
    monkeypatch.setattr(training_suites, "require_gpus", lambda model: None)
    monkeypatch.setattr(training_suites, "gemm_peak_tflops", lambda: 780.0)
    monkeypatch.setattr(training_suites, "prewarm", lambda model, sizes: events.append(("prewarm", model, sizes)) or 1.0)
    monkeypatch.setattr(training_suites, "_train_step_row", lambda model, mbs, *a, **kw: events.append(("train", model, mbs)))
    training_suites.train_step(Context(tmp_path, quick=True, models=("proxy",), micro_batches=(2, 4), prewarm_mbs=(1, 2)))
    assert events == [("prewarm", "proxy", (2, 4)), ("train", "proxy", 2), ("train", "proxy", 4)]
    events.clear()
    training_suites.train_step(Context(tmp_path, quick=True, models=("proxy",), micro_batches=(2,)))  # --prewarm-mbs none
    training_suites.train_step(Context(tmp_path, quick=True, models=("proxy",), prewarm_mbs=(1, 2)))  # the recipe's size
    assert events == [("train", "proxy", 2), ("train", "proxy", None)]


def test_a_failed_run_names_the_exception_a_rank_raised_not_torchruns_summary(tmp_path: Path, monkeypatch) -> None:
    """Real torchrun, two ranks, each raising torch's out-of-memory error: the log's last 40 lines are torchrun's
    ChildFailedError traceback and summary, and the cause is still the ranks' exception."""
    from nam56r_bench import training_suites

    script = tmp_path / "fails.py"
    script.write_text("import torch\nprint('step 1', flush=True)\n"
                      "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 8.00 GiB')\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "--log-dir",
               str(tmp_path / "logs"), "--tee", "3", str(script)]
    monkeypatch.setattr(training_suites, "train_command", lambda *args, **kwargs: command)
    result = training_suites.train("proxy", tmp_path / "run", mbs=1, steps=1)
    assert result["exit"] != 0 and result["summary"] is None
    assert not any("OutOfMemoryError" in line for line in result["tail"][-15:])  # torchrun's summary fills the tail
    assert result["cause"].endswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB")
    assert result["cause"].startswith("[default")
    assert failure_reason(result) == result["cause"]
    assert try_outcome(result)["error"] == result["cause"]
    assert failure_reason({"tail": ["a", "b"]}) == "a\nb"


def test_a_launcher_refusal_before_any_rank_runs_is_the_cause(tmp_path: Path) -> None:
    """The real launcher on a host without a GPU refuses at its preflight with `error: ...` (exit 2): that line is the
    cause, as a rank's exception would be."""
    from nam56r_bench import training_suites

    result = training_suites.train("tiny", tmp_path / "run", mbs=1, steps=2)

    assert result["exit"] == 2 and result["first_step_s"] is None
    assert result["cause"] == "error: preflight failed; fix the checks above (the command is printed for reference)"
    refused = training_suites.train("tiny", tmp_path / "run1", mbs=1, steps=1)  # the recipe's own check: warm-up 1
    assert refused["cause"] == "error: recipe 'tiny-1gpu':\n  - warmup_steps 1 must be below steps 1 (set it with --warmup)"


def test_a_bare_assertion_a_rank_raised_is_the_cause_and_the_ranks_last_lines_come_next(tmp_path: Path, monkeypatch) -> None:
    """Real torchrun, two ranks failing an `assert` with no message (Megatron's buffers hold such asserts): the rank's
    'AssertionError' line, with nothing after the name, is the cause. Without any exception line, the ranks' own last
    lines, not torchrun's summary, say why."""
    from nam56r_bench import training_suites

    script = tmp_path / "fails.py"
    script.write_text("print('bucket ready', flush=True)\nhandle = None\nassert handle is not None\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "--log-dir",
               str(tmp_path / "logs"), "--tee", "3", str(script)]
    monkeypatch.setattr(training_suites, "train_command", lambda *args, **kwargs: command)
    result = training_suites.train("proxy", tmp_path / "run", mbs=1, steps=1)
    assert result["exit"] != 0 and result["cause"].startswith("[default") and result["cause"].endswith("AssertionError")
    assert any(line.endswith("bucket ready") for line in result["rank_tail"])
    rank_lines = ["[default0]:[rank0]: bucket 3 not ready", "[default1]:[rank1]: bucket 3 not ready"]
    assert failure_reason({"cause": None, "tail": ["torchrun summary"], "rank_tail": rank_lines}) == "\n".join(rank_lines)


def test_train_step_runs_each_train_args_entry_through_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     megatron_built, capsys: pytest.CaptureFixture) -> None:
    """`--train-args '' --train-args '--overlap-dp-comm on --moe-shared-expert-overlap on'`: one row each, before and
    after in one run, each the users' command with those launcher options, which lower to Megatron's overlap flags and
    pass Megatron's parser and config checks at 2 ranks."""
    from nam56r_bench import training_suites
    from nam56r_bench.cli import _parser

    from nam56r.training.launcher.train import main as train_main

    calls: list[tuple[str, ...]] = []

    def fake_train(recipe, run_dir, *, mbs, steps, options=(), extra=()):
        calls.append(options)
        return {"exit": 1, "summary": None, "first_step_s": None, "milestones_s": {}, "startup_s": {}, "tail": ["x"], "cause": None}

    monkeypatch.setattr(training_suites, "train", fake_train)
    monkeypatch.setattr(training_suites, "gemm_peak_tflops", lambda: 700.0)
    monkeypatch.setattr(training_suites, "require_gpu", lambda suite: None)
    monkeypatch.setattr(training_suites, "require_gpus", lambda recipe: None)
    args = _parser().parse_args(["train-step", "--train-args", "", "--train-args", "--overlap-dp-comm on  --moe-shared-expert-overlap on"])
    assert args.train_args == ["", "--overlap-dp-comm on --moe-shared-expert-overlap on"]
    ctx = Context(tmp_path, quick=True, models=("nam56r-2gpu",), micro_batches=(4,), recompute=("moe",), train_args=tuple(args.train_args))
    rows = training_suites.train_step(ctx)
    assert [row.case for row in rows] == ["nam56r-2gpu 2 GPUs mbs 4 recompute moe",
                                          "nam56r-2gpu 2 GPUs mbs 4 recompute moe --overlap-dp-comm on --moe-shared-expert-overlap on"]
    assert calls == [("--recompute", "moe"), ("--recompute", "moe", "--overlap-dp-comm", "on", "--moe-shared-expert-overlap", "on")]
    for name, options in zip(("before", "after"), calls, strict=True):
        command = train_command("nam56r-2gpu", tmp_path / name, mbs=4, steps=3, options=options)
        assert train_main([*command[3:], "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "validated by Megatron's parser as 2 rank(s)" in out
        on = name == "after"
        assert f"overlap-dp-comm {'on' if on else 'off'}, moe-shared-expert-overlap {'on' if on else 'off'}" in out
        assert ("--overlap-grad-reduce --moe-shared-expert-overlap" in out) == on and "--overlap-param-gather" not in out


def test_train_args_that_do_not_split_or_name_the_suites_own_options_are_refused(capsys: pytest.CaptureFixture) -> None:
    from nam56r_bench.cli import _parser

    for bad, why in (("--overlap-dp-comm 'on", "No closing quotation"), ("--mbs 8", "--mbs is the suite's own option")):
        with pytest.raises(SystemExit):
            _parser().parse_args(["train-step", "--train-args", bad])
        assert why in capsys.readouterr().err
