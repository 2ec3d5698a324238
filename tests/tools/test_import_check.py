"""The build's import check (`environment.check_imports`) in a real interpreter: every module is imported in its own
process, side by side, and every failure is reported, in the order the modules were given."""

from __future__ import annotations

import sys
from pathlib import Path

from nam56r_patchlane.environment import Target, check_imports


def test_every_failing_module_is_named_in_order_and_the_good_ones_pass() -> None:
    target = Target(sys.executable, "this interpreter")
    failures = check_imports(target, ["json", "nam56r_no_such_module_b", "os", "nam56r_no_such_module_a"])
    assert [line.split(":")[0] for line in failures] == ["nam56r_no_such_module_b", "nam56r_no_such_module_a"]
    assert all("ModuleNotFoundError" in line for line in failures), failures


def test_imports_run_side_by_side(tmp_path: Path, monkeypatch) -> None:
    # Each module waits for the other to have started: imported one after another, the first one would wait
    # out its 60 s and fail.
    for me, other in (("a", "b"), ("b", "a")):
        (tmp_path / f"nam56r_meet_{me}.py").write_text(
            "import pathlib, sys, time\n"
            f"here = pathlib.Path({str(tmp_path)!r})\n"
            f"(here / '{me}.started').touch()\n"
            "deadline = time.monotonic() + 60\n"
            f"while not (here / '{other}.started').exists():\n"
            "    if time.monotonic() > deadline:\n"
            f"        sys.exit('{other} never started beside {me}')\n"
            "    time.sleep(0.05)\n"
        )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert check_imports(Target(sys.executable, "this interpreter"), ["nam56r_meet_a", "nam56r_meet_b"]) == []
