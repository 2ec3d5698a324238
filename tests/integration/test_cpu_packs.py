"""Every filing pack whose reproducer runs on CPU, on the real built trees: base prints what pack.toml
expects (BUG_REPRODUCED, or FIX_VALIDATED for a guard) and the patched tree FIX_VALIDATED.

Needs the trees `nox -s build` leaves in third_party/ (CI builds them before the tests). Nothing
is recorded: CI runs on a throwaway clone; `python tools/packs.py run ID` records."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from nam56r_patchlane.gittree import is_git_tree
from nam56r_patchlane.packs.cli import main
from nam56r_patchlane.packs.pack import load_packs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CPU_PACKS = [p for p in load_packs(ROOT) if p.reproducer.needs == "cpu"]


def test_there_are_cpu_packs() -> None:
    assert len(CPU_PACKS) >= 4, [p.id for p in CPU_PACKS]


@pytest.mark.parametrize("pack", CPU_PACKS, ids=lambda p: p.id)
def test_cpu_pack_reproduces_on_base_and_validates_on_patched(pack, capsys: pytest.CaptureFixture) -> None:
    if not is_git_tree(ROOT / "third_party" / pack.upstream):
        pytest.skip(f"third_party/{pack.upstream} is not built: run `nox -s build` first")

    code = main(["--root", str(ROOT), "--python", sys.executable, "run", pack.id, "--no-record", "--timeout", "600"])

    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    assert f"[base] {pack.reproducer.base}" in out
    assert "[patched] FIX_VALIDATED" in out
