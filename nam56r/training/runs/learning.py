"""Learning against independent yardsticks: NAM56R's runs, its reference model's runs and the data's count baselines,
as validation LM loss against tokens in one plot and one JSON.

    python -m nam56r.training.runs.learning --arm nam56r-tiny=runs/t1,runs/t2 --arm reference=runs/r1,runs/r2 \\
        --versus reference --baselines data/pinned-v512/baselines.json --out docs/train/learning-tiny-h200.png

Each run directory holds the launcher's summary.json (its per-step 'lm loss' and 'lm loss validation'), recipe and
command. Tokens are steps x global batch x sequence length. The verdicts:
- an arm beats the bigram baseline when every run's last validation loss is below it;
- each arm against `--versus` at the last evaluation both reached (equal tokens): the difference of the arms' mean
  validation loss with its 95 % interval from the spread between runs of one arm (nam56r.training.runs.arms), so at
  least one arm needs two runs. "below" when the interval lies under 0, "above" when over it, else "not shown apart".
The baselines must be of the split the runs evaluated on: each run's --valid-data-path is read and checked against the
baselines' valid sha256 (its tokens must be on this machine; --no-data-check skips that, and the JSON says so).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from nam56r.training.runs.arms import ArmStats, compare_arms, parse_arm
from nam56r.training.runs.layout import RunDir

SCHEMA = "nam56r.learning/1"


@dataclass(frozen=True)
class LearningRun:
    label: str  # the run directory
    preset: str
    tokens_per_step: int
    train: tuple[tuple[int, float], ...]  # (step, lm loss)
    valid: tuple[tuple[int, float], ...]  # (step, lm loss validation)
    valid_prefix: str | None  # the run's --valid-data-path


@dataclass(frozen=True)
class ArmVerdict:
    name: str
    runs: tuple[str, ...]
    last_step: int  # the last evaluation every run of the arm reached
    tokens: int
    last_valid: tuple[float, ...]
    beats_bigram: bool


@dataclass(frozen=True)
class VersusVerdict:
    arm: str
    versus: str
    tokens: int
    difference: float  # the arm's mean validation loss minus the other's
    low: float
    high: float
    pooled_sd: float
    verdict: str  # "below" | "above" | "not shown apart"


def read_learning_run(run_dir: Path) -> LearningRun:
    """A run's curves and token count per step; ValueError naming the file when something is missing."""
    layout = RunDir(run_dir)
    if not layout.summary.is_file():
        raise ValueError(f"{layout.summary} is missing: summarize the run (python -m nam56r.training.runs.summarize {run_dir})")
    summary = json.loads(layout.summary.read_text())
    series = summary.get("series") or {}
    if "lm_loss_validation" not in series:
        raise ValueError(f"{layout.summary} has no validation series: rewrite it with "
                         f"`python -m nam56r.training.runs.summarize {run_dir}`")
    batch = (summary.get("median_over_window") or {}).get("global_batch_size")
    if not batch or not summary.get("seq_length"):
        raise ValueError(f"{layout.summary} names no global batch size or sequence length")
    valid = tuple((int(s), float(v)) for s, v in series["lm_loss_validation"] if v is not None)
    if not valid:
        raise ValueError(f"{run_dir}: the run logged no validation loss (--eval-interval beyond its steps?)")
    return LearningRun(str(run_dir), summary.get("preset", "?"), int(batch) * int(summary["seq_length"]),
                       tuple((int(s), float(v)) for s, v in series.get("lm_loss", []) if v is not None), valid,
                       _valid_prefix(layout.command))


def _valid_prefix(command_file: Path) -> str | None:
    if not command_file.is_file():
        return None
    words = shlex.split(command_file.read_text())
    return words[words.index("--valid-data-path") + 1] if "--valid-data-path" in words[:-1] else None


def check_valid_split(run: LearningRun, valid_sha256: str) -> None:
    """Raises unless the run evaluated on the split the baselines scored (the sha256 of its tokens)."""
    if run.valid_prefix is None:
        raise ValueError(f"{run.label}: its command names no --valid-data-path")
    if not Path(run.valid_prefix + ".bin").is_file():
        raise ValueError(f"{run.label} evaluated on {run.valid_prefix}, which is not on this machine: check the split "
                         "here, or pass --no-data-check")
    digest = _split_sha256(run.valid_prefix)
    if digest != valid_sha256:
        raise ValueError(f"{run.label} evaluated on {run.valid_prefix} (sha256 {digest[:12]}), not the split the baselines "
                         f"scored ({valid_sha256[:12]})")


@functools.cache
def _split_sha256(prefix: str) -> str:
    """Once per split: the runs of a comparison usually share one."""
    from nam56r.training.data.baselines import tokens_sha256
    from nam56r.training.data.format import open_tokens

    return tokens_sha256(open_tokens(Path(prefix))[1])


def arm_verdict(name: str, runs: list[LearningRun], bigram: float) -> ArmVerdict:
    last = min(run.valid[-1][0] for run in runs)
    values = tuple(dict(run.valid).get(last, math.nan) for run in runs)
    if any(math.isnan(v) for v in values):
        raise ValueError(f"arm {name}: its runs did not all evaluate at step {last}: give them the same --eval-interval")
    tokens = {run.tokens_per_step * last for run in runs}
    if len(tokens) > 1:
        raise ValueError(f"arm {name}: its runs consumed different tokens by step {last} ({sorted(tokens)})")
    return ArmVerdict(name, tuple(run.label for run in runs), last, tokens.pop(), values, all(v < bigram for v in values))


def versus_verdicts(arms: dict[str, list[LearningRun]], versus: str) -> list[VersusVerdict]:
    """Each arm against `versus` at the most tokens both arms' runs were evaluated at."""
    if versus not in arms:
        raise ValueError(f"--versus {versus!r} is not one of the arms {sorted(arms)}")
    verdicts = []
    for name in (n for n in arms if n != versus):
        shared = set.intersection(*({run.tokens_per_step * s for s, _ in run.valid} for run in arms[name] + arms[versus]))
        if not shared:
            raise ValueError(f"{name} and {versus} were never evaluated at equal tokens: align --eval-interval and the batch")
        tokens = max(shared)
        stats = [_stats(arm, arms[arm], tokens) for arm in (name, versus)]
        (difference,) = compare_arms(stats, versus)
        verdict = "below" if difference.high < 0 else "above" if difference.low > 0 else "not shown apart"
        verdicts.append(VersusVerdict(name, versus, tokens, difference.difference, difference.low, difference.high,
                                      difference.pooled_sd, verdict))
    return verdicts


def _stats(name: str, runs: list[LearningRun], tokens: int) -> ArmStats:
    values = tuple(next(v for s, v in run.valid if run.tokens_per_step * s == tokens) for run in runs)
    return ArmStats(name, tuple(run.label for run in runs), values, statistics.fmean(values),
                    statistics.stdev(values) if len(values) > 1 else None)


def plot(arms: dict[str, list[LearningRun]], baselines: dict, path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    for (name, runs), color in zip(arms.items(), colors * 4, strict=False):
        for index, run in enumerate(runs):
            label = name if index == 0 else None
            axes.plot([run.tokens_per_step * s / 1e6 for s, _ in run.train], [v for _, v in run.train], color=color,
                      alpha=0.25, linewidth=0.8)
            axes.plot([run.tokens_per_step * s / 1e6 for s, _ in run.valid], [v for _, v in run.valid], color=color,
                      marker="o", markersize=3, linewidth=1.4, label=f"{label} (validation; training faint)" if label else None)
    for key, style in (("unigram_nats", ":"), ("bigram_nats", "--")):
        axes.axhline(baselines[key], color="black", linestyle=style, linewidth=1,
                     label=f"{key.split('_')[0]} baseline {baselines[key]:.3f}")
    finals = [v for runs in arms.values() for run in runs for _, v in run.valid]
    axes.set_ylim(min(finals + [baselines["bigram_nats"]]) - 0.3, baselines["unigram_nats"] + 1.0)
    axes.set_xlabel("tokens (millions)")
    axes.set_ylabel("LM loss (nats/token)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nam56r.training.runs.learning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", type=parse_arm, action="append", required=True, metavar="NAME=RUN_DIR[,RUN_DIR...]",
                        help="one arm: its name and its runs' directories (repeatable)")
    parser.add_argument("--versus", help="the arm the others are compared with at equal tokens (e.g. the reference)")
    parser.add_argument("--baselines", type=Path, required=True, help="the data's baselines.json (`nox -s data -- baselines DIR`)")
    parser.add_argument("--out", type=Path, required=True, help="the plot (PNG); the JSON goes beside it")
    parser.add_argument("--title", default="validation LM loss against tokens")
    parser.add_argument("--no-data-check", action="store_true",
                        help="do not check that the runs evaluated on the split the baselines scored")
    args = parser.parse_args(argv)
    try:
        baselines = json.loads(args.baselines.read_text())
        arms = {name: [read_learning_run(path) for path in paths] for name, paths in args.arm}
        if not args.no_data_check:
            for run in (run for runs in arms.values() for run in runs):
                check_valid_split(run, baselines["valid_sha256"])
        verdicts = [arm_verdict(name, runs, baselines["bigram_nats"]) for name, runs in arms.items()]
        versus = versus_verdicts(arms, args.versus) if args.versus else []
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for v in verdicts:
        print(f"{v.name}: validation LM loss at step {v.last_step} ({v.tokens / 1e6:.1f}M tokens): "
              f"{', '.join(f'{x:.3f}' for x in v.last_valid)}; bigram {baselines['bigram_nats']:.3f}: "
              f"{'below' if v.beats_bigram else 'NOT below'}")
    for v in versus:
        print(f"{v.arm} minus {v.versus} at {v.tokens / 1e6:.1f}M tokens: {v.difference:+.3f}, 95 % interval "
              f"[{v.low:+.3f}, {v.high:+.3f}] (run-to-run sd {v.pooled_sd:.3f}): {v.verdict}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(arms, baselines, args.out, args.title)
    record = {"schema": SCHEMA, "baselines": {k: baselines[k] for k in ("unigram_nats", "bigram_nats", "vocab_size", "valid_sha256")},
              "data_checked": not args.no_data_check, "arms": [asdict(v) for v in verdicts],
              "versus": [asdict(v) for v in versus],
              "runs": {name: [asdict(run) for run in runs] for name, runs in arms.items()}}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
