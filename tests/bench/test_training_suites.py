"""nam56r_bench.training_suites: the users' training command each run takes, the models a suite runs, what a
micro-batch try reports, and the top kernels read from profiler traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from nam56r_bench.harness import Context
from nam56r_bench.training_suites import CE_PATHS, _attempt, largest_micro_batch, models, top_kernels, train_command

ROOT = Path(__file__).resolve().parents[2]


def test_top_kernels_sums_cuda_kernel_time_across_traces(tmp_path: Path) -> None:
    def trace(name: str, events: list[dict], zipped: bool) -> None:
        payload = json.dumps({"traceEvents": events})
        path = tmp_path / "tb" / name
        path.parent.mkdir(exist_ok=True)
        if zipped:
            with gzip.open(path, "wt") as f:
                f.write(payload)
        else:
            path.write_text(payload)

    trace("a.pt.trace.json", [{"cat": "kernel", "name": "gemm", "dur": 300}, {"cat": "cpu_op", "name": "aten::mm", "dur": 900},
                              {"cat": "kernel", "name": "softmax", "dur": 100}], zipped=False)
    trace("b.pt.trace.json.gz", [{"cat": "kernel", "name": "gemm", "dur": 200}, {"cat": "kernel", "name": "copy", "dur": 50}], zipped=True)
    top = top_kernels(tmp_path, count=2)
    assert [(k["kernel"], k["total_ms"], k["calls"]) for k in top] == [("gemm", 0.5, 2), ("softmax", 0.1, 1)]
    assert abs(top[0]["share"] - 500 / 650) < 1e-9


@pytest.mark.parametrize("recipe", ["proxy", "nam56r"])
def test_bench_training_runs_save_no_checkpoint(recipe: str, tmp_path: Path, megatron_built, capsys: pytest.CaptureFixture) -> None:
    """Each bench run is the users' command, which nam56r.training.train's own parser and Megatron's accept
    (dry run); it saves nothing (a proxy checkpoint takes about 44 GiB, several would fill a node's disk)."""
    from nam56r.training.train import main as train_main

    command = train_command(recipe, tmp_path / "run", mbs=2, steps=3)
    assert command[1:3] == ["-m", "nam56r.training.train"]
    assert train_main([*command[3:], "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: none (--no-save)" in out
    assert "--micro-batch-size 2 " in out and "--global-batch-size 2 " in out and "--save " not in out


def test_a_micro_batch_try_reads_a_real_run_summary() -> None:
    summary = json.loads((ROOT / "docs" / "train" / "proxy-1gpu-h200.json").read_text())
    tried = _attempt({"exit": 0, "summary": summary, "first_step_s": 202.0, "tail": []})
    assert tried == {"exit": 0, "peak_memory_gib": summary["peak_memory"]["gib"],
                     "tflops_per_s_per_gpu": summary["median_over_window"]["tflops_per_s_per_gpu"], "first_step_s": 202.0}
    assert 60 < tried["peak_memory_gib"] < 70


def test_a_micro_batch_try_that_ran_out_of_memory_says_so() -> None:
    tail = ["[default0]: step 1", "[default0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB", "exit"]
    assert _attempt({"exit": 1, "summary": None, "first_step_s": None, "tail": tail}) == {
        "exit": 1, "error": "[default0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"}


def test_model_option_picks_the_training_suites_models(tmp_path: Path) -> None:
    assert models(Context(tmp_path, quick=False)) == ("proxy", "nam56r")
    assert models(Context(tmp_path, quick=True)) == ("proxy",)
    assert models(Context(tmp_path, quick=False, models=("nam56r",))) == ("nam56r",)


def test_the_upstream_ce_side_is_a_launcher_option_megatron_accepts(tmp_path: Path, megatron_built, capsys: pytest.CaptureFixture) -> None:
    """The microbatch suite's two CE paths run in one build: the users' command with `--fused-linear-ce off`
    drops patch 0007's flag, and nam56r.training.train's parser and Megatron's accept it (dry run)."""
    from nam56r.training.train import main as train_main

    fused, upstream = CE_PATHS.values()
    for options, flagged in ((fused, True), (upstream, False)):
        command = train_command("proxy", tmp_path / f"run-{flagged}", mbs=1, steps=3, options=options)
        assert train_main([*command[3:], "--dry-run"]) == 0
        assert ("--fused-linear-cross-entropy" in capsys.readouterr().out) is flagged


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
