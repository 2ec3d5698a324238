"""A side that prints both BUG_REPRODUCED and FIX_VALIDATED contradicts itself: on the base it says the bug is
already fixed, on the patched tree that the fix still reproduces the bug. Either way the pack is not `passed`, even
when every exit code is the documented one."""

from __future__ import annotations

import contextlib
import io
import sys
from types import SimpleNamespace

import pytest
from nam56r_patchlane.lock import load_lock
from nam56r_patchlane.packs.cli import main as packs_main
from nam56r_patchlane.packs.pack import Reproducer, load_pack
from nam56r_patchlane.packs.run import expected_problems, run_pack
from packs_testlib import PACK, add_pack, pack_toml
from patchlane_testlib import Lane

HOST = "host: gpu=cpu driver=- python=3.11.0 torch=- triton=- cuda=- upstream=fakeup base=0 tree=0"

# Prints the sentinel its side is documented to print, exits 0, and on the side named by --both prints the other too.
BOTH_REPRO = '''\
import argparse
import subprocess

parser = argparse.ArgumentParser()
parser.add_argument("--tree", required=True)
parser.add_argument("--both", choices=["base", "patched"], required=True)
args = parser.parse_args()
log = subprocess.run(["git", "-C", args.tree, "log", "--format=%s", "upstream..HEAD"], capture_output=True, text=True,
                     check=True).stdout
side = "patched" if "Return None from first()" in log else "base"
print("host: gpu=cpu driver=- python=3.11.0 torch=- triton=- cuda=- upstream=fakeup base=0 tree=0")
print("BUG_REPRODUCED: first([]) raised IndexError" if side == "base" else "FIX_VALIDATED: first([]) returned None")
if side == args.both:
    print("FIX_VALIDATED: first([]) returned None" if side == "base" else "BUG_REPRODUCED: first([]) raised IndexError")
'''


@pytest.fixture
def packed(built: Lane) -> Lane:
    return add_pack(built)


@pytest.mark.parametrize(("side", "printed", "documented"), [
    ("base", "FIX_VALIDATED", "BUG_REPRODUCED"),
    ("patched", "BUG_REPRODUCED", "FIX_VALIDATED"),
])
def test_a_side_printing_both_sentinels_fails_the_pack(packed: Lane, side: str, printed: str, documented: str) -> None:
    folder = packed.root / "patches" / "packs" / PACK
    (folder / "repro.py").write_text(BOTH_REPRO)
    (folder / "pack.toml").write_text(pack_toml(args=["--both", side]))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = packs_main(["--root", str(packed.root), "--python", sys.executable, "run", PACK, "--no-record"])

    assert code == 1, out.getvalue() + err.getvalue()
    assert f"{side}: printed {printed} as well as {documented}" in out.getvalue()
    assert f"{PACK}: FAILED: " in out.getvalue()
    assert f"{PACK}: passed" not in out.getvalue()


def test_run_pack_gives_no_pass_to_a_patched_side_that_still_reproduces(packed: Lane) -> None:
    folder = packed.root / "patches" / "packs" / PACK
    (folder / "repro.py").write_text(BOTH_REPRO)
    (folder / "pack.toml").write_text(pack_toml(args=["--both", "patched"]))

    outcome = run_pack(load_pack(folder), packed.root, load_lock(packed.root), record=False, log=lambda _: None)

    assert outcome.verdict == "FAILED" and outcome.exit_code == 1
    patched = next(s for s in outcome.sides if s.side == "patched")
    assert patched.exit_code == 0 and set(patched.sentinels) == {"FIX_VALIDATED", "BUG_REPRODUCED"}


@pytest.mark.parametrize(("side", "found", "problem"), [
    ("base", ("BUG_REPRODUCED", "FIX_VALIDATED"), "base: printed FIX_VALIDATED as well as BUG_REPRODUCED"),
    ("patched", ("FIX_VALIDATED", "BUG_REPRODUCED"), "patched: printed BUG_REPRODUCED as well as FIX_VALIDATED"),
])
def test_expected_problems_name_the_contrary_sentinel_on_either_side(side: str, found: tuple[str, ...], problem: str) -> None:
    pack = SimpleNamespace(reproducer=Reproducer(script="repro.py", needs="cpu", args=(), base="BUG_REPRODUCED",
                                                 patched=("FIX_VALIDATED",)))
    assert expected_problems(pack, side, 0, f"{HOST}\n", found) == [problem]  # type: ignore[arg-type]
    assert expected_problems(pack, side, 0, f"{HOST}\n", found[:1]) == []  # type: ignore[arg-type]
