"""TransformerEngine's PyTorch extension and Apex, compiled on the node into wheels, and kept.

A compiled wheel only serves a node like the one that built it: the same python, torch build, CUDA toolkit, GPU
architectures and C++ ABI, from the same pinned source and build settings. That is the build key. The wheels are
kept in `<cache>/te-built/<key>/` with `key.json` (the key, each wheel's sha256, how long it took), so the next node
with the same key installs them without compiling; any other key compiles anew. The compile runs `pip wheel
--no-build-isolation` against the node's torch, never reaching an index, its output in a log beside the wheels;
every 30 seconds a line says how long it has run and what it is at.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .artifacts import sha256_file
from .environment import Target
from .errors import PatchlaneError

BUILT_DIR = "te-built"  # under the cache directory
KEY_FILE = "key.json"
HEARTBEAT_S = 30.0

# Runs in the target: what a compiled extension depends on. Imports torch (seconds), so only when something is built.
_KEY_PROBE = r"""
import json, os, platform, re, shutil, subprocess, sys
out = {"python": "cp%d%d" % sys.version_info[:2], "machine": platform.machine()}
try:
    import torch
except Exception as exc:
    print(json.dumps({**out, "error": "torch does not import (%s: %s)" % (type(exc).__name__, exc)}))
    sys.exit(0)
out["torch"] = torch.__version__
out["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
out["cxx11_abi"] = bool(getattr(getattr(torch, "_C", None), "_GLIBCXX_USE_CXX11_ABI", True))
home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
nvcc = os.path.join(home, "bin", "nvcc") if home else (shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
out["nvcc_path"] = nvcc
try:
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", text)
    out["nvcc"] = found.group(1) if found else None
except OSError:
    out["nvcc"] = None
arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
if not arch:
    try:
        arch = ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))
    except Exception:
        arch = ""
out["arch"] = arch
# cudnn.h, which TE's extension includes: torch's extension builds look in $CUDNN_PATH/include; else the toolkit's
# include folder, or the nvidia-cudnn wheel that a CUDA torch brings.
cudnn = os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH")
if not cudnn and not os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include", "cudnn.h")):
    try:
        import glob, nvidia
        hits = [h for root in nvidia.__path__ for h in sorted(glob.glob(os.path.join(root, "*", "include", "cudnn.h"))
                                                              + glob.glob(os.path.join(root, "*", "*", "include", "cudnn.h")))]
        cudnn = os.path.dirname(os.path.dirname(hits[0])) if hits else None
    except ImportError:
        cudnn = None
    out["cudnn_path"] = cudnn or ""
print(json.dumps(out))
"""


@dataclass(frozen=True)
class BuildKey:
    python: str  # cp312
    machine: str
    torch: str  # 2.11.0+cu130
    torch_cuda: str  # the CUDA torch was built with
    nvcc: str  # the toolkit that compiles
    arch: str  # TORCH_CUDA_ARCH_LIST, e.g. 9.0
    cxx11_abi: bool
    sources: str  # what is compiled and how: sha256 of the pinned source ids and the lock's build settings

    def dirname(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        archs = "_".join(a.replace(".", "") for a in self.arch.split(";") if a)
        return f"{self.python}-torch{self.torch}-cuda{self.nvcc}-sm{archs}-{digest}"

    def describe(self) -> str:
        return (f"python {self.python}, torch {self.torch} (CUDA {self.torch_cuda}), nvcc {self.nvcc}, arch {self.arch},"
                f" {self.machine}, cxx11 abi {self.cxx11_abi}")


def probe_key(target: Target, sources: str) -> tuple[BuildKey, dict[str, str]]:
    """The key of what would be compiled in `target`, and the environment the compile needs there (CUDNN_PATH where
    cudnn.h comes from a wheel); refuses, saying why, a target that cannot compile it."""
    proc = subprocess.run([target.python, "-c", _KEY_PROBE], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PatchlaneError(f"--with-te: could not inspect {target.description}:\n{proc.stderr.strip()[-2000:]}")
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in raw:
        raise PatchlaneError(f"--with-te: in {target.description}, {raw['error']}",
                             "TransformerEngine and Apex compile against the node's CUDA torch: build over it (--base-python)")
    if not raw["torch_cuda"]:
        raise PatchlaneError(f"--with-te: torch {raw['torch']} in {target.description} is a CPU build",
                             "TransformerEngine and Apex need a CUDA torch: build over the node's (--base-python)")
    if not raw["nvcc"]:
        raise PatchlaneError(f"--with-te: no CUDA compiler at {raw['nvcc_path']}",
                             "set CUDA_HOME to the CUDA toolkit (its bin/nvcc compiles Apex's kernels)")
    if not raw["arch"]:
        raise PatchlaneError("--with-te: no GPU is visible and TORCH_CUDA_ARCH_LIST is not set, so the GPU architecture"
                             " to compile for is unknown", "build on a GPU node, or set TORCH_CUDA_ARCH_LIST (9.0 for H100/H200)")
    if raw.get("cudnn_path") == "":
        raise PatchlaneError("--with-te: no cudnn.h (TransformerEngine's extension includes it): CUDNN_PATH is not set, the"
                             " toolkit's include folder lacks it and the environment has no nvidia-cudnn wheel",
                             "set CUDNN_PATH to a cuDNN whose include/ holds cudnn.h")
    key = BuildKey(python=raw["python"], machine=raw["machine"], torch=raw["torch"], torch_cuda=raw["torch_cuda"],
                   nvcc=raw["nvcc"], arch=raw["arch"], cxx11_abi=raw["cxx11_abi"], sources=sources)
    return key, ({"CUDNN_PATH": raw["cudnn_path"]} if raw.get("cudnn_path") else {})


@dataclass(frozen=True)
class BuiltWheel:
    path: Path
    seconds: float  # how long its compile took (where it was compiled)
    reused: bool  # found under the key, not compiled now


class WheelStore:
    """`<cache>/te-built/<key>/`: the compiled wheels of one key, by component name ("te", "apex")."""

    def __init__(self, cache_dir: Path, key: BuildKey) -> None:
        self.key = key
        self.dir = cache_dir / BUILT_DIR / key.dirname()

    def _record(self) -> dict:
        path = self.dir / KEY_FILE
        try:
            record = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            return {}
        return record if record.get("key") == asdict(self.key) else {}

    def find(self, component: str) -> BuiltWheel | None:
        """The component's kept wheel, when it is there and intact."""
        entry = self._record().get("wheels", {}).get(component)
        if not entry:
            return None
        path = self.dir / entry["file"]
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            return None
        return BuiltWheel(path=path, seconds=float(entry["seconds"]), reused=True)

    def keep(self, component: str, wheel: Path, seconds: float) -> BuiltWheel:
        """Move a freshly compiled wheel in and record it (file first, then key.json, each replaced atomically)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        dest = self.dir / wheel.name
        staged = self.dir / f".{wheel.name}.partial"
        shutil.copyfile(wheel, staged)
        staged.replace(dest)
        record = self._record() or {"key": asdict(self.key), "wheels": {}}
        record["wheels"][component] = {"file": wheel.name, "sha256": sha256_file(dest), "seconds": round(seconds, 1)}
        partial = self.dir / f".{KEY_FILE}.partial"
        partial.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        partial.replace(self.dir / KEY_FILE)
        return BuiltWheel(path=dest, seconds=seconds, reused=False)


@dataclass(frozen=True)
class CompileJob:
    component: str  # "te" or "apex": its name in the store
    label: str  # what the progress lines call it
    source: Path  # an sdist or a source folder
    env: dict[str, str]


def compile_wheel(target: Target, job: CompileJob, key: BuildKey, node_env: dict[str, str], log_dir: Path,
                  log: Callable[[str], None]) -> tuple[Path, float]:
    """`pip wheel` the job's source in `target` against its installed torch, offline, with `node_env` (probe_key's) set;
    (the wheel, seconds)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{job.component}-build.log"
    out = Path(tempfile.mkdtemp(prefix=f".{job.component}-wheel-", dir=log_dir))
    # No pip configuration and no index: the build never downloads (a find-links of the machine's must not either).
    # TE's and Apex's build switches come from the lock alone (job.env): the kept wheel is reused under a key that does
    # not name the shell's NVTE_*/APEX_* variables (Megatron sets NVTE_*_ATTN in its own process too).
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "APEX_"))}
    env = {**inherited, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_INDEX_URL": "", "PIP_EXTRA_INDEX_URL": "",
           "TORCH_CUDA_ARCH_LIST": key.arch, **node_env, **job.env}
    # Apex compiles APEX_PARALLEL_BUILD extensions side by side, each with MAX_JOBS compilers: share the cores, or nvcc
    # processes (GBs each) outnumber them and the node runs out of memory.
    side_by_side = max(1, int(env.get("APEX_PARALLEL_BUILD", "1") or "1"))
    env.setdefault("MAX_JOBS", str(max(1, (os.cpu_count() or 1) // side_by_side)))
    cmd = [target.python, "-m", "pip", "wheel", "--verbose", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "-w", str(out), str(job.source)]
    log(f"  compiling {job.label} for {key.describe()} (MAX_JOBS={env['MAX_JOBS']}); output: {log_path}")
    start = time.monotonic()
    code, _ = _run_logged(cmd, env, log_path, lambda line: log(f"  {job.label}: {_elapsed(start)} so far; {line}"))
    seconds = time.monotonic() - start
    wheels = sorted(out.glob("*.whl"))
    if code != 0 or len(wheels) != 1:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        shutil.rmtree(out, ignore_errors=True)
        raise PatchlaneError(f"compiling {job.label} failed after {_elapsed(start)} (exit {code}); the last lines of {log_path}:\n{tail}",
                             "the whole output is in that log; nothing was installed")
    log(f"  compiled {wheels[0].name} in {_elapsed(start)}")
    return wheels[0], seconds


def _elapsed(start: float) -> str:
    seconds = int(time.monotonic() - start)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def _run_logged(cmd: list[str], env: dict[str, str], log_path: Path, heartbeat: Callable[[str], None]) -> tuple[int, str]:
    """Run `cmd` with its output in `log_path`; every HEARTBEAT_S seconds `heartbeat(the last output line)`."""
    last = [""]
    with log_path.open("w") as handle, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                        env=env, errors="replace") as proc:
        assert proc.stdout is not None

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                handle.write(line)
                if line.strip():
                    last[0] = line.strip()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while True:
            reader.join(timeout=HEARTBEAT_S)
            if not reader.is_alive():
                break
            heartbeat(last[0][:160] or "(no output yet)")
        code = proc.wait()
    return code, last[0]
