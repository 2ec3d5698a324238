"""A portable compiled-kernel cache: one directory holding the Triton, TileLang and Inductor on-disk caches, with a
manifest (`kernel-cache.json`) that names the stack the kernels were compiled for.

Why: a fresh node compiles the same TileLang and Triton kernels for the same shapes on the same GPU type, driver
and versions as every other node of the cluster, minutes before its first step. A cache filled once (`nox -s
prewarm`, or any run given `--kernel-cache DIR`) and carried to the other nodes serves them without compiling.

The compilers' own keys do not make a directory portable on their own, so this module adds what they lack:
- TileLang's key holds the target "auto", not the GPU architecture: an sm_90 kernel would load on another GPU.
  The manifest's key holds the architecture, and a cache whose key differs from this host's is refused (or,
  asked, ignored with a message), never used silently.
- TileLang's key also stamps libtilelang.so's size and mtime. The build gives the wheel's installed files the
  wheel's own timestamps, so every node built from the pinned wheel stamps the same value; a different stamp is a
  key mismatch named here.
- Triton's group files (`__grp__*.json`) list their artifacts by absolute path: a directory moved to another path
  misses every kernel. Opening a cache rewrites those paths to where the directory now is.

Layout: DIR/kernel-cache.json, DIR/triton (TRITON_CACHE_DIR), DIR/tilelang (TILELANG_CACHE_DIR), DIR/inductor
(TORCHINDUCTOR_CACHE_DIR). A process given the cache writes new kernels into it as it compiles them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SCHEMA = "nam56r.kernel_cache/1"
MANIFEST = "kernel-cache.json"
TOOLS = ("triton", "tilelang", "inductor")
TOOL_ENV = {"triton": "TRITON_CACHE_DIR", "tilelang": "TILELANG_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}
OnMismatch = Literal["refuse", "ignore"]
ON_MISMATCH = ("refuse", "ignore")

# Run with the training interpreter: it imports torch, triton and tilelang as a run does.
_KEY_PROBE = r"""
import json, platform, subprocess
import torch, triton, tilelang
from tilelang.cache.kernel_cache import KernelCache
if not torch.cuda.is_available():
    raise SystemExit("no CUDA GPU visible to torch " + torch.__version__)
smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
print(json.dumps({
    "gpu": torch.cuda.get_device_name(0),
    "capability": "{}.{}".format(*torch.cuda.get_device_capability(0)),
    "driver": smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "",
    "cuda": torch.version.cuda or "", "python": platform.python_version(), "torch": torch.__version__,
    "triton": triton.__version__, "tilelang": tilelang.__version__,
    "tilelang_lib": KernelCache._get_tilelang_lib_stamp() or "",
}))
"""


class KernelCacheError(RuntimeError):
    pass


@dataclass(frozen=True)
class CacheKey:
    """What compiled kernels depend on besides their source and shapes. `gpu` is named, not compared: every GPU
    of one architecture runs the same cubins."""

    gpu: str
    capability: str
    driver: str
    cuda: str
    python: str
    torch: str
    triton: str
    tilelang: str
    tilelang_lib: str  # TileLang's own stamp of libtilelang.so (name:size:mtime_ns), part of its kernel key

    COMPARED = ("capability", "driver", "cuda", "python", "torch", "triton", "tilelang", "tilelang_lib")

    def mismatches(self, other: CacheKey) -> list[str]:
        """'field: cache X, this host Y' for each compared field that differs (`self` is the cache's key)."""
        return [f"{name}: cache {getattr(self, name)!r}, this host {getattr(other, name)!r}"
                for name in self.COMPARED if getattr(self, name) != getattr(other, name)]

    def describe(self) -> str:
        return (f"{self.gpu} (sm {self.capability}), driver {self.driver}, CUDA {self.cuda}, python {self.python}, "
                f"torch {self.torch}, triton {self.triton}, tilelang {self.tilelang}")


def host_key(python: str = sys.executable) -> CacheKey:
    """This host's key, read by `python` (the interpreter that trains) on its first CUDA GPU."""
    proc = subprocess.run([python, "-c", _KEY_PROBE], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise KernelCacheError(f"could not read this host's kernel-cache key with {python}: {last}")
    return CacheKey(**json.loads(proc.stdout))


@dataclass(frozen=True)
class ToolContents:
    kernels: int
    bytes: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    key: CacheKey
    created_utc: str
    filled_by: tuple[str, ...] = ()  # what compiled into it: "train tiny-1gpu mbs 8 seq 512", "gpu-check", ...
    contents: dict[str, ToolContents] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.contents.values())

    def weight(self) -> dict:
        """What a summary records of the cache's size: `weight_line` and the bytes."""
        return {"weight": weight_line(self), "total_bytes": self.total_bytes}

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "key": dataclasses.asdict(self.key), "created_utc": self.created_utc,
                "filled_by": list(self.filled_by), "total_bytes": self.total_bytes,
                "contents": {tool: dataclasses.asdict(c) for tool, c in self.contents.items()}}

    @classmethod
    def from_json(cls, data: Mapping, where: Path) -> Manifest:
        if data.get("schema") != SCHEMA:
            raise KernelCacheError(f"{where}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
        try:
            contents = {tool: ToolContents(c["kernels"], c["bytes"], tuple(c["names"])) for tool, c in data["contents"].items()}
            return cls(CacheKey(**data["key"]), data["created_utc"], tuple(data["filled_by"]), contents)
        except (KeyError, TypeError) as exc:
            raise KernelCacheError(f"{where} is not a kernel-cache manifest: {type(exc).__name__}: {exc}") from None


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_manifest(directory: Path) -> Manifest | None:
    """The directory's manifest; None when it has none."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        return Manifest.from_json(json.loads(path.read_text()), path)
    except json.JSONDecodeError as exc:
        raise KernelCacheError(f"{path} is not JSON: {exc}") from None


def write_manifest(directory: Path, manifest: Manifest) -> None:
    tmp = directory / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    tmp.replace(directory / MANIFEST)  # never a half-written manifest


def fill_label(recipe: str, micro_batch: int, seq_length: int) -> str:
    """How the manifest names a training run's fill."""
    return f"train {recipe} mbs {micro_batch} seq {seq_length}"


def cache_env(directory: Path) -> dict[str, str]:
    """The variables that point each compiler's disk cache into `directory`; Triton keeps autotuning results there."""
    return {**{env: str(directory / tool) for tool, env in TOOL_ENV.items()}, "TRITON_CACHE_AUTOTUNING": "1"}


def relocate_triton_groups(triton_dir: Path) -> int:
    """Point every Triton group file's artifact paths into the directory it lies in now; the number rewritten."""
    rewritten = 0
    for group in triton_dir.glob("*/__grp__*.json"):
        data = json.loads(group.read_text())
        paths = data.get("child_paths")
        if not isinstance(paths, dict):
            continue
        moved = {name: str(group.parent / Path(path).name) for name, path in paths.items()}
        if moved != paths:
            tmp = group.with_name(f".{group.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**data, "child_paths": moved}))
            tmp.replace(group)
            rewritten += 1
    return rewritten


def inventory(directory: Path) -> dict[str, ToolContents]:
    """What each compiler's cache holds: kernels (Triton: compiled kernels; TileLang: kernel directories;
    Inductor: files), bytes, and the kernel names."""
    contents = {}
    for tool in TOOLS:
        root = directory / tool
        files = [p for p in root.rglob("*") if p.is_file() and "tmp" not in p.relative_to(root).parts[:1]] if root.is_dir() else []
        if tool == "triton":
            names = sorted(p.stem.removeprefix("__grp__") for p in root.glob("*/__grp__*.json")) if root.is_dir() else []
        elif tool == "tilelang":
            # One directory per kernel, each with its launch parameters (the library's file name depends on the backend).
            names = sorted(_tilelang_name(p.parent) for p in root.glob("*/params.pkl")) if root.is_dir() else []
        else:
            names = []
        contents[tool] = ToolContents(len(names) if tool != "inductor" else len(files), sum(p.stat().st_size for p in files),
                                      tuple(names))
    return contents


_GLOBAL_FUNCTION = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")


def _tilelang_name(entry: Path) -> str:
    """A TileLang cache entry's kernel name (its first __global__ function), else its key."""
    source = entry / "device_kernel.cu"
    found = _GLOBAL_FUNCTION.search(source.read_text(errors="replace")) if source.is_file() else None
    return found[1] if found else entry.name


@dataclass(frozen=True)
class CacheUse:
    """What opening a kernel cache decided: the variables to run with (none when ignored) and what to tell the user."""

    directory: Path
    state: Literal["created", "warm", "ignored"]
    env: dict[str, str]
    message: str


def open_cache(directory: Path, key: CacheKey, on_mismatch: OnMismatch = "refuse") -> CacheUse:
    """Open `directory` as this host's kernel cache: create it (empty or missing), use it (its key matches `key`),
    or, when its key differs, refuse (KernelCacheError naming every mismatch) or ignore it, as `on_mismatch` says."""
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}")
    directory = directory.resolve()
    if directory.exists() and not directory.is_dir():
        raise KernelCacheError(f"kernel cache {directory} is not a directory")
    manifest = read_manifest(directory) if directory.is_dir() else None
    if manifest is None:
        # Ranks start beside the launch-time check and their imports create empty compiler directories in it
        # (TileLang's tmp/, Inductor's root), so only a file makes a directory someone else's.
        if directory.is_dir() and any(p.is_file() or p.is_symlink() for p in directory.rglob("*")):
            raise KernelCacheError(f"{directory} is neither empty nor a kernel cache (no {MANIFEST}): name an empty or new "
                                   f"directory to fill, or one that `nox -s prewarm` filled")
        directory.mkdir(parents=True, exist_ok=True)
        write_manifest(directory, Manifest(key, _now()))
        return CacheUse(directory, "created", cache_env(directory),
                        f"kernel cache {directory}: new, for {key.describe()}; this run compiles into it")
    if problems := manifest.key.mismatches(key):
        what = f"kernel cache {directory} was filled for another stack ({'; '.join(problems)})"
        if on_mismatch == "refuse":
            raise KernelCacheError(f"{what}. Fill one on this stack (`nox -s prewarm -- --out DIR ...`), or pass "
                                   f"--kernel-cache-mismatch ignore to run without it")
        return CacheUse(directory, "ignored", {}, f"{what}: ignored, as --kernel-cache-mismatch ignore asks; kernels "
                                                  f"compile into the compilers' default caches")
    moved = relocate_triton_groups(directory / "triton")
    held = sum(c.kernels for tool, c in manifest.contents.items() if tool != "inductor")
    return CacheUse(directory, "warm", cache_env(directory),
                    f"kernel cache {directory}: {held} kernels for {key.describe()}"
                    + (f" ({moved} Triton groups pointed at this path)" if moved else ""))


def record_fill(directory: Path, what: str) -> Manifest:
    """Add `what` to the manifest's fills and take stock of its contents; the updated manifest."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise KernelCacheError(f"{directory} has no {MANIFEST}: open it with `open_cache` first")
    fills = manifest.filled_by if what in manifest.filled_by else (*manifest.filled_by, what)
    updated = dataclasses.replace(manifest, filled_by=fills, contents=inventory(directory))
    write_manifest(directory, updated)
    return updated


def weight_line(manifest: Manifest) -> str:
    """'N Triton kernels, M TileLang kernels, X MiB' for a manifest's contents."""
    c = manifest.contents
    mib = sum(t.bytes for t in c.values()) / 2**20
    parts = [f"{c[t].kernels} {label} kernels" for t, label in (("triton", "Triton"), ("tilelang", "TileLang")) if t in c]
    if "inductor" in c and c["inductor"].kernels:
        parts.append(f"{c['inductor'].kernels} Inductor files")
    return f"{', '.join(parts) or 'empty'}; {mib:.1f} MiB"


@dataclass(frozen=True)
class KernelCacheChoice:
    """The launcher's `--kernel-cache`: the variables the ranks get and when the cache's key is checked. A refused
    mismatch is found while the ranks import (they wait at the launch gate, so a refused cache compiles nothing);
    ignoring one needs the verdict before torchrun starts, as it decides their variables."""

    directory: Path | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    check_at_launch: bool = False
    note: str = ""

    @classmethod
    def from_launcher(cls, directory: Path | None, on_mismatch: OnMismatch, *, planned_only: bool) -> KernelCacheChoice:
        """`planned_only`: a dry run or a Slurm script, which reads the manifest but starts nothing here."""
        if directory is None:
            return cls()
        directory = directory.resolve()
        if planned_only:
            manifest = read_manifest(directory) if directory.is_dir() else None
            held = f"filled for {manifest.key.describe()}" if manifest else "new: the run fills it"
            return cls(directory, note=f"{directory} ({held}); its key is checked against this host's at launch")
        if on_mismatch == "ignore":
            use = open_cache(directory, host_key(), "ignore")
            return cls(directory, use.env, note=use.message)
        return cls(directory, cache_env(directory), check_at_launch=True,
                   note=f"{directory}; its key is checked against this host's while the ranks start")

    def open(self) -> CacheUse:
        """The launch-time check of a refusing choice (KernelCacheError on a mismatch)."""
        if self.directory is None:
            raise KernelCacheError("no --kernel-cache was given")
        return open_cache(self.directory, host_key(), "refuse")
