"""Training paths compared as arms of several runs each: a difference between two paths counts only when it exceeds
what runs of one path differ by.

Each run is reduced to its mean LM loss over a window of steps. Each arm's runs give its mean and the spread between
them; the spread is pooled over every arm with two runs or more (the paths share one source of run-to-run noise: GPU
nondeterminism on the same batches, or the seed). An arm's difference from the baseline arm is reported with its 95 %
interval, d ± t(0.975, pooled df) · s_pooled · sqrt(1/n_arm + 1/n_baseline); an interval that holds 0 shows no
difference. Without any arm of two runs there is no spread to judge by, and the comparison is refused.

    python -m nam56r.training.runs.arms --arm megatron=runs/m1/summary.json,runs/m2/summary.json \\
        --arm fused=runs/f1/summary.json,runs/f2/summary.json --baseline megatron --steps 151 300 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from nam56r.training.runs.compare import RunCurves, read_run

# Student's t at 0.975 for 1..30 degrees of freedom (two-sided 95 %); the normal quantile beyond.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class ArmStats:
    name: str
    runs: tuple[str, ...]
    run_means: tuple[float, ...]  # each run's mean LM loss over the window
    mean: float
    spread_sd: float | None  # the standard deviation between its runs (None: one run)


@dataclass(frozen=True)
class ArmDifference:
    arm: str
    baseline: str
    difference: float  # the arm's mean minus the baseline's
    low: float
    high: float
    pooled_sd: float
    pooled_df: int
    shown: bool  # the interval excludes 0

    def describe(self) -> str:
        verdict = "a difference" if self.shown else "no difference shown"
        return (f"{self.arm} minus {self.baseline}: {self.difference:+.3f}, 95 % interval [{self.low:+.3f}, {self.high:+.3f}]"
                f" ({verdict}; run-to-run sd {self.pooled_sd:.3f}, {self.pooled_df} df)")


def t_975(df: int) -> float:
    return T_975[df - 1] if df <= len(T_975) else 1.960


def window_mean(run: RunCurves, first: int, last: int) -> float:
    """The run's mean LM loss over steps first..last; raises when it did not log every one of them."""
    losses = {step: loss for step, loss in run.lm_loss if first <= step <= last}
    missing = (last - first + 1) - len(losses)
    if missing:
        raise ValueError(f"{run.label} lacks {missing} of steps {first}-{last}: compare over steps every run logged")
    return statistics.fmean(losses.values())


def arm_stats(name: str, runs: list[RunCurves], first: int, last: int) -> ArmStats:
    means = tuple(window_mean(run, first, last) for run in runs)
    return ArmStats(name, tuple(run.label for run in runs), means, statistics.fmean(means),
                    statistics.stdev(means) if len(means) > 1 else None)


def compare_arms(arms: list[ArmStats], baseline: str) -> list[ArmDifference]:
    """Each arm against `baseline`, with the run-to-run spread pooled over the arms of two runs or more."""
    by_name = {arm.name: arm for arm in arms}
    if baseline not in by_name:
        raise ValueError(f"baseline {baseline!r} is not one of the arms {sorted(by_name)}")
    repeated = [arm for arm in arms if len(arm.run_means) > 1]
    if not repeated:
        raise ValueError("no arm has two runs: a difference needs the spread between runs of one arm; run some arm twice")
    df = sum(len(arm.run_means) - 1 for arm in repeated)
    pooled = math.sqrt(sum((len(arm.run_means) - 1) * arm.spread_sd**2 for arm in repeated) / df)
    base = by_name[baseline]
    differences = []
    for arm in arms:
        if arm.name == baseline:
            continue
        d = arm.mean - base.mean
        half = t_975(df) * pooled * math.sqrt(1 / len(arm.run_means) + 1 / len(base.run_means))
        differences.append(ArmDifference(arm.name, baseline, d, d - half, d + half, pooled, df, not d - half <= 0 <= d + half))
    return differences


def parse_arm(text: str) -> tuple[str, list[Path]]:
    """An `--arm NAME=PATH[,PATH...]` option: the arm's name and its runs' paths."""
    name, sep, paths = text.partition("=")
    if not sep or not name or not paths:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH[,PATH...]")
    return name, [Path(p) for p in paths.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nam56r.training.runs.arms", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", type=parse_arm, action="append", required=True, metavar="NAME=SUMMARY[,SUMMARY...]",
                        help="one arm: its name and its runs' summary.json files (repeatable)")
    parser.add_argument("--baseline", required=True, help="the arm the others are compared with")
    parser.add_argument("--steps", type=int, nargs=2, default=(151, 300), metavar=("FIRST", "LAST"),
                        help="the window of steps each run's mean LM loss is taken over (default: 151 300)")
    parser.add_argument("--json", type=Path, help="also write the arms and the differences here")
    args = parser.parse_args(argv)
    first, last = args.steps
    try:
        arms = [arm_stats(name, [read_run(path, str(path)) for path in paths], first, last) for name, paths in args.arm]
        differences = compare_arms(arms, args.baseline)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for arm in arms:
        spread = f", run-to-run sd {arm.spread_sd:.3f}" if arm.spread_sd is not None else ""
        print(f"{arm.name}: {len(arm.run_means)} run(s), mean LM loss over steps {first}-{last} {arm.mean:.3f}"
              f" ({', '.join(f'{m:.3f}' for m in arm.run_means)}){spread}")
    for difference in differences:
        print(difference.describe())
    if args.json:
        args.json.write_text(json.dumps({"steps": [first, last], "arms": [asdict(a) for a in arms],
                                         "differences": [asdict(d) for d in differences]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
