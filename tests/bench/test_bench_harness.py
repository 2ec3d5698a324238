"""nam56r_bench.harness: ratios against the fastest baseline, the suite JSON and plot, and the host stamp
(the manifest's, plus this checkout's commit, or "unknown" where the bench runs from no checkout)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from nam56r_bench.harness import Context, Row, checkout_commit, ratios, stamp, write_suite
from nam56r_bench.suites import SUITES


def test_ratios_compare_each_candidate_with_the_fastest_baseline() -> None:
    rows = [
        Row("dsa", "upstream einsum", time_ms=50.0, peak_extra_bytes=32 << 30),
        Row("dsa", "upstream tilelang", time_ms=20.0, peak_extra_bytes=1 << 30),
        Row("dsa", "upstream broken", extra={"error": "out of memory"}),
        Row("dsa", "fused", time_ms=4.0, peak_extra_bytes=1 << 29),
        Row("moe", "reference", time_ms=3.0, peak_extra_bytes=300),
        Row("moe", "grouped_mm", time_ms=1.0, peak_extra_bytes=100),
        Row("alone", "fused", time_ms=1.0),
    ]
    got = {r["case"]: r for r in ratios(rows)}
    assert got["dsa"] == {"case": "dsa", "variant": "fused", "against": "upstream tilelang", "speedup": 5.0, "memory_ratio": 2.0}
    assert got["moe"]["speedup"] == 3.0 and got["moe"]["memory_ratio"] == 3.0
    assert "alone" not in got  # no baseline measured, no ratio invented


def test_write_suite_stamps_and_plots(tmp_path: Path) -> None:
    rows = [Row("a", "reference", time_ms=2.0, peak_extra_bytes=2 << 30), Row("a", "fused", time_ms=1.0, max_error=1e-6)]
    host = {"gpu": "NVIDIA H100", "commit": "0" * 40}
    path = write_suite(SUITES["kernels"], rows, Context(tmp_path, quick=True), host, 1.5)
    result = json.loads(path.read_text())
    assert result["suite"] == "kernels" and result["host"] == host and result["ratios"][0]["speedup"] == 2.0
    assert (tmp_path / "kernels.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_results_carry_the_manifests_host_stamp() -> None:
    from nam56r_patchlane.manifest import host_stamp

    host = stamp()
    assert {key: host[key] for key in asdict(host_stamp(sys.executable))} == asdict(host_stamp(sys.executable))
    assert len(host["commit"]) == 40 and isinstance(host["dirty"], bool)
    assert set(host["upstreams"]) == {"megatron-lm", "mamba", "liger-kernel", "tilelang"}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_a_checkouts_commit_and_dirty_flag(tmp_path: Path) -> None:
    _git(tmp_path, "init", "--quiet")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "one")
    assert checkout_commit(tmp_path) == (_git(tmp_path, "rev-parse", "HEAD"), False)
    (tmp_path / "a.txt").write_text("two\n")
    assert checkout_commit(tmp_path)[1] is True


def test_outside_a_checkout_the_commit_is_unknown_not_an_enclosing_repositorys(tmp_path: Path) -> None:
    copy, unbuilt = tmp_path / "copy", tmp_path / "env"  # a tarball of the checkout unpacked somewhere, no build record
    copy.mkdir()
    assert checkout_commit(copy, unbuilt) == ("unknown", None)
    _git(tmp_path, "init", "--quiet")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "--allow-empty", "-m", "outer")
    assert checkout_commit(copy, unbuilt) == ("unknown", None)  # inside another repository: that one's HEAD is not ours


def test_outside_a_checkout_the_commit_comes_from_the_build_record(tmp_path: Path) -> None:
    from nam56r_patchlane.checkout_state import CheckoutState, state_record
    from nam56r_patchlane.environment import write_build_record

    copy, env = tmp_path / "copy", tmp_path / "env"
    copy.mkdir(), env.mkdir()
    write_build_record(env, {"offline": False, "checkout": state_record(CheckoutState("ab" * 20, False))})
    assert checkout_commit(copy, env) == ("ab" * 20 + " (build record)", False)


def test_the_kernels_plot_draws_each_ratio_as_a_win_or_a_loss_around_1x(tmp_path: Path, monkeypatch) -> None:
    """The committed kernels.json redrawn: one bar per ratio on log axes, green at >= 1x and red below."""
    from matplotlib.axes import Axes
    from nam56r_bench.plots import LOSS, WIN, render

    result = json.loads((Path(__file__).resolve().parents[2] / "docs" / "bench" / "kernels.json").read_text())
    drawn: list[tuple[float, float, str]] = []
    real_barh = Axes.barh

    def barh(self, y, width, left=None, color=None, **kwargs):
        drawn.append((self.get_xlabel(), left + width if left == 1 else left, color))
        return real_barh(self, y, width, left=left, color=color, **kwargs)

    monkeypatch.setattr(Axes, "barh", barh)
    render(result, tmp_path / "kernels.png")
    assert (tmp_path / "kernels.png").read_bytes()[:4] == b"\x89PNG"
    speedups = [(value, color) for _, value, color in drawn[: len(result["ratios"])]]
    assert [round(v, 6) for v, _ in speedups] == [round(r["speedup"], 6) for r in result["ratios"]]
    assert all(color == (WIN if value >= 1 else LOSS) for value, color in speedups)
    assert any(color == LOSS for _, color in speedups)  # the losers show


def test_replot_redraws_a_png_from_its_json_and_names_a_bad_file(tmp_path: Path) -> None:
    rows = [Row("a", "reference", time_ms=2.0), Row("a", "fused", time_ms=1.0)]
    path = write_suite(SUITES["kernels"], rows, Context(tmp_path, quick=True), {"gpu": "NVIDIA H200", "commit": "0" * 40}, 1.0)
    path.with_suffix(".png").unlink()
    from nam56r_bench.cli import main

    assert main(["--replot", str(path)]) == 0 and path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert main(["--replot", str(tmp_path / "missing.json")]) == 2
