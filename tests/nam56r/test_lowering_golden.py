"""Every pinned recipe x launcher-option case lowers to the Megatron flags (or the refusal) recorded in
golden/lowering.json, through the launcher's own command line, and the launcher keeps every option it has."""

from __future__ import annotations

import json

import pytest

from tests.nam56r.lowering_cases import GOLDEN, case_ids, lower

CASES = {(case["recipe"], tuple(case["options"])): case["outcome"] for case in json.loads(GOLDEN.read_text())}


def test_the_golden_file_holds_every_case_and_over_120_lowerings() -> None:
    assert set(CASES) == set(case_ids())
    assert sum("refused" not in outcome for outcome in CASES.values()) >= 120


@pytest.mark.parametrize(("name", "options"), case_ids(), ids=lambda v: v if isinstance(v, str) else " ".join(v) or "defaults")
def test_the_case_lowers_as_pinned(megatron_built, name: str, options: tuple[str, ...]) -> None:
    assert lower(name, options) == CASES[(name, options)]


def test_the_launcher_keeps_every_option() -> None:
    from nam56r.training.launcher.train_args import build_parser

    have = {option for action in build_parser("")._actions for option in action.option_strings}
    assert set(json.loads((GOLDEN.parent / "launcher_options.json").read_text())) <= have
