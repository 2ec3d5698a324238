"""patches/manifest.toml: the append-only validation manifest.

Each record says what was validated, on which host (GPU name and compute capability or `cpu`,
driver, python/torch/triton/CUDA versions), against which upstream commit and patch checksum,
with which command, exit code and sentinels, and when. A train record (`kind = "train"`) says
instead which commit trained, with which command, and the run's figures (steps, first and final
loss, tokens/s/GPU, TFLOP/s/GPU, peak memory, time to the first step), as the run's own summary
states them. A GPU-test record (`kind = "gpu-tests"`) lists a GPU host's test outcomes and the
sentinel lines its passing tests printed. Records are only ever appended, one process at a time
(under patches/.manifest.lock), and the file is replaced whole so that a reader never sees half of it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import math
import os
import stat
import subprocess
import tempfile
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from .checkout_lock import held_exclusively
from .errors import PatchlaneError

MANIFEST_RELATIVE_PATH = Path("patches/manifest.toml")
MANIFEST_LOCK_RELATIVE_PATH = Path("patches/.manifest.lock")
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


@dataclass(frozen=True)
class TrainRecord:
    """A training run, with the figures its run directory's summary.json states (`python -m nam56r.training.runs.summarize
    RUN_DIR --record` builds it there; this module only knows its shape)."""

    what: str  # "train:<recipe>"
    host: HostStamp  # the host that recorded it: the one that trained
    commit: str  # this repository's commit when recorded
    dirty: bool  # tracked files differed from that commit
    command: str  # the run's exact launch command (its command.sh)
    exit_code: int  # 0 when the run reached its recipe's last step, 1 when it stopped short of it
    sentinels: tuple[str, ...]
    date: str
    run_dir: str
    recipe: str
    preset: str
    world_size: int
    seq_length: int
    global_batch_size: int
    first_step: int
    last_step: int
    loss_first: float  # 'lm loss' at first_step (nan when not finite)
    loss_final: float  # 'lm loss' at last_step
    tokens_per_s_per_gpu: float  # medians over the summary's steady-state window
    tflops_per_s_per_gpu: float
    peak_memory_gib: float | None  # None: the run did not log it (left out of the TOML)
    time_to_first_step_s: float | None  # from Megatron's initialization to the first logged step
    figures: str = ""
    kind: str = "train"


@dataclass(frozen=True)
class GpuTestsRecord:
    """A GPU host's run of the GPU test suite (`python -m nam56r.training.gpu_check`'s tests part): every test's
    outcome and the sentinel lines the passing tests printed with their figures."""

    what: str  # "gpu-tests"
    host: HostStamp
    commit: str
    dirty: bool
    command: str
    exit_code: int  # pytest's
    sentinels: tuple[str, ...]  # e.g. "KILL_DURING_SAVE_OK gpu=NVIDIA H200 ... max_abs_loss_diff=0.000012"
    date: str
    passed: tuple[str, ...]  # test ids
    failed: tuple[str, ...]  # failed or errored
    skipped: tuple[str, ...]
    figures: str = ""
    kind: str = "gpu-tests"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else "inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(_toml_value(v) for v in value)}]"
    return json.dumps(str(value), ensure_ascii=False)  # JSON strings are valid TOML basic strings


def render_record(record: Record | TrainRecord | GpuTestsRecord) -> str:
    """One `[[record]]` table; None fields are left out (TOML has no null)."""
    lines = ["", "[[record]]"]
    for key, value in asdict(record).items():
        if key != "host" and value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    lines.append("[record.host]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in asdict(record.host).items()]
    return "\n".join(lines) + "\n"


def manifest_lock(root: Path) -> contextlib.AbstractContextManager[None]:
    """Held for every read-modify-write of the manifest: two processes appending at once (a packs run beside a
    training run's record) would otherwise each write what it read plus its own record, losing the other's."""
    return held_exclusively(root / MANIFEST_LOCK_RELATIVE_PATH, "the validation manifest", notice_after=5.0)


def _write_atomically(path: Path, text: str) -> None:
    """Readers (`manifest list`, read_records) never take the lock: they see the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _append_rendered(root: Path, records: list[Record | TrainRecord | GpuTestsRecord]) -> Path:
    """Append `records` in one write; the caller holds manifest_lock."""
    path = root / MANIFEST_RELATIVE_PATH
    text = (path.read_text() if path.exists() else HEADER) + "".join(render_record(r) for r in records)
    try:
        tomllib.loads(text)  # the file must stay valid TOML: checked before it is written
    except tomllib.TOMLDecodeError as exc:
        what = ", ".join(r.what for r in records)
        raise PatchlaneError(f"{path}: appending {what} would make it invalid TOML ({exc}); nothing was written") from exc
    _write_atomically(path, text)
    return path


def append_record(root: Path, record: Record | TrainRecord | GpuTestsRecord) -> Path:
    with manifest_lock(root):
        return _append_rendered(root, [record])


def record_from_table(raw: dict) -> Record | TrainRecord | GpuTestsRecord:
    """A `[[record]]` table read back into its record type (train and GPU-test records by `kind`)."""
    cls = {"train": TrainRecord, "gpu-tests": GpuTestsRecord}.get(raw.get("kind", ""), Record)
    host = HostStamp(**{k: raw.get("host", {}).get(k, "") for k in HostStamp.__dataclass_fields__})
    fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw and k != "host"}
    for key in ("sentinels", "passed", "failed", "skipped"):
        if key in cls.__dataclass_fields__:
            fields[key] = tuple(fields.get(key, ()))
    if cls is TrainRecord:
        fields.setdefault("peak_memory_gib", None)
        fields.setdefault("time_to_first_step_s", None)
    try:
        return cls(host=host, **fields)
    except TypeError as exc:
        raise PatchlaneError(f"manifest record {raw.get('what', '?')!r} lacks fields of a {cls.__name__}: {exc}") from exc


def merge_records(root: Path, other: Path) -> int:
    """Append the records of another copy of the manifest (written on a GPU host, say) that this one lacks."""
    try:
        theirs = tomllib.loads(other.read_text()).get("record", [])
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PatchlaneError(f"{other}: not a readable manifest: {exc}") from exc
    with manifest_lock(root):
        # Compared as JSON text: a record holding nan (a diverged run's loss) never equals itself as a dict.
        ours = {json.dumps(raw, sort_keys=True) for raw in read_records(root)}
        new = []
        for raw in theirs:
            if json.dumps(raw, sort_keys=True) in ours:
                continue
            new.append(record_from_table(raw))
            ours.add(json.dumps(raw, sort_keys=True))
        if new:
            _append_rendered(root, new)
    return len(new)


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


def patch_checksum(path: Path, with_tests: bool = False) -> str:
    """sha256 of a patch's diff section: what was validated. Header edits (a new Upstream-Status
    after filing, say) leave it unchanged; any change to the code it applies changes it. Its updates of
    upstream's own tests count only `with_tests` (what `upstream-tests` validates): a reproducer runs without them."""
    from .patchfile import read_patch

    patch = read_patch(path)
    return hashlib.sha256((patch.diff if with_tests else patch.code_diff()).encode()).hexdigest()
