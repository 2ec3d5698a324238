"""The four real pins of third_party/upstreams.toml, materialized and patched in a temporary root.

Uses the default artifact cache (~/.cache/nam56r-patchlane/artifacts); the tool downloads a missing
artifact through pip (checksum-verified). The repository's own third_party/ is not touched: the
lock and patches/ are copied into the temporary root.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nam56r_patchlane.cli import main
from nam56r_patchlane.lock import load_lock
from nam56r_patchlane.series import read_series

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("real-pins")
    (root / "third_party").mkdir()
    shutil.copy(ROOT / "third_party" / "upstreams.toml", root / "third_party" / "upstreams.toml")
    shutil.copytree(ROOT / "patches", root / "patches")
    return root


def run(root: Path, *args: str, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["--root", str(root), "--python", sys.executable, *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_real_pins_build_apply_and_check(real_root: Path, capsys: pytest.CaptureFixture) -> None:
    lock = load_lock(real_root)
    assert len(lock.upstreams) == 4

    code, out = run(real_root, "build", "--no-install", "--profile", "cpu", capsys=capsys)
    assert code == 0, out

    for upstream in lock.upstreams:
        tree = real_root / upstream.path
        series = read_series(real_root / "patches", upstream.name)
        state = json.loads((tree / ".git" / "nam56r-patchlane.json").read_text())
        base = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%B", "upstream"],
                              capture_output=True, text=True, check=True).stdout
        sha256 = upstream.artifact().sha256
        assert upstream.requirement in base and upstream.version in base, base
        assert sha256 in base, base
        assert upstream.commit in base, base
        assert state["artifact_sha256"] == sha256
        n = len(series.entries)
        assert [a["name"] for a in state["applied"]] == [e.name for e in series.entries]
        row = next(line for line in out.splitlines() if line.startswith(f"{upstream.name} "))
        assert f" {n}/{n} " in row and " clean " in row, row
        commits = subprocess.run(["git", "-C", str(tree), "rev-list", "--count", "upstream..HEAD"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        assert commits == str(n)

    code, out = run(real_root, "build", "--no-install", "--profile", "cpu", capsys=capsys)
    assert code == 0 and "no-op" in out, out

    code, out = run(real_root, "check", capsys=capsys)
    assert code == 0, out
    assert "check: passed" in out
