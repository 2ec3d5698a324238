"""pytest's JUnit XML (`-o junit_family=xunit1`), read: each test case under the id pytest prints for it
(`file::Class::name`; a module that failed to collect under its file), with its outcome, time and message."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    id: str
    outcome: str  # passed | failed | error | skipped
    seconds: float
    message: str  # the failure, error or skip message, then its text (the traceback), cut at the reader's limit


def read_cases(path: Path, message_chars: int) -> list[Case]:
    return [_case(case, message_chars) for case in ElementTree.parse(path).getroot().iter("testcase")]


def _case(case: ElementTree.Element, message_chars: int) -> Case:
    outcome, message = _outcome(case, message_chars)
    return Case(_case_id(case), outcome, round(float(case.get("time", 0) or 0), 3), message)


def _case_id(case: ElementTree.Element) -> str:
    file, classname, name = case.get("file") or "", case.get("classname") or "", case.get("name") or ""
    if not classname:  # a collection error: the module (dotted in `name`) stands for its tests
        return file or name.replace(".", "/") + ".py"
    module = file.removesuffix(".py").replace("/", ".")
    inner = classname[len(module) + 1 :] if module and classname.startswith(module + ".") else ""
    return "::".join(part for part in (file or classname, inner.replace(".", "::"), name) if part)


def _outcome(case: ElementTree.Element, message_chars: int) -> tuple[str, str]:
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        found = case.find(tag)
        if found is not None:
            text = ((found.get("message") or "") + "\n" + (found.text or "")).strip()
            return outcome, text[:message_chars]
    return "passed", ""
