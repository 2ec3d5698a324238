"""The compile-tax suite: per model, a run with an empty kernel cache, then one with that cache carried to another path;
a cold run that fills nothing leaves the carried row empty, naming why; a run that fails measured nothing and fails the
suite."""

from __future__ import annotations

from pathlib import Path

import pytest
from nam56r_bench import compile_tax_suite
from nam56r_bench.harness import BenchError, Context

from nam56r.training.launcher import kernel_cache as kc

KEY = kc.CacheKey(gpu="NVIDIA H200", capability="9.0", driver="580.159.04", cuda="13.0", python="3.12.3",
                  torch="2.11.0+cu130", triton="3.6.0", tilelang="0.1.8", tilelang_lib="libtilelang.so:1:2")


def _fake_train(calls: list[tuple[str, Path]], fill: bool, fails: bool = False):
    def train(model: str, run_dir: Path, *, mbs: int, steps: int, options: tuple[str, ...]) -> dict:
        cache = Path(options[options.index("--kernel-cache") + 1])
        calls.append((model, cache))
        if fill:
            kc.open_cache(cache, KEY)
        return {"exit": 2 if fails else 0, "wall_s": 1.0, "first_step_s": None if fails else 30.0, "milestones_s": {},
                "startup_s": {}, "cause": "error: boom" if fails else None, "tail": ["error: boom"] if fails else []}
    return train


def test_each_model_runs_cold_then_with_the_cache_carried_elsewhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[str, Path]] = []
    monkeypatch.setattr(compile_tax_suite, "require_gpu", lambda name: None)
    monkeypatch.setattr(compile_tax_suite, "train", _fake_train(calls, fill=True))
    rows = compile_tax_suite.compile_tax(Context(tmp_path, quick=False))
    assert [(r.case, r.variant) for r in rows] == [
        ("tiny mbs 8 time to first step", "no kernel cache"), ("tiny mbs 8 time to first step", "kernel cache carried"),
        ("proxy mbs 8 time to first step", "no kernel cache"), ("proxy mbs 8 time to first step", "kernel cache carried")]
    assert [model for model, _ in calls] == ["tiny", "tiny", "proxy", "proxy"]
    cold, carried = calls[0][1], calls[1][1]
    assert cold != carried and cold.name == carried.name == "kernel-cache"
    assert rows[1].time_ms == 30_000.0 and rows[1].extra["kernel_cache"]["weight"].endswith("MiB")


def test_a_cold_run_that_fills_nothing_leaves_the_carried_row_empty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[str, Path]] = []
    monkeypatch.setattr(compile_tax_suite, "require_gpu", lambda name: None)
    monkeypatch.setattr(compile_tax_suite, "train", _fake_train(calls, fill=False))
    rows = compile_tax_suite.compile_tax(Context(tmp_path, quick=False, models=("tiny",)))
    assert len(calls) == 1 and rows[0].time_ms == 30_000.0
    assert rows[1].time_ms is None and rows[1].extra["cause"] == "the run without a cache filled none to carry"


def test_a_run_that_fails_before_its_first_step_fails_the_suite_naming_why(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    monkeypatch.setattr(compile_tax_suite, "require_gpu", lambda name: None)
    monkeypatch.setattr(compile_tax_suite, "train", _fake_train([], fill=True, fails=True))
    with pytest.raises(BenchError, match="tiny mbs 8, no kernel cache: the training run exited 2 before its first step: error: boom"):
        compile_tax_suite.compile_tax(Context(tmp_path, quick=False))
