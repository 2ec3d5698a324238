"""patches/manifest.toml: the append-only validation manifest.

Each record says what was validated, on which host (GPU name and compute capability or `cpu`,
driver, python/torch/triton/CUDA versions), against which upstream commit and patch checksum,
with which command, exit code and sentinels, and when. Records are only ever appended.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import PatchlaneError

MANIFEST_RELATIVE_PATH = Path("patches/manifest.toml")
HEADER = (
    "# Validation manifest: append-only records written by tools/apply_patches.py (manifest add, packs).\n"
    "# The only source of truth for what was validated where and when. Do not edit records by hand.\n"
)

# Runs in the interpreter under test; everything optional, so a bare CPU host stamps as well.
_STAMP = r"""
import json, platform, subprocess, sys
s = {"python": platform.python_version(), "gpu": "cpu", "capability": "", "driver": "", "torch": "", "triton": "", "cuda": ""}
try:
    import torch
    s["torch"] = torch.__version__
    s["cuda"] = torch.version.cuda or ""
    if torch.cuda.is_available():
        s["gpu"] = torch.cuda.get_device_name(0)
        s["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
except Exception:
    pass
try:
    import triton
    s["triton"] = triton.__version__
except Exception:
    pass
try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
    s["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
except Exception:
    pass
print(json.dumps(s))
"""


@dataclass(frozen=True)
class HostStamp:
    gpu: str
    capability: str
    driver: str
    python: str
    torch: str
    triton: str
    cuda: str

    def line(self) -> str:
        gpu = f"{self.gpu} (sm {self.capability})" if self.capability else self.gpu
        return (f"host: gpu={gpu} driver={self.driver or '-'} python={self.python} torch={self.torch or '-'}"
                f" triton={self.triton or '-'} cuda={self.cuda or '-'}")


_HOST_KEYS = ("gpu", "driver", "python", "torch", "triton", "cuda")


def parse_host_line(line: str) -> HostStamp:
    """Read a reproducer's first line (`host: gpu=NAME (sm X.Y) driver=... python=... ...`) back into a stamp,
    so a result measured on another machine is recorded with that machine's stamp, not this one's."""
    if not line.startswith("host: "):
        raise PatchlaneError(f"not a host stamp line (must start with 'host: '): {line[:80]!r}")
    body = line[len("host: "):]
    values = {}
    for index, key in enumerate(_HOST_KEYS):
        start = body.find(f"{key}=")
        if start < 0:
            raise PatchlaneError(f"host stamp line has no {key}=: {line[:120]!r}")
        nxt = [body.find(f" {k}=", start) for k in _HOST_KEYS[index + 1 :]] + [body.find(" upstream=", start)]
        ends = [e for e in nxt if e >= 0]
        values[key] = body[start + len(key) + 1 : min(ends) if ends else len(body)].strip()
    gpu, capability = values["gpu"], ""
    if gpu.endswith(")") and " (sm " in gpu:
        gpu, capability = gpu[:-1].split(" (sm ", 1)
    clean = {k: ("" if v == "-" else v) for k, v in values.items()}
    return HostStamp(gpu=gpu, capability=capability, driver=clean["driver"], python=clean["python"],
                     torch=clean["torch"], triton=clean["triton"], cuda=clean["cuda"])


def host_stamp(python: str) -> HostStamp:
    proc = subprocess.run([python, "-c", _STAMP], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PatchlaneError(f"could not stamp the host with {python}: {proc.stderr.strip()}")
    return HostStamp(**json.loads(proc.stdout))


@dataclass(frozen=True)
class Record:
    what: str  # a patch file (patches/<up>/<name>) or a pack id
    upstream: str
    upstream_commit: str
    patch_sha256: str  # patch_checksum(): sha256 of the diff section
    host: HostStamp
    command: str
    exit_code: int
    sentinels: tuple[str, ...]
    date: str
    figures: str = ""  # free-form measured figures, e.g. "peak before 32.5 GiB, after 2.0 GiB"
    pack: str = ""  # set by `packs run`: the pack id,
    side: str = ""  # which tree it ran on (base | patched),
    tree_commit: str = ""  # and that tree's commit (the tool's commits are reproducible across machines)


def _toml_string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # JSON strings are valid TOML basic strings


def render_record(record: Record) -> str:
    lines = ["", "[[record]]"]
    for key, value in asdict(record).items():
        if key == "host":
            continue
        if isinstance(value, (list, tuple)):
            lines.append(f"{key} = [{', '.join(_toml_string(v) for v in value)}]")
        elif isinstance(value, int):
            lines.append(f"{key} = {value}")
        else:
            lines.append(f"{key} = {_toml_string(value)}")
    lines.append("[record.host]")
    lines += [f"{k} = {_toml_string(v)}" for k, v in asdict(record.host).items()]
    return "\n".join(lines) + "\n"


def append_record(root: Path, record: Record) -> Path:
    path = root / MANIFEST_RELATIVE_PATH
    existing = path.read_text() if path.exists() else HEADER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(existing + render_record(record))
    read_records(root)  # the file must stay valid TOML
    return path


def merge_records(root: Path, other: Path) -> int:
    """Append the records of another copy of the manifest (written on a GPU host, say) that this one lacks."""
    try:
        theirs = tomllib.loads(other.read_text()).get("record", [])
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PatchlaneError(f"{other}: not a readable manifest: {exc}") from exc
    ours = read_records(root)
    added = 0
    for raw in theirs:
        if raw in ours:
            continue
        host = HostStamp(**{k: raw["host"].get(k, "") for k in HostStamp.__dataclass_fields__})
        fields = {k: raw[k] for k in Record.__dataclass_fields__ if k in raw and k != "host"}
        fields["sentinels"] = tuple(fields.get("sentinels", ()))
        append_record(root, Record(host=host, **fields))
        ours.append(raw)
        added += 1
    return added


def read_records(root: Path) -> list[dict]:
    path = root / MANIFEST_RELATIVE_PATH
    if not path.exists():
        return []
    try:
        return tomllib.loads(path.read_text()).get("record", [])
    except tomllib.TOMLDecodeError as exc:
        raise PatchlaneError(f"{path}: invalid TOML: {exc}") from exc


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def patch_checksum(path: Path) -> str:
    """sha256 of a patch's diff section: what was validated. Header edits (a new Upstream-Status
    after filing, say) leave it unchanged; any change to the code it applies changes it."""
    from .patchfile import read_patch

    return hashlib.sha256(read_patch(path).diff.encode()).hexdigest()
