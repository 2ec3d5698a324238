"""nam56r_bench.plots: each suite's PNG drawn from the committed JSONs (and a synthetic microbatch result), and the
figures the training-suite plots write beside their bars."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from nam56r_bench import plots
from nam56r_bench.plots import (
    FIRST_STEP_PHASE,
    ORIGINAL_LABEL,
    ORIGINAL_TFLOPS,
    PHASES,
    REST_OF_STEP_PHASE,
    WHOLE_PHASE,
    first_step_segments,
    kernel_shares,
    microbatch_bars,
    phase_color,
    render,
    short_kernel_name,
    step_bars,
    wrap_label,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bench"
PNG = b"\x89PNG\r\n\x1a\n"


def _committed(name: str) -> dict[str, Any]:
    return json.loads((DOCS / f"{name}.json").read_text())


def _microbatch_result() -> dict[str, Any]:
    """A microbatch suite's JSON as written: `tried`'s micro-batches become string keys."""
    def fits(gib: float, tflops: float) -> dict[str, Any]:
        return {"exit": 0, "peak_memory_gib": gib, "tflops_per_s_per_gpu": tflops, "first_step_s": 60.0}

    oom = {"exit": 1, "error": "torch.OutOfMemoryError: CUDA out of memory"}
    rows = [
        {"case": "proxy seq 4096", "variant": "Liger fused linear CE (patches 0007/0008)",
         "extra": {"largest_micro_batch": 12, "tried": {1: fits(60.1, 128.0), 2: fits(70.0, 180.0), 4: fits(80.0, 250.0),
                                                         8: fits(114.2, 313.9), 16: oom, 12: fits(131.5, 320.2), 14: oom, 13: oom}}},
        {"case": "proxy seq 4096", "variant": "upstream CE (logits + fp32 CE)",
         "extra": {"largest_micro_batch": 4, "tried": {1: fits(70.1, 120.0), 2: fits(90.0, 200.0), 4: fits(125.0, 240.0),
                                                        8: oom, 6: oom, 5: oom}}},
        {"case": "nam56r seq 4096", "variant": "upstream CE (logits + fp32 CE)", "extra": {"largest_micro_batch": 0, "tried": {1: oom}}},
    ]
    result = {"suite": "microbatch", "host": {"gpu": "NVIDIA H200", "commit": "0" * 40}, "ratios": [],
              "rows": [{"time_ms": None, "peak_extra_bytes": None, "max_error": None, **row} for row in rows]}
    return json.loads(json.dumps(result))


@pytest.mark.parametrize(
    "name", ["train-step", "train-step-2gpu", "compile-tax", "kernels", "tooling", "microbatch", "microbatch-recompute"])
def test_each_committed_suite_json_draws_a_png(tmp_path: Path, name: str) -> None:
    render(_committed(name), tmp_path / f"{name}.png")
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG


def test_a_synthetic_microbatch_json_draws_a_png(tmp_path: Path) -> None:
    render(_microbatch_result(), tmp_path / "microbatch.png")
    assert (tmp_path / "microbatch.png").read_bytes()[:8] == PNG


def test_render_picks_each_training_suites_plot_and_falls_back_to_grouped_bars(tmp_path: Path, monkeypatch) -> None:
    drawn: list[str] = []
    for suite in ("train-step", "compile-tax", "microbatch"):
        monkeypatch.setitem(plots.SUITE_PLOTS, suite, lambda rows, title, path, suite=suite: drawn.append(suite))
    monkeypatch.setattr(plots, "_plot_rows", lambda rows, title, path: drawn.append("rows"))
    for suite in ("train-step", "compile-tax", "microbatch", "tooling"):
        render({"suite": suite, "host": {"gpu": "g", "commit": "c"}, "rows": [], "ratios": []}, tmp_path / "x.png")
    assert drawn == ["train-step", "compile-tax", "microbatch", "rows"]


def test_long_labels_wrap_at_60_characters() -> None:
    case = "dsa layers fwd+bwd seq4096 mb1, IndexCache 1 Full + 2 Shared: fused top-k + sparse loss"
    label = wrap_label(case, "vs upstream (Megatron's indexer, dsa_kernel_backend=tilelang)")
    assert max(len(line) for line in label.splitlines()) <= 60 and len(label.splitlines()) == 4
    assert label.replace("\n", " ").startswith(case)


def test_train_step_bars_carry_throughput_mfu_and_peak_memory() -> None:
    bars = step_bars(_committed("train-step")["rows"])
    assert [b.label for b in bars] == ["proxy 1 GPU mbs 8", "proxy 1 GPU mbs 11"]
    assert round(bars[0].tflops, 1) == 403.5 and round(bars[0].peak_gib, 1) == 111.6 and round(bars[1].peak_gib, 1) == 131.9
    assert bars[0].annotation() == "403.5 TFLOP/s/GPU · MFU 52.9% of 763 (bf16 GEMM peak)"
    assert bars[1].annotation() == "400.6 TFLOP/s/GPU · MFU 52.5% of 763 (bf16 GEMM peak)"


def test_a_train_step_row_without_figures_reads_error() -> None:
    rows = [{"case": "nam56r 1 GPU", "variant": "patched", "time_ms": None, "peak_extra_bytes": None,
             "extra": {"exit": 1, "error": "torch.OutOfMemoryError"}}]
    (bar,) = step_bars(rows)
    assert bar.tflops is None and bar.peak_gib is None and bar.annotation() == "error (exit 1)"


def test_the_train_step_plot_draws_the_original_stacks_reference_line(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.axes import Axes

    lines: list[tuple[float, str | None]] = []
    real_axvline = Axes.axvline

    def axvline(self, x=0, *args, **kwargs):
        lines.append((x, kwargs.get("label")))
        return real_axvline(self, x, *args, **kwargs)

    monkeypatch.setattr(Axes, "axvline", axvline)
    render(_committed("train-step"), tmp_path / "train-step.png")
    assert lines == [(ORIGINAL_TFLOPS, f"{ORIGINAL_LABEL}: 289 TFLOP/s/GPU")]


def test_kernel_shares_come_from_the_fastest_profiled_row() -> None:
    rows = _committed("train-step-2gpu")["rows"]
    assert rows[0]["extra"]["profile"]["top_kernels"]  # the first row is profiled, and slower
    shares = kernel_shares(rows)
    fastest = "nam56r-2gpu 2 GPUs mbs 4 recompute moe --moe-shared-expert-overlap on"
    assert shares is not None and shares.case == fastest and round(shares.step_ms) == 2235
    assert len(shares.kernels) == 10
    assert shares.kernels[0] == ("mamba_mimo_bwd_bwd_kernel_kernel", pytest.approx(0.114813, abs=1e-5))
    assert all(len(name) <= 50 for name, _ in shares.kernels)
    assert shares.idle == pytest.approx(0.050213, abs=1e-6)
    profile = {"top_kernels": [{"kernel": "k", "share_of_step": 1.0}]}
    failed = {"case": "failed", "extra": {"tflops_per_s_per_gpu": None, "profile": profile}}
    assert kernel_shares([failed, *rows]).case == shares.case
    assert kernel_shares([{"case": "unprofiled", "extra": {}}]) is None


def test_short_kernel_names_drop_void_and_namespaces_and_cut_at_50() -> None:
    name = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<1>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<c10::BFloat16>>")
    short = short_kernel_name(name)
    assert short == "multi_tensor_apply_kernel<TensorListMetadata<1>, …" and len(short) == 50
    assert short_kernel_name("mamba_mimo_bwd_bwd_kernel_kernel") == "mamba_mimo_bwd_bwd_kernel_kernel"


UP_TO_INITIALIZED = " + ".join(phase for phase, _ in PHASES[:4])  # launch to the end of initialize_megatron


def test_compile_tax_segments_split_the_first_step_time_at_megatrons_milestones() -> None:
    """The committed rows split at every startup mark; without the marks (an older launcher) they split at Megatron's
    milestones alone."""
    cold, warm = _committed("compile-tax")["rows"]
    assert [phase for phase, _ in first_step_segments(cold)] == [phase for phase, _ in PHASES] + [REST_OF_STEP_PHASE]
    assert [round(s, 1) for _, s in first_step_segments(warm)] == [7.1, 17.4, 0.0, 4.2, 2.7, 4.2, 4.1]
    for row in (cold, warm):
        assert sum(s for _, s in first_step_segments(row)) == pytest.approx(row["time_ms"] / 1e3)
        marks_only = {**row, "extra": {k: v for k, v in row["extra"].items() if k != "startup_s"}}
        built = PHASES[4][0]
        assert [phase for phase, _ in first_step_segments(marks_only)] == [UP_TO_INITIALIZED, built, FIRST_STEP_PHASE]
        assert sum(s for _, s in first_step_segments(marks_only)) == pytest.approx(row["time_ms"] / 1e3)
    assert [round(s, 1) for _, s in first_step_segments({**cold, "extra": {"milestones_s": cold["extra"]["milestones_s"]}})] == [
        26.2, 2.2, 188.7]


def test_compile_tax_segments_split_at_the_startup_marks_too() -> None:
    """A row with the launcher's and rank 0's startup marks: every phase its own segment, the first step split at
    its first forward; the colours follow the phases."""
    startup = {"rank 0 process started": 1.5, "rank 0 imported torch, Megatron and NAM56R's modules": 14.0,
               "rank 0 passed the launch gate": 15.0, "first micro-batch: forward returned (host; its kernels compiled or loaded)": 30.0}
    milestones = {"after megatron is initialized": 19.0, "after model, optimizer, and learning rate scheduler are built": 21.0}
    row = {"time_ms": 33_000.0, "extra": {"milestones_s": milestones, "startup_s": startup}}
    segments = first_step_segments(row)
    assert segments == [(phase, seconds) for (phase, _), seconds in zip(PHASES, (1.5, 12.5, 1.0, 4.0, 2.0, 9.0), strict=True)] + [
        (REST_OF_STEP_PHASE, 3.0)]
    assert len({phase_color(phase) for phase, _ in segments[:-1]}) == len(PHASES)
    assert phase_color(UP_TO_INITIALIZED) == phase_color(PHASES[3][0])


def test_compile_tax_segments_without_milestones_or_without_a_step() -> None:
    assert first_step_segments({"time_ms": 30_000.0, "extra": {"exit": 0}}) == [(WHOLE_PHASE, 30.0)]
    assert first_step_segments({"time_ms": None, "extra": {"exit": 3, "milestones_s": {"after megatron is initialized": 5.0}}}) == []
    late = {"time_ms": 10_000.0, "extra": {"milestones_s": {"after megatron is initialized": 4.0, "after dataloaders are built": 12.0}}}
    # a milestone logged after the first step is not a phase before it
    assert first_step_segments(late) == [(UP_TO_INITIALIZED, 4.0), (FIRST_STEP_PHASE, 6.0)]


def test_microbatch_bars_annotate_the_largest_fitting_try_and_the_first_failure() -> None:
    bars = microbatch_bars(_microbatch_result()["rows"])
    assert [(b.largest, b.peak_gib, b.tflops, b.first_failure) for b in bars] == [
        (12, 131.5, 320.2, 13), (4, 125.0, 240.0, 5), (0, None, None, 1)]
    assert bars[0].label == "proxy seq 4096\nLiger fused linear CE (patches 0007/0008)"
    assert bars[0].annotation() == "mbs 12 · peak 131.5 GiB, 320.2 TFLOP/s/GPU · mbs 13 fails"
    assert bars[2].annotation() == "nothing trains · mbs 1 fails"
    int_keys = [{"case": "c", "variant": "v", "extra": {"largest_micro_batch": 2, "tried": {2: {"exit": 0, "peak_memory_gib": 1.0,
                                                                                                "tflops_per_s_per_gpu": 2.0}}}}]
    assert microbatch_bars(int_keys)[0].annotation() == "mbs 2 · peak 1.0 GiB, 2.0 TFLOP/s/GPU"
