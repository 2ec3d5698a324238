"""Arms of several runs: a difference counts only beyond the spread between runs of one arm (runs.arms), on
summary.json files as runs.summary writes them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nam56r.training.runs.arms import T_975, arm_stats, compare_arms, main
from nam56r.training.runs.compare import read_run


def _summary(tmp_path: Path, name: str, level: float, wobble: float = 0.0) -> Path:
    """A run whose LM loss is `level` at every step of 1..300, plus an alternating `wobble`."""
    path = tmp_path / name / "summary.json"
    path.parent.mkdir()
    series = [[step, level + (wobble if step % 2 else -wobble)] for step in range(1, 301)]
    path.write_text(json.dumps({"series": {"lm_loss": series, "indexer_recall": []}}))
    return path


def _arm(tmp_path: Path, name: str, levels: list[float]):
    return arm_stats(name, [read_run(_summary(tmp_path, f"{name}{i}", level, 0.5), f"{name}{i}") for i, level in
                            enumerate(levels)], 151, 300)


def test_a_shift_beyond_the_spread_is_shown_and_one_within_it_is_not(tmp_path: Path) -> None:
    base = _arm(tmp_path, "base", [4.00, 4.02])
    near = _arm(tmp_path, "near", [4.01, 4.03])
    far = _arm(tmp_path, "far", [5.00])

    near_d, far_d = compare_arms([base, near, far], "base")

    pooled = math.sqrt((base.spread_sd**2 + near.spread_sd**2) / 2)  # both arms' sd, 1 df each
    assert near_d.pooled_df == 2 and near_d.pooled_sd == pytest.approx(pooled)
    assert near_d.difference == pytest.approx(0.01) and not near_d.shown
    assert near_d.high - near_d.difference == pytest.approx(T_975[1] * pooled * math.sqrt(1 / 2 + 1 / 2))
    assert far_d.difference == pytest.approx(0.99) and far_d.shown and far_d.low > 0
    assert base.mean == pytest.approx(4.01)  # the window's alternating wobble averages out over an even count


def test_without_a_repeated_arm_or_with_missing_steps_the_comparison_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no arm has two runs"):
        compare_arms([_arm(tmp_path, "a", [4.0]), _arm(tmp_path, "b", [4.1])], "a")
    short = tmp_path / "short" / "summary.json"
    short.parent.mkdir()
    short.write_text(json.dumps({"series": {"lm_loss": [[s, 4.0] for s in range(1, 200)]}}))
    with pytest.raises(ValueError, match="lacks 101 of steps 151-300"):
        arm_stats("s", [read_run(short, "short")], 151, 300)


def test_the_command_prints_each_arm_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = [_summary(tmp_path, f"a{i}", level) for i, level in enumerate([4.0, 4.1])]
    b = [_summary(tmp_path, "b0", 4.05)]
    out = tmp_path / "arms.json"

    code = main(["--arm", f"a={a[0]},{a[1]}", "--arm", f"b={b[0]}", "--baseline", "a", "--json", str(out)])

    assert code == 0
    printed = capsys.readouterr().out
    assert "a: 2 run(s)" in printed and "b minus a: +0.000" in printed and "no difference shown" in printed
    assert json.loads(out.read_text())["differences"][0]["arm"] == "b"
    assert main(["--arm", f"a={a[0]}", "--baseline", "zzz"]) == 1
