"""The interpreter and platform an offline cache is filled for, as pip's target options and markers.

pip treats `--platform manylinux_2_28_x86_64` as that one tag, but a glibc 2.28 machine also runs
wheels tagged for older glibc (manylinux_2_17, manylinux2014, ...), and many releases ship only
those; so the tags below a manylinux platform are added, newest first (pip prefers earlier tags).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
# PEP 600 aliases of the older manylinux tags, by the glibc version they stand for.
_LEGACY = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}
_LEGACY_ARCHES = {"manylinux2014": {"x86_64", "i686", "aarch64", "armv7l", "ppc64", "ppc64le", "s390x"},
                  "manylinux2010": {"x86_64", "i686"}, "manylinux1": {"x86_64", "i686"}}
_VERSION = re.compile(r"^3\.\d+(\.\d+)?$")


def expand_platform(tag: str) -> list[str]:
    """`manylinux_2_28_x86_64` -> itself and every older manylinux tag of that arch; other tags as given."""
    match = _MANYLINUX.match(tag)
    if not match:
        return [tag]
    major, minor, arch = int(match[1]), int(match[2]), match[3]
    tags = []
    for glibc_minor in range(minor, 4, -1):
        tags.append(f"manylinux_{major}_{glibc_minor}_{arch}")
        legacy = _LEGACY.get((major, glibc_minor))
        if legacy and arch in _LEGACY_ARCHES[legacy]:
            tags.append(f"{legacy}_{arch}")
    return tags


@dataclass(frozen=True)
class WheelTarget:
    """`python_version` None: the interpreter running pip, with its own platform tags."""

    python_version: str | None
    platforms: tuple[str, ...]
    profile: str

    @classmethod
    def create(cls, python_version: str | None, platforms: list[str] | None, profile: str) -> WheelTarget:
        if python_version and not _VERSION.match(python_version):
            raise ValueError(f"--python-version {python_version!r}: expected 3.X or 3.X.Y")
        if platforms and not python_version:
            raise ValueError("--platform needs --python-version (pip fetches another platform's wheels only for a named python)")
        if python_version and not platforms:
            raise ValueError(f"--python-version {python_version} needs --platform, e.g. --platform manylinux_2_28_x86_64")
        expanded: list[str] = []
        for tag in platforms or ():
            expanded += [t for t in expand_platform(tag) if t not in expanded]
        return cls(python_version=python_version, platforms=tuple(expanded), profile=profile)

    @property
    def minor_version(self) -> str:
        """"3.12": what an interpreter must match to use this target's wheels."""
        version = self.python_version or f"{sys.version_info[0]}.{sys.version_info[1]}"
        return ".".join(version.split(".")[:2])

    def describe(self) -> str:
        if not self.python_version:
            return f"python {self.minor_version} (this interpreter, {sys.executable}) and its platform; profile {self.profile}"
        named = [t for t in self.platforms if not any(t in expand_platform(o) and t != o for o in self.platforms)]
        extra = len(self.platforms) - len(named)
        return (f"python {self.python_version} (cp), platform {' '.join(named)}"
                + (f" (+ {extra} older manylinux tag(s) it runs)" if extra else "") + f"; profile {self.profile}")

    def pip_args(self) -> list[str]:
        """pip download/install options selecting this target's wheels (binary only)."""
        args = ["--only-binary", ":all:"]
        if self.python_version:
            args += ["--python-version", self.python_version, "--implementation", "cp"]
            for tag in self.platforms:
                args += ["--platform", tag]
        return args

    def markers(self) -> dict[str, str]:
        """Environment-marker values of the target where they differ from the interpreter running pip."""
        if not self.python_version:
            return {}
        full = self.python_version if self.python_version.count(".") == 2 else f"{self.python_version}.0"
        values = {"python_version": self.minor_version, "python_full_version": full, "implementation_version": full,
                  "implementation_name": "cpython", "platform_python_implementation": "CPython"}
        tag = self.platforms[0]
        linux = re.match(r"^(?:many|musl)linux_\d+_\d+_(\w+)$|^manylinux\d+_(\w+)$|^linux_(\w+)$", tag)
        if not linux:
            raise ValueError(f"--platform {tag}: only Linux targets (manylinux_*, musllinux_*, linux_*) are supported")
        arch = next(g for g in linux.groups() if g)
        values.update(sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=arch)
        return values
