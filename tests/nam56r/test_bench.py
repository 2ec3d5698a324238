"""nam56r_bench: the suite list, GPU suites refusing on a CPU host, the tooling suite end to end (a real
fresh-clone build), and the pieces the GPU suites report with (ratios, plots, profiler traces)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nam56r_bench.harness import Row, ratios, write_suite
from nam56r_bench.suites import SUITES

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nam56r_bench", *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_list_shows_every_suite_and_what_it_needs() -> None:
    proc = bench("--list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["tooling", "kernels", "train-step", "microbatch", "compile-tax"]
    assert "[CPU]" in lines[0] and all("[GPU]" in line for line in lines[1:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-host behaviour")
def test_a_named_gpu_suite_on_a_cpu_host_is_an_error_naming_it() -> None:
    proc = bench("kernels", "--out", "/nonexistent")
    assert proc.returncode == 2
    assert "suite(s) kernels need a CUDA GPU" in proc.stderr


def test_unknown_suite_is_refused_with_the_known_ones() -> None:
    proc = bench("kernel")
    assert proc.returncode == 2 and "unknown suite(s): kernel; known: tooling, kernels" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-host behaviour")
def test_default_run_on_a_cpu_host_runs_tooling_and_says_what_it_did_not_run(tmp_path: Path) -> None:
    from nam56r_patchlane.artifacts import default_cache_dir

    cache = tmp_path / "artifacts"
    default_cache_dir().mkdir(parents=True, exist_ok=True)
    cache.symlink_to(default_cache_dir(), target_is_directory=True)  # --cache names the cache; its warm content is reused
    proc = bench("--out", str(tmp_path), "--quick", "--cache", str(cache))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"cache fill {cache} --artifacts-only" in proc.stdout and f"--cache {cache} --offline build" in proc.stdout
    for name in ("kernels", "train-step", "microbatch", "compile-tax"):
        assert f"{name}: not run, needs a CUDA GPU" in proc.stdout
    result = json.loads((tmp_path / "tooling.json").read_text())
    assert (tmp_path / "tooling.png").stat().st_size > 0
    assert result["host"]["gpu"] == "cpu" and len(result["host"]["commit"]) == 40
    assert set(result["host"]["upstreams"]) == {"megatron-lm", "mamba", "liger-kernel", "tilelang"}
    cases = {row["case"]: row for row in result["rows"]}
    assert set(cases) == {"cache fill", "materialize + apply 4 series", "no-op rebuild"}
    # A no-op rebuild must be far cheaper than materializing and applying four series.
    assert cases["no-op rebuild"]["time_ms"] < cases["materialize + apply 4 series"]["time_ms"]


def test_ratios_compare_each_candidate_with_the_fastest_baseline() -> None:
    rows = [
        Row("dsa", "upstream einsum", time_ms=50.0, peak_extra_bytes=32 << 30),
        Row("dsa", "upstream tilelang", time_ms=20.0, peak_extra_bytes=1 << 30),
        Row("dsa", "upstream broken", extra={"error": "out of memory"}),
        Row("dsa", "fused", time_ms=4.0, peak_extra_bytes=1 << 29),
        Row("ngram", "reference", time_ms=3.0, peak_extra_bytes=300),
        Row("ngram", "fused", time_ms=1.0, peak_extra_bytes=100),
        Row("alone", "fused", time_ms=1.0),
    ]
    got = {r["case"]: r for r in ratios(rows)}
    assert got["dsa"] == {"case": "dsa", "variant": "fused", "against": "upstream tilelang", "speedup": 5.0, "memory_ratio": 2.0}
    assert got["ngram"]["speedup"] == 3.0 and got["ngram"]["memory_ratio"] == 3.0
    assert "alone" not in got  # no baseline measured, no ratio invented


def test_write_suite_stamps_and_plots(tmp_path: Path) -> None:
    from nam56r_bench.harness import Context

    rows = [Row("a", "reference", time_ms=2.0, peak_extra_bytes=2 << 30), Row("a", "fused", time_ms=1.0, max_error=1e-6)]
    host = {"gpu": "NVIDIA H100", "commit": "0" * 40}
    path = write_suite(SUITES["kernels"], rows, Context(tmp_path, quick=True), host, 1.5)
    result = json.loads(path.read_text())
    assert result["suite"] == "kernels" and result["host"] == host and result["ratios"][0]["speedup"] == 2.0
    assert (tmp_path / "kernels.png").read_bytes()[:4] == b"\x89PNG"


def test_top_kernels_sums_cuda_kernel_time_across_traces(tmp_path: Path) -> None:
    from nam56r_bench.training import top_kernels

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
    from nam56r_bench.training import train_command

    from nam56r.training.train import main as train_main

    command = train_command(recipe, tmp_path / "run", mbs=2, steps=3)
    assert command[1:3] == ["-m", "nam56r.training.train"]
    assert train_main([*command[3:], "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: none (--no-save)" in out
    assert "--micro-batch-size 2 " in out and "--global-batch-size 2 " in out and "--save " not in out


def test_a_micro_batch_try_reads_a_real_run_summary() -> None:
    from nam56r_bench.training import _attempt

    summary = json.loads((ROOT / "docs" / "train" / "proxy-1gpu-h200.json").read_text())
    tried = _attempt({"exit": 0, "summary": summary, "first_step_s": 202.0, "tail": []})
    assert tried == {"exit": 0, "peak_memory_gib": summary["peak_memory"]["gib"],
                     "tflops_per_s_per_gpu": summary["median_over_window"]["tflops_per_s_per_gpu"], "first_step_s": 202.0}
    assert 60 < tried["peak_memory_gib"] < 70


def test_a_micro_batch_try_that_ran_out_of_memory_says_so() -> None:
    from nam56r_bench.training import _attempt

    tail = ["[default0]: step 1", "[default0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB", "exit"]
    assert _attempt({"exit": 1, "summary": None, "first_step_s": None, "tail": tail}) == {
        "exit": 1, "error": "[default0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"}


def test_model_option_picks_the_training_suites_models(tmp_path: Path) -> None:
    from nam56r_bench.harness import Context
    from nam56r_bench.training import models

    assert models(Context(tmp_path, quick=False)) == ("proxy", "nam56r")
    assert models(Context(tmp_path, quick=True)) == ("proxy",)
    assert models(Context(tmp_path, quick=False, models=("nam56r",))) == ("nam56r",)
    proc = bench("--model", "full", "microbatch")
    assert proc.returncode == 2 and "invalid choice: 'full'" in proc.stderr


def test_bench_results_carry_the_manifests_host_stamp() -> None:
    from dataclasses import asdict

    from nam56r_bench.harness import stamp
    from nam56r_patchlane.manifest import host_stamp

    host = stamp()
    assert {key: host[key] for key in asdict(host_stamp(sys.executable))} == asdict(host_stamp(sys.executable))
    assert len(host["commit"]) == 40 and set(host["upstreams"]) == {"megatron-lm", "mamba", "liger-kernel", "tilelang"}
