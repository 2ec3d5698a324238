"""`upstream-tests`, the verdicts: each test's outcome on the release and on the patched series, compared.

  regression     passes on the release, fails (or errors, or is skipped) with the series
  explained      a regression that patches/<upstream>/upstream-tests.toml explains (test, why)
  fixed          fails on the release, passes with the series
  both fail      fails on both sides: not ours; its cause class says why (needs TransformerEngine, a CUDA GPU, ...)
  passed         passes on both; skipped: skipped on both
  only patched   a test the series adds (its test sections); only base: one it removes, which counts as a regression

A test in a file a patch updates runs as updated on the patched side: the report names the patch.
"""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchlaneError
from .junit import Case

REGRESSION, EXPLAINED, FIXED, BOTH_FAIL, PASSED, SKIPPED, ONLY_PATCHED = (
    "regression", "explained", "fixed", "both fail", "passed", "skipped", "only patched")
EXPLANATIONS_NAME = "upstream-tests.toml"
_FAILING = ("failed", "error")
_CUDA = re.compile(r"CUDA|cuda|NCCL|nccl|\bGPU")
# The first match names the class; {0} is the pattern's first group. The CUDA class depends on the run's device:
# with CUDA hidden a CUDA error means the test needs a GPU, on a GPU it is an error of its own.
_CAUSES = (
    (re.compile(r"transformer_engine"), "needs TransformerEngine"),
    (re.compile(r"\bapex\b"), "needs Apex"),
    (re.compile(r"No module named '([^']+)'"), "needs the module {0}"),
    (re.compile(r"world_size \(\d+\) is not divisible"), "needs more ranks than one pytest process (upstream runs it under torchrun)"),
    (_CUDA, None),
    (re.compile(r"MASTER_ADDR|init_process_group|process group|Default process group"), "needs torch.distributed set up"),
    (re.compile(r"MagicMock"), "a MagicMock in the test's parametrization"),
)
_CUDA_CLASS = {False: "needs a CUDA GPU", True: "a CUDA or NCCL error on the GPU"}


@dataclass(frozen=True)
class Verdict:
    test: str
    kind: str
    base: str  # the release's outcome ("absent" when the test is not there)
    patched: str
    cause: str = ""  # both fail: the cause class; regression: the patched side's first message line
    message: str = ""  # a failing side's first message line (both fail, fixed: the one the cause was read from)
    patch: str = ""  # regression: the first patch at which it fails (bisected), when known
    updated_by: tuple[str, ...] = ()  # patches whose test sections update the test's file
    why: str = ""  # explained: the reason written down

    @property
    def counts_against(self) -> bool:
        return self.kind == REGRESSION


def cause_class(message: str, gpu: bool = False) -> str:
    """What a failure needs, from its message: a class shared by many tests, else the message's first line; `gpu`:
    the run had a CUDA GPU."""
    for pattern, label in _CAUSES:
        found = pattern.search(message)
        if found:
            return _CUDA_CLASS[gpu] if label is None else label.format(*found.groups())
    first = next((line.strip() for line in message.splitlines() if line.strip()), "no message")
    return f"other: {first[:120]}"


def read_explanations(series_dir: Path) -> dict[str, str]:
    """patches/<upstream>/upstream-tests.toml: {test id: why} for regressions the series causes on purpose."""
    path = series_dir / EXPLANATIONS_NAME
    if not path.is_file():
        return {}
    try:
        entries = tomllib.loads(path.read_text()).get("explained", [])
    except tomllib.TOMLDecodeError as exc:
        raise PatchlaneError(f"{path}: invalid TOML: {exc}") from exc
    explained = {}
    for number, entry in enumerate(entries, 1):
        if not str(entry.get("test", "")).strip() or not str(entry.get("why", "")).strip():
            raise PatchlaneError(f"{path}: [[explained]] #{number} needs both `test` (its id) and `why`")
        explained[str(entry["test"])] = str(entry["why"])
    return explained


def _file_of(test: str) -> str:
    return test.split("::", 1)[0]


def classify(base: dict[str, Case], patched: dict[str, Case], updates: dict[str, tuple[str, ...]],
             explained: dict[str, str], gpu: bool = False) -> list[Verdict]:
    """Every test of either side with its verdict; `updates`: test file -> the patches that update it; `gpu`: the
    sides ran on a CUDA GPU."""
    base, patched = _expand_collection_errors(base, patched), _expand_collection_errors(patched, base)
    verdicts = []
    for test in sorted(set(base) | set(patched)):
        b, p = base.get(test), patched.get(test)
        updated_by = updates.get(_file_of(test), ())
        b_out, p_out = b.outcome if b else "absent", p.outcome if p else "absent"
        message = ""
        if b is None:
            kind, cause = (ONLY_PATCHED, "") if p_out not in _FAILING else (REGRESSION, _first_line(p.message))
        elif b_out == "passed" and p_out != "passed":
            kind, cause = REGRESSION, _first_line(p.message) if p else "removed by the series"
        elif b_out in _FAILING and p_out in _FAILING:
            kind, cause, message = BOTH_FAIL, cause_class(p.message, gpu), _first_line(p.message)
        elif b_out in _FAILING and p_out == "passed":
            kind, cause, message = FIXED, cause_class(b.message, gpu), _first_line(b.message)
        elif p_out in _FAILING:  # skipped on the release: it never ran there
            kind, cause = REGRESSION, _first_line(p.message)
        elif "skipped" in (b_out, p_out):
            kind, cause = SKIPPED, _first_line((p if p_out == "skipped" else b).message)
        else:
            kind, cause = PASSED, ""
        why = explained.get(test, "")
        if kind == REGRESSION and why:
            kind = EXPLAINED
        verdicts.append(Verdict(test, kind, b_out, p_out, cause, message=message, updated_by=updated_by, why=why))
    return verdicts


def _expand_collection_errors(side: dict[str, Case], other: dict[str, Case]) -> dict[str, Case]:
    """A file this side could not collect (one error under the file's own id) stands, as that error, for each test the
    other side collected from it; the file's own id then goes."""
    expanded = dict(side)
    for test in other:
        path = _file_of(test)
        if test != path and test not in side and path in side and side[path].outcome == "error":
            expanded[test] = side[path]
    collected_elsewhere = {_file_of(t) for t in other if t != _file_of(t)}
    return {t: o for t, o in expanded.items() if not (t == _file_of(t) and t in collected_elsewhere and t not in other)}


def _first_line(message: str) -> str:
    return next((line.strip()[:160] for line in message.splitlines() if line.strip()), "no message")


def covered(test: str, declared: tuple[str, ...]) -> bool:
    """Whether `test` lies in one of a patch's declared test files or directories."""
    path = _file_of(test)
    return any(path == d or path.startswith(d.rstrip("/") + "/") or test.startswith(d + "::") for d in declared)


def tally(verdicts: list[Verdict]) -> dict[str, int]:
    return dict(Counter(v.kind for v in verdicts))


def both_fail_causes(verdicts: list[Verdict]) -> list[tuple[str, int]]:
    return Counter(v.cause for v in verdicts if v.kind == BOTH_FAIL).most_common()
