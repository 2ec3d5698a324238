"""pytest's own JUnit XML, from a real pytest run, read back under the ids pytest prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nam56r_patchlane.junit import read_cases


def test_ids_and_outcomes_of_a_real_report_including_a_module_that_cannot_collect(tmp_path: Path) -> None:
    tests = tmp_path / "tests" / "pkg"
    tests.mkdir(parents=True)
    (tests / "test_mix.py").write_text(
        "import pytest\n\n\nclass TestGroup:\n    def test_in_class(self):\n        pass\n\n\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_param(n):\n    assert n == 1, 'two is not one'\n\n\n"
        "def test_skipped():\n    pytest.skip('needs a GPU')\n")
    (tests / "test_broken.py").write_text("import no_such_module_here\n")
    junit = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors",
                    f"--junitxml={junit}", "-o", "junit_family=xunit1", "tests"], cwd=tmp_path, capture_output=True)

    cases = {case.id: case for case in read_cases(junit, message_chars=2000)}

    assert set(cases) == {"tests/pkg/test_mix.py::TestGroup::test_in_class", "tests/pkg/test_mix.py::test_param[1]",
                          "tests/pkg/test_mix.py::test_param[2]", "tests/pkg/test_mix.py::test_skipped",
                          "tests/pkg/test_broken.py"}
    assert cases["tests/pkg/test_mix.py::test_param[2]"].outcome == "failed"
    assert "two is not one" in cases["tests/pkg/test_mix.py::test_param[2]"].message
    assert cases["tests/pkg/test_mix.py::test_skipped"].outcome == "skipped"
    assert cases["tests/pkg/test_broken.py"].outcome == "error"
    assert "no_such_module_here" in cases["tests/pkg/test_broken.py"].message
    assert all(len(case.message) <= 2000 for case in cases.values())
