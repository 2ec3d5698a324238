"""The GPU architectures NAM56R trains on, and what each one's shared memory asks of the TileLang kernels in use.

Hopper (sm_90: H100, H200) gives a block up to 227 KiB of shared memory, and every TileLang kernel NAM56R
calls is validated there as built. GB10 (sm_121) gives 99 KiB: a kernel sized for Hopper compiles for it
and then fails at its first launch, minutes into a run. Whether a kernel fits is known only once it is
compiled for the GPU, which the preflight does not do, so on an architecture below Hopper's budget it
requires every TileLang kernel the config calls to be built with TileLang's aggressive shared-memory merge
(`tl.enable_aggressive_shared_memory_merge`, which lets buffers whose lifetimes do not overlap share
memory), read from the real `@tilelang.jit` factories, and refuses otherwise, naming each kernel.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from nam56r.model.config import ModelConfig

SHARED_MEMORY_MERGE = "tl.enable_aggressive_shared_memory_merge"


@dataclass(frozen=True)
class GpuArch:
    name: str
    shared_memory_kib: int  # the most shared memory one block may use (the opt-in maximum)
    requires_shared_memory_merge: bool  # below the budget the kernels are validated at


SUPPORTED_ARCHS: dict[tuple[int, int], GpuArch] = {
    (9, 0): GpuArch("Hopper (H100/H200)", 227, requires_shared_memory_merge=False),
    (12, 1): GpuArch("GB10", 99, requires_shared_memory_merge=True),
}

# The modules whose @tilelang.jit factories NAM56R's layers call: Mamba-3 MIMO (mamba_ssm), and the DSA
# indexer and sparse MLA of Megatron's TileLang path (dsa.kernel_backend="tilelang").
MAMBA3_MIMO_MODULES = ("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_fwd", "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_bwd")
DSA_MODULES = tuple(
    f"megatron.core.transformer.experimental_attention_variant.ops.{name}"
    for name in ("tilelang_indexer_fwd", "tilelang_indexer_bwd", "tilelang_indexer_loss", "tilelang_sparse_mla_fwd",
                 "tilelang_sparse_mla_bwd")
)


def tilelang_kernels(config: ModelConfig) -> dict[str, object]:
    """The @tilelang.jit factories (tilelang.jit.JITImpl) of the kernels `config` calls, by qualified name."""
    from tilelang.jit import JITImpl

    modules = (MAMBA3_MIMO_MODULES if config.mamba.mimo else ()) + (DSA_MODULES if config.dsa.kernel_backend == "tilelang" else ())
    kernels = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        kernels.update({f"{module_name}.{name}": obj for name, obj in vars(module).items() if isinstance(obj, JITImpl)})
    return kernels


def merges_shared_memory(kernel: object) -> bool:
    """Whether a @tilelang.jit factory builds its kernels with the aggressive shared-memory merge."""
    configs = {getattr(key, "value", key): value for key, value in (getattr(kernel, "pass_configs", None) or {}).items()}
    return bool(configs.get(SHARED_MEMORY_MERGE))


def arch_check(config: ModelConfig, capability: tuple[int, int], device_name: str) -> tuple[bool, str]:
    """(whether `config` may train on this GPU, what the preflight says about it)."""
    where = f"{device_name}, sm_{capability[0]}{capability[1]}"
    arch = SUPPORTED_ARCHS.get(capability)
    if arch is None:
        known = ", ".join(f"{a.name} (sm_{c[0]}{c[1]})" for c, a in SUPPORTED_ARCHS.items())
        return False, f"{where}: not supported; NAM56R trains on {known}"
    if not arch.requires_shared_memory_merge:
        return True, f"{where} ({arch.name}, {arch.shared_memory_kib} KiB shared memory per block)"
    kernels = tilelang_kernels(config)
    unmerged = sorted(name for name, kernel in kernels.items() if not merges_shared_memory(kernel))
    if unmerged:
        return False, (
            f"{where} ({arch.name}) gives a block {arch.shared_memory_kib} KiB of shared memory, and these TileLang kernels "
            f"of {config.name} are built without {SHARED_MEMORY_MERGE}, so they may not fit and would fail at their first "
            f"launch: {', '.join(unmerged)}; build them with it (a patch to their pass_configs in the upstream's series)"
        )
    return True, f"{where} ({arch.name}, {arch.shared_memory_kib} KiB): all {len(kernels)} TileLang kernels merge shared memory"
