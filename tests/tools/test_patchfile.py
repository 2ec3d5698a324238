"""The patch file format (patchfile.py): parsing, rendering, commit messages, header validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from nam56r_patchlane.errors import PatchlaneError
from nam56r_patchlane.patchfile import (
    PatchFile,
    merge_sections,
    parse_commit_message,
    parse_patch_text,
    read_patch,
    validate_header,
)

DIFF = """\
diff --git a/pkg/mod.py b/pkg/mod.py
index 1111111111111111111111111111111111111111..2222222222222222222222222222222222222222 100644
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,3 +1,3 @@
 a = 1
-b = 2
+b = 3
 c = 4
diff --git a/pkg/new.py b/pkg/new.py
new file mode 100644
index 0000000000000000000000000000000000000000..3333333333333333333333333333333333333333
--- /dev/null
+++ b/pkg/new.py
@@ -0,0 +1 @@
+x = 1
"""
FIELDS = [
    ("Subject", "Keep b at three"),
    ("Pack", "03-dsa-index-memory"),
    ("Category", "memory"),
    ("Upstream-Status", "filed https://github.com/example/repo/pull/7"),
    ("Retire-When", "upstream releases the fix (>= 0.20)"),
    ("Reproducer", "none"),
    ("Upstream-Tests", "tests/unit_tests/test_mod.py tests/unit_tests/pkg"),
    ("Tested-On", "H100, torch 2.13"),  # an extra field, kept as written
]
DESCRIPTION = "First paragraph: why.\nIt wraps.\n\nSecond paragraph: how it was measured.\n--- not the separator, it has text"


def sample() -> PatchFile:
    return PatchFile(fields=list(FIELDS), description=DESCRIPTION, diff=DIFF)


def test_to_text_layout() -> None:
    text = sample().to_text()

    head, diff = text.split("\n---\ndiff --git ", 1)
    assert head.split("\n")[: len(FIELDS)] == [f"{k}: {v}" for k, v in FIELDS]
    assert head.split("\n")[len(FIELDS)] == ""
    assert head.endswith(DESCRIPTION)
    assert "diff --git " + diff == DIFF


def test_parse_to_text_round_trip() -> None:
    patch = sample()
    parsed = parse_patch_text(patch.to_text(), "sample.patch")

    assert parsed == patch
    assert parsed.to_text() == patch.to_text()
    assert parsed.subject == "Keep b at three"
    assert parsed.get("Tested-On") == "H100, torch 2.13"
    assert parsed.get("Nope") is None
    assert parsed.touched_files() == ["pkg/mod.py", "pkg/new.py"]


def test_commit_message_round_trip() -> None:
    patch = sample()
    message = patch.commit_message()

    assert message.startswith("Keep b at three\n\nPack: 03-dsa-index-memory\n")
    assert "Subject:" not in message
    assert message.endswith(DESCRIPTION + "\n")
    fields, description = parse_commit_message(message, "commit abc")
    assert fields == FIELDS
    assert description == DESCRIPTION
    assert PatchFile(fields, description, DIFF).to_text() == patch.to_text()


def test_read_patch_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "0001-x.patch"
    path.write_text(sample().to_text())
    assert read_patch(path) == sample()
    with pytest.raises(PatchlaneError, match="does not exist"):
        read_patch(tmp_path / "0002-missing.patch")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Subject: x\nPack: none\n\nwhy\n---\n", "the patch is empty"),
        ("Subject: x\nPack: none\n\nwhy\n" + DIFF, "must be '---'"),
        ("Subject: x\nnot a header line\n\nwhy\n---\n" + DIFF, "header line 2 is not 'Key: value'"),
    ],
    ids=["no-diff", "no-separator", "bad-header-line"],
)
def test_parse_errors_name_the_file_and_problem(text: str, message: str) -> None:
    with pytest.raises(PatchlaneError, match=message) as info:
        parse_patch_text(text, "patches/x/0001-y.patch")
    assert "patches/x/0001-y.patch" in str(info.value)


def test_valid_header_has_no_problems(tmp_path: Path) -> None:
    assert validate_header(sample(), "p") == []
    (tmp_path / "repro.py").write_text("")
    with_repro = PatchFile([(k, "repro.py" if k == "Reproducer" else v) for k, v in FIELDS], DESCRIPTION, DIFF)
    assert validate_header(with_repro, "p", tmp_path) == []


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("Pack", "Big Pack", "Pack 'Big Pack'"),
        ("Category", "feature", "Category 'feature' is not one of"),
        ("Upstream-Status", "filed", "Upstream-Status 'filed' is not one of"),
        ("Upstream-Status", "filed http://insecure.example/1", "Upstream-Status"),
        ("Upstream-Status", "not-for-upstream:", "Upstream-Status"),
        ("Retire-When", "", "Retire-When is empty"),
        ("Subject", "", "Subject is empty"),
        ("Reproducer", "tests/missing.py", "Reproducer 'tests/missing.py' is not a file"),
        ("Upstream-Tests", "", "Upstream-Tests is empty"),
        ("Upstream-Tests", "none:", "'none:' needs a reason"),
        ("Upstream-Tests", "pkg/test_mod.py", "'pkg/test_mod.py' is not a relative path under tests or test/"),
        ("Upstream-Tests", "tests/../pkg/mod.py", "is not a relative path"),
        ("Upstream-Tests", "tests", "'tests' is not a relative path"),
    ],
)
def test_invalid_header_values(tmp_path: Path, field: str, value: str, problem: str) -> None:
    patch = PatchFile([(k, value if k == field else v) for k, v in FIELDS], DESCRIPTION, DIFF)

    problems = validate_header(patch, "p.patch", tmp_path)

    assert len(problems) == 1 and problem in problems[0] and problems[0].startswith("p.patch: ")


@pytest.mark.parametrize("status", ["not-filed", "filed https://x.invalid/1", "comment-on https://x.invalid/2", "fixed-in 0.20.0",
                                    "not-for-upstream: NAM56R-specific"])
def test_accepted_upstream_statuses(status: str) -> None:
    patch = PatchFile([(k, status if k == "Upstream-Status" else v) for k, v in FIELDS], DESCRIPTION, DIFF)
    assert validate_header(patch, "p") == []


def test_missing_and_duplicate_fields() -> None:
    missing = PatchFile([(k, v) for k, v in FIELDS if k != "Category"], DESCRIPTION, DIFF)
    duplicate = PatchFile([*FIELDS, ("Pack", "none")], DESCRIPTION, DIFF)
    no_description = PatchFile(list(FIELDS), "  \n", DIFF)

    assert validate_header(missing, "p") == ["p: missing header field 'Category'"]
    assert validate_header(duplicate, "p") == ["p: header field 'Pack' appears 2 times"]
    assert "no description" in validate_header(no_description, "p")[0]


def test_upstream_tests_none_with_a_reason_is_valid_and_declares_nothing() -> None:
    patch = PatchFile([(k, "none: upstream has no test of it" if k == "Upstream-Tests" else v) for k, v in FIELDS],
                      DESCRIPTION, DIFF)
    assert validate_header(patch, "p") == []
    assert patch.declared_tests() == ()
    assert sample().declared_tests() == ("tests/unit_tests/test_mod.py", "tests/unit_tests/pkg")


TEST_SECTION = """\
diff --git a/tests/test_mod.py b/tests/test_mod.py
index 4444444444444444444444444444444444444444..5555555555555555555555555555555555555555 100644
--- a/tests/test_mod.py
+++ b/tests/test_mod.py
@@ -1 +1 @@
-assert b == 2
+assert b == 3
"""


def test_test_sections_are_split_from_the_code_and_merged_back_in_path_order() -> None:
    patch = PatchFile(list(FIELDS), DESCRIPTION, DIFF + TEST_SECTION)

    assert [p for p, _ in patch.sections()] == ["pkg/mod.py", "pkg/new.py", "tests/test_mod.py"]
    assert "".join(text for _, text in patch.sections()) == patch.diff
    assert patch.code_diff() == DIFF
    assert patch.test_sections() == [("tests/test_mod.py", TEST_SECTION)]
    assert merge_sections(DIFF, patch.test_sections()) == patch.diff
    assert merge_sections(DIFF, []) == DIFF
    assert merge_sections("", patch.test_sections()) == TEST_SECTION
    # a section the tree's own diff has wins over the kept one
    newer = TEST_SECTION.replace("b == 3", "b == 4")
    assert merge_sections(DIFF + newer, patch.test_sections()) == DIFF + newer
