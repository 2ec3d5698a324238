"""The fused kernels' shape constraints, checked before launch: every preset a recipe trains passes
them, each violation is named, and where Megatron's strict fused path declines a shape at run time,
its own decline functions (called on CPU tensors of that shape) refuse the same shape for the same
reason."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nam56r.model.config import ModelConfig
from nam56r.model.fused_constraints import effective_topk, fused_kernel_violations
from nam56r.model.presets import get_preset
from nam56r.training.recipe import RECIPES, RecipeError, get_recipe


def _tiny(**changes: dict) -> ModelConfig:
    """nam56r-tiny with the nested fields in `changes` ({"dsa": {"topk": 96}}) or top-level ones replaced."""
    config = get_preset("nam56r-tiny")
    for name, value in changes.items():
        config = replace(config, **{name: replace(getattr(config, name), **value) if isinstance(value, dict) else value})
    return config.validate()


# The tiny preset as it was before it was sized for the strict fused path.
OLD_TINY = {"seq_length": 64, "dsa": {"indexer_heads": 4, "topk": 16}, "mla": {"kv_lora_rank": 32, "qk_rope_head_dim": 32}}


def _megatron_decline(config: ModelConfig, path: str) -> str:
    """The reason Megatron's strict fused `path` ("indexer+loss" or "sparse MLA") declines tensors of
    `config`'s shapes with (4 query rows of batch 1, bf16, on CPU); it must decline before any kernel."""
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
    from megatron.core.transformer.experimental_attention_variant.ops.fused_decline import FusedDSAPathDeclined

    sq, mla, dsa = 4, config.mla, config.dsa
    absorbed = mla.kv_lora_rank + mla.qk_rope_head_dim
    query = torch.zeros(sq, 1, mla.num_heads, absorbed, dtype=torch.bfloat16)
    key = torch.zeros(sq, 1, 1, absorbed, dtype=torch.bfloat16)
    with pytest.raises(FusedDSAPathDeclined) as declined:
        if path == "indexer+loss":
            tilelang_dsa.fused_qk_topk_lighting_with_streaming_sparse_kl(
                q=torch.zeros(sq, 1, dsa.indexer_heads, dsa.indexer_head_dim, dtype=torch.bfloat16),
                k=torch.zeros(sq, 1, dsa.indexer_head_dim, dtype=torch.bfloat16),
                weights=torch.zeros(sq, 1, dsa.indexer_heads),
                index_topk=dsa.topk,
                starts=torch.zeros(sq, dtype=torch.int32),
                ends=torch.arange(1, sq + 1, dtype=torch.int32),
                block_size=sq,
                query=query,
                key=key,
                softmax_scale=1.0,
                loss_coeff=1.0,
                pg_collection=None,
                strict_fused_paths=True,
            )
        else:
            topk_indices = torch.zeros(1, sq, effective_topk(config), dtype=torch.int32)
            tilelang_dsa.fused_sparse_mla_absorbed(query, key, topk_indices, 1.0, mla.kv_lora_rank, strict_fused_paths=True)
    return str(declined.value)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_preset_a_recipe_trains_passes_the_fused_constraints(name, megatron_built) -> None:
    model = RECIPES[name]().model_config()
    assert fused_kernel_violations(model) == []


def test_the_old_tiny_preset_is_refused_as_the_gpu_refused_it(megatron_built) -> None:
    old = _tiny(**OLD_TINY)
    problems = fused_kernel_violations(old)
    assert any("indexer heads 4 unsupported by the TileLang indexer backward" in p for p in problems), problems
    assert any("top-k 16 is not a multiple of 64" in p for p in problems), problems
    # Megatron's own dims check passes 32/32; TileLang's sparse MLA forward failed to compile them on the H200.
    assert any("mla.kv_lora_rank 32 is below 64" in p for p in problems), problems
    assert any("mla.qk_rope_head_dim 32 is below 64" in p for p in problems), problems
    # The decline the H100 raised at the first DSA layer, and the one the sparse MLA would raise next.
    assert "indexer heads 4 unsupported by the TileLang indexer backward" in _megatron_decline(old, "indexer+loss")
    assert "top-k 16 is not a multiple of 64" in _megatron_decline(old, "sparse MLA")


@pytest.mark.parametrize(
    ("changes", "ours", "megatron_path", "megatron_reason"),
    [
        ({"dsa": {"indexer_heads": 12}}, "indexer heads 12 unsupported", "indexer+loss", "indexer heads 12 unsupported"),
        ({"mla": {"kv_lora_rank": 96}}, "value dim to be a power of two >= 16, got 96", "sparse MLA", "v_channels 96 is not"),
        ({"mla": {"qk_rope_head_dim": 96}}, "rope tail dim to be a power of two >= 16, got 96", "sparse MLA", "rope tail"),
        ({"mla": {"num_heads": 24}}, "kernel heads 24 (mla.num_heads 24)", "sparse MLA", "kernel heads 24"),
    ],
)
def test_each_strict_decline_is_named_as_megatron_names_it(changes, ours, megatron_path, megatron_reason, megatron_built) -> None:
    config = _tiny(**changes)
    problems = fused_kernel_violations(config)
    assert len(problems) == 1 and ours in problems[0], problems
    assert megatron_reason in _megatron_decline(config, megatron_path)


def test_a_topk_off_the_sparse_mla_tile_is_refused_by_every_kernel_it_reaches(megatron_built) -> None:
    problems = fused_kernel_violations(_tiny(dsa={"topk": 96}))
    assert [p.split(":")[0] for p in problems] == ["fused sparse MLA", "fused TileLang DSA indexer+loss", "fused TileLang DSA indexer+loss"]
    assert "top-k 96 is not a multiple of 64" in problems[0]
    assert "_can_use_fused_sparse_indexer_target" in problems[1] and "_can_use_fused_sparse_indexer_kl" in problems[2]
    assert "top-k 96 is not a multiple of 64" in _megatron_decline(_tiny(dsa={"topk": 96}), "sparse MLA")


def test_silent_pytorch_sub_paths_of_the_indexer_loss_are_refused_too(megatron_built) -> None:
    """Megatron computes the sparse KL in PyTorch, declining nothing, where its fused kernel's
    predicate is false: here a top-k of 320 (a multiple of the sparse MLA's 64, not of the KL
    kernel's 256), and the top-k a short sequence caps."""
    (kl,) = fused_kernel_violations(_tiny(dsa={"topk": 320}))
    assert "fused sparse KL kernel refuses top-k 320" in kl
    (capped,) = fused_kernel_violations(_tiny(seq_length=128))
    assert "top-k 128 (dsa.topk 256 capped by seq_length 128)" in capped


def test_dense_indexer_loss_is_refused(megatron_built) -> None:
    (problem,) = fused_kernel_violations(_tiny(dsa={"sparse_indexer_loss": False}))
    assert "dense indexer loss (dsa.sparse_indexer_loss=False) has no fused kernel" in problem


def test_the_unfused_dsa_backend_is_not_held_to_the_kernels_shapes(megatron_built) -> None:
    assert fused_kernel_violations(_tiny(dsa={"kernel_backend": "none", "indexer_heads": 4, "topk": 16})) == []


@pytest.mark.parametrize(
    ("mamba", "fragment"),
    [
        ({"chunk_size": 32}, "chunk_size x mimo_rank = 32 x 4 exceeds 64"),
        ({"chunk_size": 4}, "mamba.chunk_size 4 is below 8"),
        ({"mimo_rank": 3}, "mimo_rank 3 is untested"),
        ({"d_state": 16}, "(d_state, head_dim) = (16, 32) fails to compile"),
        ({"head_dim": 16, "ngroups": 4}, "head_dim (headdim_v) 16 is untested"),
    ],
)
def test_mamba3_mimo_shapes_are_checked(mamba, fragment, megatron_built) -> None:
    problems = fused_kernel_violations(_tiny(mamba=mamba))
    assert len(problems) == 1 and fragment in problems[0], problems
    assert fused_kernel_violations(_tiny(mamba={**mamba, "mimo": False})) == []  # SISO runs Triton kernels


def test_recipe_check_refuses_a_shape_the_fused_path_declines(megatron_built) -> None:
    with pytest.raises(RecipeError, match=r"model nam56r-tiny: fused sparse MLA: top-k 96 \(dsa.topk 256 capped by seq_length 96\)") as err:
        get_recipe("tiny-1gpu", seq_length=96)
    assert len(err.value.problems) == 3  # the sparse MLA, and the indexer loss's target and KL kernels

