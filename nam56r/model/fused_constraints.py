"""The shapes NAM56R's fused kernels take, checked on a `ModelConfig` before anything launches.

With `dsa.kernel_backend="tilelang"` every DSA layer runs Megatron's fused TileLang indexer+loss and
sparse MLA with declines made errors (`dsa_strict_fused_paths`, Megatron patch 0004), or, with
`dsa.indexer="fused"`, the fused Triton top-k (`nam56r_kernels.dsa_indexer`) in place of the TileLang
indexer+loss, or with `dsa.indexer="fused-tilelang-loss"` that top-k and the TileLang loss kernels;
with `mamba.mimo` every Mamba-3 layer runs mamba_ssm's MIMO TileLang kernels. All refuse
unsupported shapes only when the first layer runs on a GPU, minutes into a launch. `fused_kernel_violations`
names every such shape of a config up front; the preflight and `Recipe.check()` report it.

Megatron's own predicates decide wherever it has them (the indexer backward's head counts, the
sparse MLA's dimensions and head grouping, the fused indexer-loss target and KL kernels, evaluated
on fake CUDA tensors of the model's shapes). The conditions written inline in Megatron's and
mamba_ssm's code are restated here, each beside the function that applies it. Heads are counted
per tensor-parallel rank at TP 1, the only TP NAM56R runs (`Recipe.check`).
"""

from __future__ import annotations

import torch

from nam56r.model.config import ModelConfig

# fused_sparse_mla_absorbed (megatron ops/tilelang_dsa.py) pads fewer query heads to this tile and
# declines a top-k (the indices' last dimension) that is not a multiple of the other.
SPARSE_MLA_MIN_KERNEL_HEADS = 16
SPARSE_MLA_TOPK_MULTIPLE = 64
# Megatron's `_check_sparse_mla_dims` accepts latent and rope dims of 16 and 32, but TileLang 0.1.8 cannot
# lay out the sparse MLA forward's GEMMs for them: with kv_lora_rank = qk_rope_head_dim = 32 its layout
# inference asserts `warp_col_tiles must be greater than 8, got 4` (seen on an H200); 64 and 64 compile.
SPARSE_MLA_MIN_DIM = 64
# mamba3_mimo (mamba_ssm ops/tilelang/mamba3/mamba3_mimo.py): it asserts the first two and warns
# that other shapes than the tested ones may over-allocate shared memory or fail to compile.
MAMBA3_MIMO_MIN_CHUNK = 8
MAMBA3_MIMO_TESTED = {
    "d_state (headdim_qk)": (16, 32, 64, 128, 256),
    "head_dim (headdim_v)": (32, 64, 128),
    "mimo_rank": (1, 2, 4, 8),
}
MAMBA3_MIMO_MAX_CHUNK_TIMES_RANK = 64
MAMBA3_MIMO_FAILING_PAIRS = ((16, 32), (256, 128))  # (d_state, head_dim) pairs it names as failing to compile


def fused_kernel_violations(config: ModelConfig) -> list[str]:
    """Every constraint of the fused kernels `config` selects that it violates, each naming the
    kernel, the offending value and what to change; empty when all its shapes are supported."""
    problems: list[str] = []
    if config.dsa.kernel_backend == "tilelang":
        problems += dsa_violations(config)
    if config.dsa.indexer != "megatron":
        problems += fused_indexer_violations(config)
    if config.mamba.mimo:
        problems += mamba3_mimo_violations(config)
    return problems


def fused_kernel_problems(config: ModelConfig) -> list[str]:
    """`fused_kernel_violations`, or the one problem that they cannot be checked because the patched
    upstreams whose predicates it calls do not import."""
    try:
        return fused_kernel_violations(config)
    except ImportError as exc:
        return [f"cannot check the fused kernels' shapes: {type(exc).__name__}: {exc}; run `nox -s build`"]


def effective_topk(config: ModelConfig) -> int:
    """The top-k width the kernels see: the indexer selects min(top-k, keys) per query."""
    return min(config.dsa.topk, config.seq_length)


def dsa_violations(config: ModelConfig) -> list[str]:
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_indexer_bwd import (
        is_supported_indexer_bwd_head_count,
    )

    loss_path, mla_path = tilelang_dsa.FUSED_INDEXER_LOSS_PATH, tilelang_dsa.FUSED_SPARSE_MLA_PATH
    mla, dsa = config.mla, config.dsa
    topk = effective_topk(config)
    topk_text = f"top-k {topk}" + ("" if topk == dsa.topk else f" (dsa.topk {dsa.topk} capped by seq_length {config.seq_length})")
    problems = []
    # With dsa.indexer="fused" the TileLang indexer+loss kernels are not called (fused_indexer_violations);
    # "fused-tilelang-loss" calls the loss's (target, KL, indexer backward), not the indexer forward.
    uses_loss_kernels = dsa.indexer in ("megatron", "fused-tilelang-loss")
    if uses_loss_kernels and not dsa.sparse_indexer_loss:
        problems.append(
            f"{loss_path}: the dense indexer loss (dsa.sparse_indexer_loss=False) has no fused kernel; set dsa.sparse_indexer_loss=True"
        )
    if uses_loss_kernels and not is_supported_indexer_bwd_head_count(dsa.indexer_heads):
        supported = [h for h in range(1, 513) if is_supported_indexer_bwd_head_count(h)]
        problems.append(
            f"{loss_path}: indexer heads {dsa.indexer_heads} unsupported by the TileLang indexer backward "
            f"(is_supported_indexer_bwd_head_count); set dsa.indexer_heads to one of {supported}"
        )
    problems += [f"{mla_path}: {p}" for p in _sparse_mla_dim_problems(mla.kv_lora_rank, mla.qk_rope_head_dim)]
    for name, value in (("mla.kv_lora_rank", mla.kv_lora_rank), ("mla.qk_rope_head_dim", mla.qk_rope_head_dim)):
        if value < SPARSE_MLA_MIN_DIM:
            problems.append(
                f"{mla_path}: {name} {value} is below {SPARSE_MLA_MIN_DIM}, the smallest dim TileLang 0.1.8 lays out for the "
                f"sparse MLA's GEMMs (smaller ones fail to compile: warp_col_tiles < 8); set {name} >= {SPARSE_MLA_MIN_DIM}"
            )
    kernel_heads = max(mla.num_heads, SPARSE_MLA_MIN_KERNEL_HEADS)
    if not tilelang_dsa._is_supported_sparse_mla_head_count(kernel_heads, kv_group=1):
        problems.append(
            f"{mla_path}: kernel heads {kernel_heads} (mla.num_heads {mla.num_heads}) per KV head is not a power of two >= "
            f"{SPARSE_MLA_MIN_KERNEL_HEADS} (_is_supported_sparse_mla_head_count); set mla.num_heads to a power of two"
        )
    if topk % SPARSE_MLA_TOPK_MULTIPLE:
        problems.append(f"{mla_path}: {topk_text} is not a multiple of {SPARSE_MLA_TOPK_MULTIPLE}; change dsa.topk or seq_length")
    if uses_loss_kernels:
        problems += [f"{loss_path}: {p}" for p in _indexer_loss_kernel_problems(config, topk_text)]
    return problems


FUSED_INDEXER_PATH = "fused DSA indexer (nam56r_kernels.dsa_indexer.index_topk_fused)"


def fused_indexer_violations(config: ModelConfig) -> list[str]:
    """The fused top-k's contract (`nam56r_kernels.dsa_indexer`) on `config`'s indexer shapes."""
    from nam56r_kernels.dsa_indexer import MAX_SELECT_KEYS

    dim = config.dsa.indexer_head_dim
    problems = []
    if dim < 16 or dim & (dim - 1):
        problems.append(f"{FUSED_INDEXER_PATH}: dsa.indexer_head_dim {dim} is not a power of two >= 16 (a tensor-core tile)")
    if config.seq_length > MAX_SELECT_KEYS:
        problems.append(f"{FUSED_INDEXER_PATH}: seq_length {config.seq_length} exceeds the {MAX_SELECT_KEYS} keys per query its select "
                        "holds in registers; use dsa.indexer='megatron'")
    return problems


def _sparse_mla_dim_problems(value_dim: int, rope_dim: int) -> list[str]:
    """Megatron's `_check_sparse_mla_dims` for each dimension on its own (it stops at the first)."""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import _check_sparse_mla_dims

    def problem(dim: int, tail: int) -> str | None:
        try:
            _check_sparse_mla_dims(dim, tail)
        except AssertionError as exc:
            return str(exc)
        return None

    if problem(value_dim, rope_dim) is None:
        return []
    # The smallest dimension the kernels take, as the partner of the one under test.
    accepted = next(d for d in range(1, 1 << 16) if problem(d, d) is None)
    found = [
        (p, fix)
        for p, fix in (
            (problem(value_dim, accepted), "mla.kv_lora_rank (the latent value dim)"),
            (problem(accepted, rope_dim), "mla.qk_rope_head_dim (the rope tail)"),
        )
        if p
    ]
    return [f"{p}; change {fix}" for p, fix in found]


def _indexer_loss_kernel_problems(config: ModelConfig, topk_text: str) -> list[str]:
    """Megatron's predicates for the fused sparse indexer-loss target and KL kernels, on fake CUDA
    tensors shaped as its streaming loss passes them. Megatron computes either in PyTorch, without a
    decline, where its predicate is false; NAM56R's fused path takes no such silent fallback."""
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
    from torch._subclasses.fake_tensor import FakeTensorMode

    if tilelang_dsa.sparse_indexer_target_interface is None or tilelang_dsa.SparseIndexerKLLoss is None:
        return ["the TileLang indexer-loss kernels (ops/tilelang_indexer_loss.py) do not import; install tilelang (`nox -s build`)"]
    rows, keys, topk = config.seq_length, config.seq_length, effective_topk(config)
    absorbed_dim = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    with FakeTensorMode():
        query = torch.empty(rows, config.mla.num_heads, absorbed_dim, dtype=torch.bfloat16, device="cuda")
        key = torch.empty(keys, absorbed_dim, dtype=torch.bfloat16, device="cuda")
        indices = torch.empty(rows, topk, dtype=torch.int32, device="cuda")
        target = torch.empty(rows, topk, dtype=torch.float32, device="cuda")
        logits = torch.empty(rows, topk, dtype=torch.float32, device="cuda")
        valid = torch.empty(rows, topk, dtype=torch.bool, device="cuda")
        target_ok = tilelang_dsa._can_use_fused_sparse_indexer_target(query, key, indices)
        kl_ok = tilelang_dsa._can_use_fused_sparse_indexer_kl(target, logits, valid)
    problems = []
    if not target_ok:
        problems.append(
            f"the fused sparse target kernel refuses absorbed head dim {absorbed_dim} (kv_lora_rank + qk_rope_head_dim) "
            f"with {topk_text} (_can_use_fused_sparse_indexer_target); change the MLA dims or dsa.topk"
        )
    if not kl_ok:
        problems.append(f"the fused sparse KL kernel refuses {topk_text} (_can_use_fused_sparse_indexer_kl); change dsa.topk or seq_length")
    return problems


def mamba3_mimo_violations(config: ModelConfig) -> list[str]:
    m = config.mamba
    path = "Mamba-3 MIMO TileLang kernels (mamba3_mimo)"
    problems = []
    if m.chunk_size < MAMBA3_MIMO_MIN_CHUNK:
        problems.append(f"{path}: mamba.chunk_size {m.chunk_size} is below {MAMBA3_MIMO_MIN_CHUNK}")
    if m.d_state % 2:
        problems.append(f"{path}: mamba.d_state {m.d_state} (headdim_qk) must be even for the rotary embedding")
    for (name, tested), value in zip(MAMBA3_MIMO_TESTED.items(), (m.d_state, m.head_dim, m.mimo_rank), strict=True):
        if value not in tested:
            problems.append(
                f"{path}: {name} {value} is untested by mamba_ssm (may over-allocate shared memory or fail to compile); use one of {tested}"
            )
    if m.chunk_size * m.mimo_rank > MAMBA3_MIMO_MAX_CHUNK_TIMES_RANK:
        problems.append(
            f"{path}: mamba.chunk_size x mimo_rank = {m.chunk_size} x {m.mimo_rank} exceeds {MAMBA3_MIMO_MAX_CHUNK_TIMES_RANK} "
            "(shared-memory over-allocation); lower mamba.chunk_size"
        )
    if (m.d_state, m.head_dim) in MAMBA3_MIMO_FAILING_PAIRS:
        problems.append(f"{path}: (d_state, head_dim) = ({m.d_state}, {m.head_dim}) fails to compile in mamba_ssm; change either")
    return problems
