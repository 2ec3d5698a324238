"""Will this markdown render intact on GitHub? The structural mistakes that break a filing body:
unclosed code fences, tables whose rows disagree with their header, a missing separator row, and
raw HTML or relative links that render as nothing on the tracker."""

from __future__ import annotations

import re

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_TABLE_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
_RELATIVE_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s]+)\)")
_HTML = re.compile(r"<(?!!--)(/?)(script|iframe|style|div|span|img|table)\b", re.I)


def _cells(row: str) -> int:
    body = row.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return len(re.split(r"(?<!\\)\|", body))


def markdown_problems(text: str, where: str, max_code_lines: int = 40) -> list[str]:
    problems = []
    lines = text.splitlines()
    fence: tuple[str, int] | None = None
    code_lines = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        match = _FENCE.match(line)
        if fence is not None:
            if match and match.group(1)[0] == fence[0][0] and len(match.group(1)) >= len(fence[0]) and not match.group(2).strip():
                if code_lines > max_code_lines:
                    problems.append(f"{where}:{fence[1]}: a {code_lines}-line code block: attach code as a file instead of pasting it")
                fence = None
            else:
                code_lines += 1
            i += 1
            continue
        if match:
            fence, code_lines = (match.group(1), i + 1), 0
            i += 1
            continue
        if line.lstrip().startswith("|"):
            start = i
            rows = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(lines[i])
                i += 1
            if len(rows) < 2 or not _TABLE_SEPARATOR.match(rows[1]):
                problems.append(f"{where}:{start + 1}: table without a header separator row (| --- | --- |) renders as text")
                continue
            width = _cells(rows[0])
            for offset, row in enumerate(rows[1:], start=1):
                if _cells(row) != width:
                    problems.append(f"{where}:{start + offset + 1}: table row has {_cells(row)} cells, its header {width}")
            continue
        for m in _RELATIVE_LINK.finditer(line):
            problems.append(f"{where}:{i + 1}: relative link {m.group(1)!r} does not resolve on the tracker; use a full URL"
                            " or name the attachment")
        for m in _HTML.finditer(line):
            problems.append(f"{where}:{i + 1}: raw HTML <{m.group(2)}> is stripped or altered by GitHub")
        i += 1
    if fence is not None:
        problems.append(f"{where}:{fence[1]}: code fence {fence[0]} is never closed: everything after it renders as code")
    return problems
