"""Find private infrastructure in text meant for a public upstream tracker.

Flags: IP addresses, internal host names, home and cluster paths, bucket URLs, non-public branch
names, e-mail addresses and @-mentions of people who are not listed authors, and any term the
project lists as private (patches/packs/scrub.toml). Each finding names the line and what matched,
so a person can fix it; nothing is rewritten.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

SCRUB_CONFIG_RELATIVE_PATH = Path("patches/packs/scrub.toml")

_IPV4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?!\w|\.\w)")
_IPV6 = re.compile(r"(?<![\w:])([0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7})(?![\w:])")
_INTERNAL_HOST = re.compile(
    r"\b[a-z0-9][a-z0-9-]*(?:\.[a-z0-9-]+)*\.(?:internal|local|lan|corp|intra|intranet|cluster|svc|home|priv|private)\b", re.I
)
_NODE_NAME = re.compile(r"\b(?:[a-z0-9]+-)*(?:node|gpu|login|worker|host|dgx|hgx)[-_]?\d{1,4}(?:[-.][a-z0-9]+)*\b", re.I)
_PATHS = re.compile(
    r"(?<![\w.])(?:/home/[\w.-]+\S*|/Users/[\w.-]+\S*|/root/[\w.-]+\S*|~[a-z_][\w.-]*/\S*|/lustre\S*|/gpfs\S*|/scratch\S*|/fsx\S*"
    r"|/nfs\S*|/mnt/\S+|/data\d*/\S+|/net/\S+|/shared/\S+|/work/\S+|/workspace/\S+|/opt/\w+/\S+|/tmp/\S+|[A-Z]:\\Users\\\S+)"
)
_BUCKET = re.compile(
    r"\b(?:s3|gs|gcs|az|abfss?|wasbs?|r2|oss|hdfs)://\S+|\b[\w.-]+\.(?:blob\.core\.windows\.net|s3[\w.-]*\.amazonaws\.com)\S*"
    r"|\bstorage\.googleapis\.com/\S+|\b[\w.-]+\.r2\.cloudflarestorage\.com\S*",
    re.I,
)
_BRANCH = re.compile(r"(?<![\w/.-])(?:internal|private|wip|users?|feature|hotfix|exp|experiment)/[\w.-]+")
# What each match of these is, in the order a line's findings list them.
_NAMES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("internal host name", _INTERNAL_HOST),
    ("host name", _NODE_NAME),
    ("private path", _PATHS),
    ("bucket URL", _BUCKET),
    ("non-public branch name", _BRANCH),
)
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_MENTION = re.compile(r"(?<![\w@/.`])@([A-Za-z0-9](?:[A-Za-z0-9-]{0,38}))\b(?!\.[A-Za-z_])")  # @pkg.decorator is code
_DECORATOR_LINE = re.compile(r"^\s*@[\w.]+(\(.*\))?\s*(#.*)?$")
_INLINE_CODE = re.compile(r"`[^`]*`")
# Credentials, by the shapes their issuers document. A finding shows only the first characters of one.
_SECRETS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})\b")),
    ("Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b")),
    ("AWS secret access key", re.compile(r"(?i)aws_secret_access_key\s*[=:]\s*['\"]?[A-Za-z0-9/+]{40}\b")),
    ("GCP API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b")),
    ("GCP service-account key", re.compile(r"\"private_key_id\"\s*:\s*\"[0-9a-f]{20,}\"")),
    ("Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b")),
    ("Slack webhook", re.compile(r"https://hooks\.slack\.com/services/[A-Za-z0-9/]+")),
    ("bearer token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{20,}=*")),
    ("private key", re.compile(r"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")),
    ("netrc credentials", re.compile(r"(?i)\bmachine\s+\S+\s+login\s+\S+\s+password\s+\S+")),
)
_PUBLIC_IPS = {"0.0.0.0", "127.0.0.1"}


@dataclass(frozen=True)
class Finding:
    where: str  # file:line
    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.kind}: {self.text!r}"


@dataclass(frozen=True)
class ScrubConfig:
    authors: tuple[str, ...] = ()  # names, GitHub handles or e-mails that may appear
    private_terms: tuple[str, ...] = ()  # cluster names, code names: always flagged (case-insensitive)
    allow: tuple[str, ...] = ()  # exact strings that look private but are public (e.g. an upstream path)


def load_config(root: Path) -> ScrubConfig:
    path = root / SCRUB_CONFIG_RELATIVE_PATH
    if not path.exists():
        return ScrubConfig()
    raw = tomllib.loads(path.read_text())
    return ScrubConfig(authors=tuple(raw.get("authors", [])), private_terms=tuple(raw.get("private_terms", [])),
                       allow=tuple(raw.get("allow", [])))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return text not in _PUBLIC_IPS


def scan_text(text: str, where: str, config: ScrubConfig) -> list[Finding]:
    """Every suspicious match in `text`, one finding per match, `where` naming the file."""
    authors = {a.lower().lstrip("@") for a in config.authors}
    findings = []
    for number, line in enumerate(text.splitlines(), start=1):
        for allowed in config.allow:
            line = line.replace(allowed, " ")
        at = f"{where}:{number}"

        def add(kind: str, match: str, at: str = at) -> None:
            findings.append(Finding(at, kind, match))

        for m in _IPV4.finditer(line):
            if _is_ip(m.group(1)):
                add("IP address", m.group(1))
        for m in _IPV6.finditer(line):  # two hex groups at least: `x[::17]` is a slice
            if _is_ip(m.group(1)) and sum(1 for g in m.group(1).split(":") if g) >= 2:
                add("IP address", m.group(1))
        for kind, pattern in _NAMES:
            for m in pattern.finditer(line):
                add(kind, m.group(0))
        for m in _EMAIL.finditer(line):
            if m.group(0).lower() not in authors and not m.group(0).lower().endswith((".invalid", "@example.com")):
                add("e-mail address of someone not listed as an author", m.group(0))
        prose = "" if _DECORATOR_LINE.match(line) and not where.endswith(".md") else _INLINE_CODE.sub(" ", line)
        for m in _MENTION.finditer(prose):
            if m.group(1).lower() not in authors:
                add("@-mention of someone not listed as an author", "@" + m.group(1))
        for kind, pattern in _SECRETS:
            for m in pattern.finditer(line):
                add(f"secret ({kind})", m.group(0)[:8] + "... (masked)")
        lowered = line.lower()
        for term in config.private_terms:
            if term.lower() in lowered:
                add("private term (patches/packs/scrub.toml)", term)
    return findings


def added_lines(patch_text: str) -> str:
    """The parts of a patch that are ours: its header and description, and the lines it adds."""
    out = []
    in_diff = False
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            in_diff = True
            continue
        if not in_diff:
            out.append(line)
        elif line.startswith("+") and not line.startswith("+++"):
            out.append(line[1:])
        else:
            out.append("")  # keep line numbers roughly aligned with nothing to flag
    return "\n".join(out)
