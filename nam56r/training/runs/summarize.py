"""Summarize a run: its per-step metrics, steady-state summary and loss/throughput plot
(`nam56r.training.runs.summary`), and with `--record` its train record in patches/manifest.toml
(`nam56r.training.runs.record`).

    python -m nam56r.training.runs.summarize RUN_DIR          # a launcher run: its model_config.json and recipe.json
    python -m nam56r.training.runs.summarize RUN_DIR --preset nam56r --seq 4096 --world-size 8
    python -m nam56r.training.runs.summarize RUN_DIR --record

Works on a run in progress (it reads what has been flushed). Writes `metrics.jsonl`, `summary.json` and
`loss_throughput.png` next to the events unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nam56r.model.config import ModelConfig
from nam56r.model.reference import ReferenceConfig, model_from_dict
from nam56r.training.runs.events import LOSS_TAG, PEAK_MEMORY_TAG
from nam56r.training.runs.layout import RunDir
from nam56r.training.runs.plot import format_tflops
from nam56r.training.runs.record import ROOT, append_train_record
from nam56r.training.runs.summary import DEFAULT_WINDOW, resolve_tensorboard_dir, summarize_run


def _run_model_and_world(run_dir: Path, preset: str | None, world_size: int | None) -> tuple[ModelConfig | ReferenceConfig, int]:
    """The model a run trained and its GPU count. A run started by nam56r.training.launcher records both
    (model_config.json: the exact config, IndexCache and sequence length included, or a reference GPT's; recipe.json);
    a preset stands in only where the run has no model_config.json."""
    from nam56r.model.presets import get_preset

    layout = RunDir(run_dir)
    model_file, recipe_file = layout.model_config, layout.recipe
    if model_file.is_file():
        config = model_from_dict(json.loads(model_file.read_text()))
        if preset is not None and preset != config.name:
            raise ValueError(f"--preset {preset} disagrees with {model_file}, which trained {config.name}")
    elif preset is not None:
        config = get_preset(preset)
    else:
        raise ValueError(f"{run_dir} has no model_config.json: pass --preset")
    if world_size is None:
        if not recipe_file.is_file():
            raise ValueError(f"{run_dir} has no recipe.json: pass --world-size")
        from nam56r.training.recipe import settings_of

        settings = settings_of(json.loads(recipe_file.read_text()), ("nodes", "gpus_per_node"))
        world_size = settings["nodes"] * settings["gpus_per_node"]
    return config, world_size


def main(argv: list[str] | None = None) -> int:
    from nam56r.model.presets import PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m nam56r.training.runs.summarize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="the run folder (its tensorboard/ is read) or a TensorBoard folder")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="the model preset the run trains (default: the run's model_config.json, written by nam56r.training.launcher)",
    )
    parser.add_argument("--seq", type=int, help="sequence length (default: the model config's)")
    parser.add_argument("--world-size", type=int, help="GPUs of the run (default: from the run's recipe.json)")
    parser.add_argument("--out", type=Path, help="where to write metrics.jsonl, summary.json and the plot (default: RUN_DIR)")
    parser.add_argument("--record", action="store_true", help="then append the run's train record to patches/manifest.toml")
    parser.add_argument("--root", type=Path, help="with --record: the checkout whose patches/manifest.toml gets it (default: this one)")
    parser.add_argument(
        "--window",
        type=int,
        nargs=2,
        metavar=("FIRST", "LAST"),
        default=DEFAULT_WINDOW,
        help="steady-state iterations of the run (default: 3 25)",
    )
    args = parser.parse_args(argv)
    try:
        config, world_size = _run_model_and_world(args.run_dir, args.preset, args.world_size)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    seq = args.seq if args.seq is not None else config.seq_length
    tensorboard_dir = resolve_tensorboard_dir(args.run_dir)
    try:
        summary = summarize_run(tensorboard_dir, config, seq, world_size, args.out or args.run_dir, window=tuple(args.window))
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    lm = summary.losses.get(LOSS_TAG, {})
    memory = f"{summary.peak_memory_bytes / 2**30:.2f} GiB" if summary.peak_memory_bytes is not None else f"not logged ({PEAK_MEMORY_TAG})"
    print(f"run {tensorboard_dir}: steps {summary.first_step}..{summary.last_step}, {summary.preset}, seq {seq}, {summary.world_size} GPUs")
    print(f"window: {summary.window.rule}")
    print(f"median iteration time {summary.iteration_time_s:.3f} s, global batch {summary.global_batch_size}")
    tflops = format_tflops(summary.tflops_per_s_per_gpu)
    print(f"median tokens/s/GPU {summary.tokens_per_s_per_gpu:,.0f}, TFLOP/s/GPU {tflops} ({summary.formula})")
    print(f"peak memory {memory}")
    print(f"lm loss {lm.get('first')} (step {lm.get('first_step')}) -> {lm.get('last')} (step {lm.get('last_step')})")
    print("wrote " + ", ".join(summary.files.values()))
    if args.record:
        try:
            record, path = append_train_record(args.run_dir, args.root or ROOT, Path(summary.files["summary"]))
        except (FileNotFoundError, ValueError) as error:
            print(f"error: not recorded: {error}", file=sys.stderr)
            return 1
        print(f"appended to {path}: {record.what} ({record.figures})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
