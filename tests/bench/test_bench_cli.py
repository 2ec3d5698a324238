"""`python -m nam56r_bench`: the suite list, GPU suites refusing on a CPU host, unknown names refused, and the
tooling suite end to end (a real fresh-clone build)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_model_option_takes_only_the_training_suites_models() -> None:
    proc = bench("--model", "full", "microbatch")
    assert proc.returncode == 2 and "invalid choice: 'full'" in proc.stderr
