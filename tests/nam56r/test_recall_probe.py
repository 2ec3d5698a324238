"""The indexer recall probe in a run: its schedule through our forward step and loss function at Megatron's
step (first micro-batch of step 1 and every N steps, nothing in evaluation), Megatron's reduction of the
report into the logged value, the launcher flag and the refusals, TensorBoard events to summary.json's
'indexer_recall' series, and the comparison plot of two runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nam56r.training.recall_probe import RECALL_KEY, IndexerRecallProbe, RecallSchedule
from tests.nam56r.test_indexer_recall import SEQ, recall_config
from tests.nam56r.test_runlog import PNG_SIGNATURE, WORLD, write_megatron_events


def test_schedule_is_step_one_and_every_interval() -> None:
    assert [s for s in range(1, 13) if RecallSchedule(4).probes(s)] == [1, 4, 8, 12]
    assert not any(RecallSchedule(0).probes(s) for s in range(1, 50))
    assert RecallSchedule(-1).problems() == [
        "indexer_recall_interval must be >= 0 (0: no recall probe), got -1 (set it with --indexer-recall-interval)"]
    assert RecallSchedule(0).problems(pp=2, cuda_graphs=True) == []
    assert len(RecallSchedule(5).problems(pp=2, tp=2, cp=2, cuda_graphs=True)) == 4


class ModelChunk(torch.nn.Module):
    """Stands in for the model chunk Megatron hands the forward step (Mamba-3 needs a GPU for a whole model):
    its real DSA layers run on fixed hidden states; the per-token losses are zeros."""

    def __init__(self, built) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(built.layers.values())
        self.topk_cache = built.topk_cache
        hidden = self.layers[0].config.hidden_size
        self.hidden = torch.randn(SEQ, 2, hidden, generator=torch.Generator().manual_seed(0))

    def forward(self, tokens, position_ids, attention_mask, *, labels, loss_mask):
        from nam56r.model.model import cuda_buffers_on

        self.topk_cache.begin_forward()
        with cuda_buffers_on("cpu"), torch.no_grad():
            h = self.hidden
            for layer in self.layers:
                out = layer(h, attention_mask=None)
                h = out[0] if isinstance(out, tuple) else out
        return torch.zeros_like(tokens, dtype=torch.float32)


@pytest.fixture(scope="module")
def chunk(megatron_built) -> ModelChunk:
    from nam56r.model.model import build_dsa_layers

    return ModelChunk(build_dsa_layers(recall_config(), "local"))


def _steps(chunk: ModelChunk, monkeypatch, probe: IndexerRecallProbe, steps: range, micro_batches: int) -> dict[int, list]:
    """Megatron's train loop over `steps`: per step, each micro-batch's forward step and loss function; the
    'indexer recall' reports of each step, in micro-batch order (None: the report has no such key)."""
    from megatron.training import global_vars

    from nam56r.training.launcher.pretrain import forward_step

    args = SimpleNamespace(save=None, nam56r_nonfinite_loss_at_step=None, curr_iteration=0)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    batch = {k: torch.ones(2, SEQ, dtype=torch.long) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    reports = {}
    for step in steps:
        args.curr_iteration = step - 1
        reports[step] = []
        for _ in range(micro_batches):
            output, loss_fn = forward_step(iter([batch]), chunk, recall_probe=probe)
            reports[step].append(loss_fn(output)[2].get(RECALL_KEY))
    return reports


def megatron_reduced(reports: list[torch.Tensor]) -> float:
    """What Megatron's train_step logs for a two-element report key (megatron/training/training.py, 'Average
    loss across microbatches'): the micro-batches' [numerator, denominator] summed, then divided."""
    val = torch.vstack([r.view(-1) for r in reports]).sum(dim=0)
    return float(val[0] / val[1])


def test_the_probe_measures_the_first_micro_batch_of_probe_steps_only(chunk, monkeypatch) -> None:
    logs: list[str] = []
    probe = IndexerRecallProbe(RecallSchedule(3), log=logs.append)
    chunk.train()
    reports = _steps(chunk, monkeypatch, probe, range(1, 8), micro_batches=2)
    measured = {step: [bool(r[1] > 0) for r in per_step] for step, per_step in reports.items()}
    first_only, none = [True, False], [False, False]
    assert measured == {1: first_only, 2: none, 3: first_only, 4: none, 5: none, 6: first_only, 7: none}
    assert all(float(r[1]) == 2 * SEQ for step in (1, 3, 6) for r in reports[step][:1])
    assert all(torch.equal(r, torch.zeros(2)) for per_step in reports.values() for r in per_step if not r[1])
    logged = {step: megatron_reduced(per_step) for step, per_step in reports.items()}
    assert all(0 < logged[s] < 1 for s in (1, 3, 6)) and all(math.isnan(logged[s]) for s in (2, 4, 5, 7))
    assert logged[1] == logged[3] == logged[6]  # the same layer on the same hidden states each time
    assert logs == [f"indexer recall: DSA layer 5, top-k 16, on the first micro-batch of step 1 and every 3 steps "
                    f"(logged as {RECALL_KEY!r})"]


def test_evaluation_and_a_run_without_the_probe_report_no_recall(chunk, monkeypatch) -> None:
    chunk.eval()
    try:
        evaluated = _steps(chunk, monkeypatch, IndexerRecallProbe(RecallSchedule(1)), range(1, 3), micro_batches=2)
    finally:
        chunk.train()
    assert all(r is None for per_step in evaluated.values() for r in per_step)
    off = _steps(chunk, monkeypatch, None, range(1, 3), micro_batches=1)
    assert all(r is None for per_step in off.values() for r in per_step)


def test_an_armed_layer_that_does_not_run_is_an_error(chunk) -> None:
    from nam56r.training.recall_probe import RecallReport

    chunk.train()
    report = IndexerRecallProbe(RecallSchedule(1)).begin_micro_batch(chunk, step=1)
    assert isinstance(report, RecallReport) and report.hook is not None
    with pytest.raises(RuntimeError, match="armed on DSA layer 5, which did not run in this micro-batch's forward"):
        report.loss_report(torch.device("cpu"))


def test_a_model_without_a_computing_dsa_layer_is_refused(megatron_built) -> None:
    from nam56r.training.recall_probe import probed_layer

    with pytest.raises(RuntimeError, match="no DSA layer computing its own top-k"):
        probed_layer(torch.nn.Linear(2, 2))


# ---- flags, recipe and launcher


def test_the_launcher_flag_reaches_megatrons_parser_and_is_refused_where_it_cannot_run(megatron_built, capsys) -> None:
    from nam56r.training.launcher.flags import megatron_flags, megatron_validate
    from nam56r.training.launcher.pretrain import recall_probe_from_args
    from nam56r.training.launcher.train import main as train_main
    from nam56r.training.recipe import RecipeError, get_recipe
    from tests.nam56r.test_dsa_phases import DATA, RUN

    recipe = get_recipe("tiny-1gpu", indexer_recall_interval=10)
    argv = megatron_flags(recipe, recipe.model_config(), DATA, RUN, "local")
    assert argv[argv.index("--nam56r-indexer-recall-interval") + 1] == "10"
    args = megatron_validate(argv, world_size=1)
    assert args.nam56r_indexer_recall_interval == 10 and recall_probe_from_args(args).schedule == RecallSchedule(10)
    assert recall_probe_from_args(SimpleNamespace(**{**vars(args), "nam56r_indexer_recall_interval": 0})) is None
    with pytest.raises(SystemExit, match="needs pipeline parallel 1, got 2"):
        recall_probe_from_args(SimpleNamespace(**{**vars(args), "pipeline_model_parallel_size": 2}))
    with pytest.raises(RecipeError, match="needs pipeline parallel 1, got 2"):
        get_recipe("tiny-1gpu", indexer_recall_interval=10, pp=2)
    with pytest.raises(SystemExit):
        train_main(["--help"])
    assert "--indexer-recall-interval N" in capsys.readouterr().out
    assert train_main(["--recipe", "tiny-1gpu", "--indexer-recall-interval", "-2", "--dry-run"]) == 2
    assert "indexer_recall_interval must be >= 0" in capsys.readouterr().err


# ---- summary.json's series and the comparison plot


def write_run(run_dir: Path, recall: dict[int, float] | None, warmup: int) -> Path:
    """A run folder as nam56r.training.launcher leaves it, summarized: Megatron's scalars, and 'indexer recall' as
    Megatron logs it (0/0 = NaN at steps without a measurement)."""
    from torch.utils.tensorboard import SummaryWriter

    from nam56r.training.runs.summary import summarize_run

    write_megatron_events(run_dir / "tensorboard", range(1, 31))
    if recall is not None:
        writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        for step in range(1, 31):
            writer.add_scalar(RECALL_KEY, recall.get(step, math.nan), step)
        writer.close()
    recipe = {"phases": {"dsa": {"dense_warmup_steps": warmup}}, "parallel": {"nodes": 1, "gpus_per_node": WORLD}}
    (run_dir / "recipe.json").write_text(json.dumps(recipe))
    preset = recall_config()
    summarize_run(run_dir / "tensorboard", preset, SEQ, WORLD, run_dir)
    return run_dir / "summary.json"


def test_summary_series_hold_every_loss_and_the_measured_recalls(tmp_path) -> None:
    recall = {1: 0.06, 10: 0.4, 20: 0.55, 30: 0.61}
    summary = json.loads(write_run(tmp_path / "a", recall, warmup=5).read_text())
    assert summary["series"]["indexer_recall"] == [[step, pytest.approx(value)] for step, value in recall.items()]
    assert [step for step, _ in summary["series"]["lm_loss"]] == list(range(1, 31))
    bare = json.loads(write_run(tmp_path / "b", None, warmup=0).read_text())
    assert bare["series"]["indexer_recall"] == []


def test_compare_runs_plots_two_runs_and_names_what_is_missing(tmp_path) -> None:
    from nam56r.training.runs.compare import read_run

    warm = write_run(tmp_path / "warm", {1: 0.1, 10: 0.7, 20: 0.8}, warmup=5)
    cold = write_run(tmp_path / "cold", {1: 0.1, 10: 0.3, 20: 0.5}, warmup=0)
    assert read_run(warm, "w").dense_warmup_steps == 5 and read_run(cold, "c").indexer_recall[1] == (10, pytest.approx(0.3))
    out = tmp_path / "compare.png"
    command = [sys.executable, "-m", "nam56r.training.runs.compare", str(warm), str(cold), "--out", str(out)]
    proc = subprocess.run([*command, "--labels", "dense warm-up 5", "no warm-up"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert "lm loss of no warm-up minus dense warm-up 5: mean +0.0000 ± 0.0000 (standard error) over steps 16-30" in proc.stdout
    wrong = subprocess.run([*command, "--labels", "one"], capture_output=True, text=True)
    assert wrong.returncode == 1 and "1 labels for 2 runs" in wrong.stderr
    old = tmp_path / "old" / "summary.json"
    old.parent.mkdir()
    old.write_text(json.dumps({k: v for k, v in json.loads(warm.read_text()).items() if k != "series"}))
    stale = subprocess.run([sys.executable, "-m", "nam56r.training.runs.compare", str(old), str(cold), "--out", str(out)],
                           capture_output=True, text=True)
    assert stale.returncode == 1 and "has no per-step series" in stale.stderr


def test_the_log_lines_of_a_killed_run_give_the_recall_of_probe_steps() -> None:
    """Lines as Megatron's training_log formats them at --log-interval 1: ' {key}: {:.6E} |' for each report key
    whose mean is >= 0, so a step between probes (0/0 = NaN) prints no 'indexer recall'."""
    from nam56r.training.runs.events import logged_loss_curve

    def line(step: int, recall: float) -> str:
        keys = (("lm loss", 5.0 - step / 10), (RECALL_KEY, recall), ("indexer loss", 0.5))
        fields = f" iteration {step:8d}/{20:8d} | learning rate: {1e-3:.6E} |" + "".join(f" {k}: {v:.6E} |" for k, v in keys if v >= 0.0)
        return f"[default0]: [2026-11-23 22:04:14.123456]{fields}"

    text = "\n".join(line(step, 0.1 * step if step % 3 == 0 else math.nan) for step in range(1, 10))
    assert logged_loss_curve(text, RECALL_KEY) == [(3, pytest.approx(0.3)), (6, pytest.approx(0.6)), (9, pytest.approx(0.9))]
    assert [step for step, _ in logged_loss_curve(text)] == list(range(1, 10))


def test_the_loss_difference_pairs_steps_and_its_summary_is_the_second_half() -> None:
    from nam56r.training.runs.compare import RunCurves, loss_difference, moving_mean, summarize_difference

    base = RunCurves("a", [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0), (5, 2.0)], [], None)
    other = RunCurves("b", [(2, 4.5), (3, 3.1), (4, 2.3), (5, 2.1), (6, 9.9)], [], None)  # step 6: the base has none
    difference = loss_difference(base, other)
    assert difference == [(2, pytest.approx(0.5)), (3, pytest.approx(0.1)), (4, pytest.approx(0.3)), (5, pytest.approx(0.1))]
    assert moving_mean(difference, 2) == [(3, pytest.approx(0.3)), (4, pytest.approx(0.2)), (5, pytest.approx(0.2))]
    summary = summarize_difference(difference)
    assert (summary.first_step, summary.last_step, summary.mean) == (4, 5, pytest.approx(0.2))
    assert summary.standard_error == pytest.approx(0.1)  # sample sd 0.1414 over sqrt(2)
    assert summarize_difference(difference[:2]) is None
