"""nam56r.training.runs.summary on TensorBoard events written with Megatron's own tag names (torch's
SummaryWriter, as Megatron's writer): per-step metrics, window medians, the plot, errors."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from nam56r.model.flops import FORMULA, flops_per_token
from nam56r.model.presets import get_preset
from nam56r.training.runs.events import MissingTagError, compare_loss_curves, logged_loss_curve, loss_curve
from nam56r.training.runs.summary import DEFAULT_WINDOW, choose_window, summarize_run

SEQ, BATCH, WORLD = 64, 16, 2
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def iteration_time(step: int) -> float:
    """Slow warm-up steps, then a steady time that still varies, so a median is a real test."""
    return 5.0 if step < 3 else 0.5 + 0.01 * (step % 7)


def lm_loss(step: int) -> float:
    return 10.0 / (1 + 0.1 * step)


def write_megatron_events(directory: Path, steps: range, *, skip: tuple[str, ...] = (), log_interval: int = 1) -> None:
    """Scalars as Megatron's training_log writes them: losses, batch size, world size, memory at
    every step; iteration time (and Megatron's throughput) at log-interval steps, not the first."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    samples = 0

    def add(tag: str, value: float, step: int) -> None:
        if tag not in skip:
            writer.add_scalar(tag, value, step)

    for step in steps:
        samples += BATCH
        add("learning-rate", 1e-4 * min(1.0, step / 5), step)
        add("learning-rate vs samples", 1e-4, samples)  # keyed by samples: must not join the step rows
        add("batch-size", BATCH, step)
        add("lm loss", lm_loss(step), step)
        add("lm loss vs samples", lm_loss(step), samples)
        add("mtp_1 loss", lm_loss(step) + 0.5, step)
        add("loss-scale", 1.0, step)
        add("world-size", WORLD, step)
        add("grad-norm", 1.0 + 0.01 * step, step)
        add("mem-max-allocated-bytes", 2**30 * (10 + (step % 4)), step)
        if step > 1 and step % log_interval == 0:
            add("iteration-time", iteration_time(step), step)
            add("throughput", 123.0, step)
        if step % 10 == 0:
            add("lm loss validation", lm_loss(step) + 0.1, step)
            add("lm loss validation ppl", 2.0, step)
    writer.close()


@pytest.fixture(scope="module")
def tiny():
    return get_preset("nam56r-tiny")


def test_metrics_have_every_value_and_throughput_from_the_iteration_time(tmp_path, tiny) -> None:
    write_megatron_events(tmp_path / "tb", range(1, 31))
    summary = summarize_run(tmp_path / "tb", tiny, SEQ, WORLD, tmp_path / "out")
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))  # no '... vs samples' steps joined in
    assert not any(key.endswith("vs samples") for r in rows for key in r)
    per_token = flops_per_token(tiny, SEQ).total
    for row in rows:
        step = row["step"]
        assert row["lm loss"] == pytest.approx(lm_loss(step))
        assert row["mtp_1 loss"] == pytest.approx(lm_loss(step) + 0.5)
        assert row["batch-size"] == BATCH and row["world-size"] == WORLD
        assert row["mem-max-allocated-bytes"] == 2**30 * (10 + step % 4)
        if step == 1:  # Megatron writes no iteration time at the first iteration
            assert "iteration-time" not in row and "tokens_per_s_per_gpu" not in row
            continue
        seconds = iteration_time(step)
        assert row["iteration-time"] == pytest.approx(seconds)
        assert row["tokens_per_s_per_gpu"] == pytest.approx(BATCH * SEQ / seconds / WORLD)
        assert row["tflops_per_s_per_gpu"] == pytest.approx(per_token * SEQ * BATCH / seconds / WORLD / 1e12)
    assert rows[9]["lm loss validation"] == pytest.approx(lm_loss(10) + 0.1)
    assert summary.files["metrics"].endswith("metrics.jsonl")


def test_summary_medians_over_the_stated_window(tmp_path, tiny) -> None:
    write_megatron_events(tmp_path, range(1, 41))
    summary = summarize_run(tmp_path, tiny, SEQ, WORLD, tmp_path)
    first, last = DEFAULT_WINDOW
    window_times = [iteration_time(s) for s in range(first, last + 1)]
    assert (summary.window.first_step, summary.window.last_step, summary.window.steps) == (3, 25, 23)
    assert summary.iteration_time_s == pytest.approx(statistics.median(window_times))
    assert summary.tokens_per_s_per_gpu == pytest.approx(statistics.median(BATCH * SEQ / t / WORLD for t in window_times))
    # the warm-up steps (5 s) would drag a whole-run mean down; the window excludes them
    assert summary.iteration_time_s < 1.0
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["window"]["rule"].startswith("iterations 3..25 of the run")
    assert written["median_over_window"]["iteration_time_s"] == pytest.approx(statistics.median(window_times))
    assert written["median_over_window"]["megatron_throughput_tflops_per_s_per_gpu"] == 123.0
    assert written["peak_memory"]["bytes"] == 2**30 * 13
    assert written["flop_formula"] == FORMULA
    lm = {"first_step": 1, "first": pytest.approx(lm_loss(1)), "last_step": 40, "last": pytest.approx(lm_loss(40))}
    assert written["losses"]["lm loss"] == lm
    assert "loss-scale" not in written["losses"] and "lm loss validation ppl" not in written["losses"]
    assert written["losses"]["lm loss validation"]["last_step"] == 40


def test_short_run_uses_its_last_80_percent(tmp_path, tiny) -> None:
    write_megatron_events(tmp_path, range(1, 12))  # timed steps 2..11: 10 of them
    summary = summarize_run(tmp_path, tiny, SEQ, WORLD, tmp_path)
    assert (summary.window.first_step, summary.window.last_step, summary.window.steps) == (4, 11, 8)
    assert "last 80% of the 10 timed steps" in summary.window.rule and "not reached step 25" in summary.window.rule
    assert summary.iteration_time_s == pytest.approx(statistics.median(iteration_time(s) for s in range(4, 12)))


def test_window_counts_from_the_first_logged_step_of_a_resumed_run() -> None:
    window = choose_window(list(range(1002, 1051)), first_step=1001)
    assert (window.first_step, window.last_step) == (1003, 1025)


def test_plot_is_a_real_png(tmp_path, tiny) -> None:
    write_megatron_events(tmp_path, range(1, 31))
    summarize_run(tmp_path, tiny, SEQ, WORLD, tmp_path / "out")
    data = (tmp_path / "out" / "loss_throughput.png").read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 20_000  # two panels with curves, not an empty canvas


@pytest.mark.parametrize("tag", ["iteration-time", "lm loss", "batch-size"])
def test_missing_required_tag_names_the_tag_and_the_directory(tmp_path, tiny, tag) -> None:
    write_megatron_events(tmp_path, range(1, 8), skip=(tag,))
    with pytest.raises(MissingTagError, match=f"no '{tag}' scalar") as caught:
        summarize_run(tmp_path, tiny, SEQ, WORLD, tmp_path)
    assert caught.value.tag == tag and str(tmp_path) in str(caught.value)
    if tag == "iteration-time":
        assert "--log-timers-to-tensorboard" in str(caught.value)


def test_missing_event_files_name_the_directory(tmp_path, tiny) -> None:
    with pytest.raises(FileNotFoundError, match=f"no TensorBoard event files .* in {tmp_path}"):
        summarize_run(tmp_path, tiny, SEQ, WORLD, tmp_path)


def test_world_size_disagreeing_with_the_logged_one_is_refused(tmp_path, tiny) -> None:
    write_megatron_events(tmp_path, range(1, 8))
    with pytest.raises(ValueError, match=r"logged world-size \[2\], but world_size=8"):
        summarize_run(tmp_path, tiny, SEQ, 8, tmp_path)


def test_compare_loss_curves_for_a_resume(tmp_path) -> None:
    write_megatron_events(tmp_path / "full", range(1, 21))
    write_megatron_events(tmp_path / "resumed", range(11, 21))
    full, resumed = loss_curve(tmp_path / "full"), loss_curve(tmp_path / "resumed")
    assert compare_loss_curves(full, resumed, range(11, 21)) == 0.0
    shifted = [(s, v + (0.25 if s == 15 else 0.0)) for s, v in resumed]
    assert compare_loss_curves(full, shifted, range(11, 21)) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="step 5 is missing from curve b"):
        compare_loss_curves(full, resumed, range(5, 21))
    with pytest.raises(ValueError, match="non-finite loss nan at step 12"):
        compare_loss_curves(full, [(12, float("nan"))], [12])
    with pytest.raises(ValueError, match="no steps"):
        compare_loss_curves(full, resumed, [])


def test_cli_summarizes_a_run_folder(tmp_path) -> None:
    write_megatron_events(tmp_path / "tensorboard", range(1, 31))
    proc = subprocess.run(
        [sys.executable, "-m", "nam56r.training.runs.summarize", str(tmp_path), "--preset", "nam56r-tiny", "--seq", str(SEQ),
         "--world-size", str(WORLD)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "window: iterations 3..25" in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"metrics.jsonl", "summary.json", "loss_throughput.png"}
    missing = subprocess.run(
        [sys.executable, "-m", "nam56r.training.runs.summarize", str(tmp_path / "nothing"), "--preset", "nam56r-tiny", "--world-size", "1"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_cli_reads_the_model_and_world_size_a_train_run_recorded(tmp_path) -> None:
    """A run of nam56r.training.launcher records its exact model (here IndexCache off, unlike the tiny preset)
    and its recipe: the CLI uses them, so the FLOP count is the trained model's, not the preset's."""
    from dataclasses import replace

    from nam56r.model.flops import flops_per_token
    from nam56r.model.presets import get_preset

    preset = get_preset("nam56r-tiny")
    trained = replace(preset, seq_length=SEQ, index_cache=replace(preset.index_cache, enabled=False))
    assert flops_per_token(trained, SEQ).total != flops_per_token(replace(preset, seq_length=SEQ), SEQ).total
    write_megatron_events(tmp_path / "tensorboard", range(1, 31))
    (tmp_path / "model_config.json").write_text(json.dumps(trained.to_dict()))
    (tmp_path / "recipe.json").write_text(json.dumps({"parallel": {"nodes": 1, "gpus_per_node": WORLD}}))
    proc = subprocess.run([sys.executable, "-m", "nam56r.training.runs.summarize", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == WORLD and summary["seq_length"] == SEQ
    assert summary["flops_per_token"] == pytest.approx(flops_per_token(trained, SEQ).total)
    wrong = subprocess.run([sys.executable, "-m", "nam56r.training.runs.summarize", str(tmp_path), "--preset", "nam56r"],
                           capture_output=True, text=True)
    assert wrong.returncode == 1 and "disagrees with" in wrong.stderr
    bare = subprocess.run([sys.executable, "-m", "nam56r.training.runs.summarize", str(tmp_path / "tensorboard")],
                          capture_output=True, text=True)
    assert bare.returncode == 1 and "pass --preset" in bare.stderr


def test_logged_loss_curve_reads_megatrons_iteration_lines_with_rank_prefixes() -> None:
    """Lines as megatron.training.training_log formats them (' iteration {:8d}/{:8d} |', ' {key}: {:.6E} |'),
    behind torchrun's rank prefix; other losses and a non-finite loss are read as they stand."""
    def line(step: int, loss: float) -> str:
        fields = f" iteration {step:8d}/{20:8d} |" + f" learning rate: {1e-3:.6E} |"
        fields += "".join(f" {k}: {v:.6E} |" for k, v in (("mtp_1 loss", loss + 1), ("lm loss", loss), ("indexer loss", 0.5)))
        return f"[default0]: [2026-11-23 22:04:14.123456]{fields}"

    text = "\n".join([line(7, 5.4321), "[default0]: some other line | lm loss: 1.0 |", line(8, float("nan"))])

    curve = logged_loss_curve(text)

    assert [step for step, _ in curve] == [7, 8] and curve[0][1] == pytest.approx(5.4321)
    assert curve[1][1] != curve[1][1]  # nan
