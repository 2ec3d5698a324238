"""Wheels for an offline cache: resolve the requirement groups for a target interpreter and platform
through pip (the user's index configuration), leave out what the target brings itself, download the
rest with their hashes checked by pip.

Resolution is one `pip install --dry-run --report` over every group at once, so the cache holds one
consistent set (one numpy, not one per group). A distribution in `exclude` (torch for the gpu profile:
the node's own CUDA build is used) is left out together with whatever only it needs (its CUDA
libraries, triton); the report's dependency metadata says which those are.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .artifacts import PIP_INTERNALS
from .errors import PatchlaneError
from .wheeltarget import WheelTarget

try:  # the interpreter running this tool has pip, not necessarily `packaging`
    from packaging.markers import Marker
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover - depends on the interpreter
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement



def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class ResolvedWheel:
    name: str  # canonical
    version: str
    filename: str
    sha256: str | None  # from the index; None when it published none (then computed after download)
    requires: tuple[str, ...]


def run_pip(args: list[str], target: WheelTarget, stream=None) -> subprocess.CompletedProcess:
    """`python -m pip ARGS` with the target's environment markers; `stream(line)` sees stdout lines as they come."""
    cmd = [sys.executable, str(PIP_INTERNALS), "run", json.dumps({"args": args, "markers": target.markers()})]
    if stream is None:
        return subprocess.run(cmd, capture_output=True, text=True)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        out = []
        for line in proc.stdout:
            out.append(line)
            stream(line.rstrip("\n"))
        err = proc.stderr.read()
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out), err)


def _tail(proc: subprocess.CompletedProcess, lines: int = 20) -> str:
    text = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if "is ignored: it is neither a file nor a directory" not in ln]
    return "\n".join(text[-lines:])


def resolve(requirements: list[str], target: WheelTarget) -> tuple[dict[str, ResolvedWheel], dict[str, str]]:
    """Every wheel the requirements need on the target: {canonical name: wheel}, and the marker environment used."""
    with tempfile.TemporaryDirectory(prefix="nam56r-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check", "--report", str(report),
                "--target", str(Path(tmp) / "target"), *target.pip_args(), *requirements]
        proc = run_pip(args, target)
        if proc.returncode != 0 or not report.is_file():
            raise PatchlaneError(
                f"pip could not resolve wheels for {target.describe()}:\n{_tail(proc)}",
                "check your package index configuration (pip config list); every requirement needs a wheel for the"
                " target (--only-binary); a missing platform tag can be added with --platform",
            )
        data = json.loads(report.read_text())
    environment = data.get("environment", {})
    wanted = target.markers()
    if any(environment.get(k) != v for k, v in wanted.items()):
        raise PatchlaneError(f"pip evaluated markers for {environment.get('python_version')}, not the target's {wanted}",
                             f"this pip does not take the marker override of {PIP_INTERNALS.name}; run cache fill with another pip")
    wheels = {}
    for item in data["install"]:
        meta, info = item["metadata"], item["download_info"]
        filename = unquote(urlsplit(info["url"]).path.rsplit("/", 1)[-1])
        if not filename.endswith(".whl"):
            raise PatchlaneError(f"pip resolved {meta['name']} {meta['version']} to {filename}, not a wheel")
        hashes = info.get("archive_info", {}).get("hashes", {})
        legacy = info.get("archive_info", {}).get("hash", "")
        sha = hashes.get("sha256") or (legacy.split("=", 1)[1] if legacy.startswith("sha256=") else None)
        name = canonical(meta["name"])
        wheels[name] = ResolvedWheel(name=name, version=meta["version"], filename=filename, sha256=sha,
                                     requires=tuple(meta.get("requires_dist", ())))
    return wheels, environment


def closure(roots: list[str], wheels: dict[str, ResolvedWheel], environment: dict[str, str],
            exclude: set[str]) -> list[str]:
    """Names reachable from `roots` through dependencies active on the target, never entering `exclude`;
    in the order first reached."""
    order: list[str] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    queue: list[tuple[str, frozenset[str]]] = []
    for root in roots:
        req = Requirement(root)
        if req.marker is None or req.marker.evaluate({**environment, "extra": ""}):
            queue.append((canonical(req.name), frozenset(req.extras)))
    while queue:
        name, extras = queue.pop(0)
        if name in exclude or name not in wheels or (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in order:
            order.append(name)
        for text in wheels[name].requires:
            req = Requirement(text)
            if req.marker is not None and not _active(req.marker, environment, extras):
                continue
            queue.append((canonical(req.name), frozenset(req.extras)))
    return order


def _active(marker: Marker, environment: dict[str, str], extras: frozenset[str]) -> bool:
    return any(marker.evaluate({**environment, "extra": extra}) for extra in ("", *extras))


def download(wheels: list[ResolvedWheel], target: WheelTarget, dest: Path, log=print) -> None:
    """`pip download` exactly these files into `dest` (hash-checked by pip where the index gave one)."""
    hashed = [w for w in wheels if w.sha256]
    unhashed = [w for w in wheels if not w.sha256]
    for batch, lines in ((hashed, [f"{w.name}=={w.version} --hash=sha256:{w.sha256}" for w in hashed]),
                         (unhashed, [f"{w.name}=={w.version}" for w in unhashed])):
        if not batch:
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="nam56r-wheels-") as reqs:
            reqs.write("\n".join(lines) + "\n")
            reqs.flush()
            args = ["download", "--no-deps", "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest),
                    *target.pip_args(), *(["--require-hashes"] if batch is hashed else []), "-r", reqs.name]

            def show(line: str) -> None:
                if line.lstrip().startswith(("Downloading ", "Processing ", "File was already downloaded")):
                    log(f"    {line.strip()}")

            proc = run_pip(args, target, stream=show)
        if proc.returncode != 0:
            raise PatchlaneError(f"pip could not download {len(batch)} wheel(s):\n{_tail(proc)}",
                                 "check your package index configuration (pip config list), then run cache fill again")
    missing = [w.filename for w in wheels if not (dest / w.filename).is_file()]
    if missing:
        raise PatchlaneError(f"pip reported success but these wheels are not in {dest}: {missing}",
                             "the index serves other files than it resolved; run cache fill again with --refresh")
