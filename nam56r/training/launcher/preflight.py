"""Preflight before any training step: the patch series are applied (by checksum), the fused paths
the config asks for are importable and take its shapes (`nam56r.model.fused_constraints`), and the GPU is
one NAM56R trains on, with enough shared memory for the TileLang kernels in use (`nam56r.training.launcher.gpu_arch`).

    python -m nam56r.training.launcher.preflight --preset nam56r

Each check names the missing piece and how to get it; `run_preflight(...).raise_if_failed()`
stops training on the first report with failures. It reads the series and each tree's state file
(`<tree>/.git/nam56r-patchlane.json`, written by `nox -s build`) with the patch lane's own readers,
which need no GitPython.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nam56r_patchlane.series import read_series
from nam56r_patchlane.statefile import state_path

from nam56r import CHECKOUT_ROOT
from nam56r.model.config import ModelConfig
from nam56r.model.reference import ReferenceConfig
from nam56r.training.launcher.gpu_arch import arch_check

ROOT = CHECKOUT_ROOT
# upstream -> (import name, folder of the package inside the materialized tree)
PATCHED_IMPORTS = {"megatron-lm": ("megatron.core", "megatron/core"), "mamba": ("mamba_ssm", "mamba_ssm")}
REBUILD = "run `nox -s build` (it applies the series and installs the trees editable)"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class PreflightReport:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def format(self) -> str:
        width = max((len(c.name) for c in self.checks), default=10) + 2
        return "\n".join(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<{width}}{c.detail}" for c in self.checks)

    def raise_if_failed(self) -> None:
        if self.failures:
            raise RuntimeError("NAM56R preflight failed:\n" + "\n".join(f"  {c.name}: {c.detail}" for c in self.failures))


def _series(root: Path, upstream: str) -> list[str]:
    return [entry.name for entry in read_series(root / "patches", upstream).entries]


def applied_series_problems(root: Path, upstream: str) -> list[str]:
    """Why `third_party/<upstream>` does not hold exactly `patches/<upstream>/series` (empty: it does)."""
    series = _series(root, upstream)
    tree = root / "third_party" / upstream
    state = state_path(tree / ".git")
    if not state.is_file():
        return [f"{tree} has no patch-lane state ({state.name}): it was not built by the patch lane; {REBUILD}"]
    applied = json.loads(state.read_text()).get("applied", [])
    names = [entry["name"] for entry in applied]
    if names != series:
        return [f"applied {names or 'nothing'}, series lists {series or 'nothing'}; {REBUILD}"]
    problems = []
    for entry in applied:
        digest = hashlib.sha256((root / "patches" / upstream / entry["name"]).read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            problems.append(f"{entry['name']} changed since it was applied (sha256 {digest[:12]} != {entry['sha256'][:12]}); {REBUILD}")
    if applied:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        if head != applied[-1]["commit"]:
            problems.append(f"tree HEAD {head[:12]} is not the last applied patch's commit {applied[-1]['commit'][:12]}; {REBUILD}")
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
    if dirty.strip():
        files = ", ".join(line[3:] for line in dirty.splitlines()[:3])
        problems.append(f"uncommitted edits that are in no patch ({files}); record them with `apply_patches.py refresh` or `new`")
    return problems


def _import_location_problem(root: Path, upstream: str) -> str | None:
    module_name, package_dir = PATCHED_IMPORTS[upstream]
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return f"{module_name} is not importable; {REBUILD}"
    expected = (root / "third_party" / upstream / package_dir).resolve()
    if not Path(spec.origin).resolve().is_relative_to(expected):
        return f"{module_name} imports from {Path(spec.origin).parent}, not the patched tree {expected}; {REBUILD}"
    return None


def _importable(module: str, attribute: str | None = None) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # an ImportError, or a native library failing to load
        return f"{module} does not import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if attribute and getattr(mod, attribute, None) is None:
        return f"{module}.{attribute} is missing (its optional dependency did not load)"
    return None


def _fused_shapes_check(config: ModelConfig) -> tuple[str, bool, str]:
    from nam56r.model.fused_constraints import fused_kernel_problems

    problems = fused_kernel_problems(config)
    if problems:
        return "fused kernel shapes", False, f"{config.name}: " + "; ".join(problems)
    return "fused kernel shapes", True, f"{config.name}'s shapes are supported by the fused DSA and Mamba-3 MIMO kernels it selects"


def run_preflight(config: ModelConfig | ReferenceConfig, *, root: Path = ROOT, require_gpu: bool = True) -> PreflightReport:
    """The checks `config` needs. The reference GPT runs Megatron's own modules: the patched tree and a CUDA GPU of any
    kind, none of the fused kernels."""
    report = PreflightReport()
    for upstream in ("megatron-lm",) if isinstance(config, ReferenceConfig) else ("megatron-lm", "mamba", "liger-kernel"):
        series = _series(root, upstream)
        if not series:
            continue
        problems = applied_series_problems(root, upstream)
        if upstream in PATCHED_IMPORTS and (where := _import_location_problem(root, upstream)):
            problems.append(where)
        applied = f"{len(series)} patches applied, checksums match"
        report.add(f"patches {upstream}", not problems, "; ".join(problems) or applied)
    if isinstance(config, ReferenceConfig):
        return _reference_gpu_check(report) if require_gpu else report

    fused = {
        "mamba-3 MIMO kernels (TileLang)": _importable("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo") if config.mamba.mimo else None,
        "mamba-3 SISO kernels (Triton)": _importable("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined"),
        "fused linear cross-entropy (Liger)": _importable("liger_kernel.ops.fused_linear_cross_entropy"),
        "fused DSA indexer + sparse MLA (TileLang)": _importable(
            "megatron.core.transformer.experimental_attention_variant.ops.tilelang_dsa", "SparseMLA"
        ),
    }
    install_hint = "install the pinned wheels (`nox -s build`, or the offline cache on air-gapped nodes)"
    for name, problem in fused.items():
        report.add(name, problem is None, f"{problem}; {install_hint}" if problem else "importable")
    report.add(*_fused_shapes_check(config))

    if require_gpu:
        import torch

        if not torch.cuda.is_available():
            report.add("gpu", False, "no CUDA GPU visible (torch.cuda.is_available() is False); NAM56R trains on Hopper GPUs")
        else:
            report.add("gpu", *arch_check(config, torch.cuda.get_device_capability(), torch.cuda.get_device_name()))
    return report


def _reference_gpu_check(report: PreflightReport) -> PreflightReport:
    import torch

    found = torch.cuda.is_available()
    report.add("gpu", found, torch.cuda.get_device_name() if found else "no CUDA GPU visible (torch.cuda.is_available() is False)")
    return report


def main(argv: list[str] | None = None) -> int:
    from nam56r.model.presets import PRESETS, get_preset

    parser = argparse.ArgumentParser(
        prog="python -m nam56r.training.launcher.preflight", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="nam56r", choices=sorted(PRESETS))
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU check (to check a build on a CPU host)")
    args = parser.parse_args(argv)
    report = run_preflight(get_preset(args.preset), require_gpu=not args.no_gpu)
    print(report.format())
    print(f"preflight: {'passed' if not report.failures else f'{len(report.failures)} check(s) failed'}")
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
