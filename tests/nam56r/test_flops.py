"""nam56r.model.flops: the matmul part of every component against the weights of the model Megatron
builds (meta device, through nam56r.model.params), and how the attention/indexer/scan terms scale."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace

import pytest

from nam56r.model.flops import (
    MATMUL,
    causal_keys_per_query,
    flops_per_token,
    indexer_layers,
    sparse_keys_per_query,
    step_flops,
)
from nam56r.model.presets import get_preset

SEQ = 4096


def with_index_cache(name: str, enabled: bool):
    config = get_preset(name)
    return replace(config, index_cache=replace(config.index_cache, enabled=enabled)).validate()


CASES = {
    "nam56r-tiny": lambda: get_preset("nam56r-tiny"),  # IndexCache on: 1 Full + 2 Shared DSA layers
    "nam56r-proxy": lambda: get_preset("nam56r-proxy"),  # IndexCache off
    "nam56r+index-cache": lambda: with_index_cache("nam56r", True),  # 3 Full + 6 Shared of 9
}
_built: dict[str, tuple] = {}


def weights_of(case: str):
    """(config, 2-D weights per nam56r.model.params row, weights of IndexCache Shared layers' indexers,
    non-matmul parameters, of which in Shared indexers, ParamCounts) of the model Megatron builds."""
    if case not in _built:
        from nam56r.model.model import build_model
        from nam56r.model.params import _LAYER, component_of, count_parameters

        config = CASES[case]()
        built = build_model(config, "local", device="meta")
        shared = set(built.index_cache_plan.shared_layers) if built.index_cache_plan else set()
        weights: dict[str, int] = defaultdict(int)
        shared_weights = non_matmul = shared_non_matmul = 0
        for name, param in built.model.named_parameters():
            component = component_of(name, built.layout)
            in_shared = component == "dsa indexer" and int(_LAYER.match(name).group(1)) + 1 in shared
            if param.dim() == 2 and name.endswith(".weight"):  # a Linear's (or the embedding's) weight
                weights[component] += param.numel()
                shared_weights += param.numel() if in_shared else 0
            else:  # norms, Mamba-3's per-head vectors, n-gram tables
                non_matmul += param.numel()
                shared_non_matmul += param.numel() if in_shared else 0
        _built[case] = (config, dict(weights), shared_weights, non_matmul, shared_non_matmul, count_parameters(config))
    return _built[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matmul_part_is_six_times_the_active_weights_of_each_component(case: str, megatron_built) -> None:
    config, weights, shared_indexer_weights, *_ = weights_of(case)
    breakdown = flops_per_token(config, SEQ)
    moe = config.moe
    for c in breakdown.components:
        if c.params_row is None:  # the indexer loss target: activations only
            assert c.matmul == 0, c.name
            continue
        row = weights[c.params_row]
        if c.name == "dsa indexer":
            # Full layers only (IndexCache), and 4 x: Megatron detaches the indexer's inputs (no input gradient)
            assert c.matmul == 4 * (row - shared_indexer_weights), c.name
        elif c.name == "moe routed experts":
            assert c.matmul * moe.num_experts == MATMUL * row * moe.topk, c.name
        elif c.name == "mtp lm heads":  # every MTP depth runs the shared output layer
            assert c.matmul == MATMUL * config.mtp.depths * row, c.name
        else:
            assert c.matmul == 6 * row, c.name
    # every weight the model has, except the token embedding (a gather), is some component's
    assert {c.params_row for c in breakdown.components} - {None} == set(weights) - {"token embedding"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matmul_total_agrees_with_the_active_parameter_count(case: str, megatron_built) -> None:
    config, weights, shared_indexer_weights, non_matmul, shared_non_matmul, counts = weights_of(case)
    assert sum(weights.values()) + non_matmul == counts.total
    # nam56r.model.params' `active` less the parameters that are not GEMM weights, less the token embedding
    active_matmul = counts.active - (non_matmul - shared_non_matmul) - counts.rows["token embedding"]
    full_indexer_weights = weights.get("dsa indexer", 0) - shared_indexer_weights
    mtp_heads = config.mtp.depths * counts.rows["output layer"]
    expected = 6 * (active_matmul + mtp_heads) - 2 * full_indexer_weights
    assert flops_per_token(config, SEQ).matmul == expected


def test_indexer_loss_counted_as_megatron_is_configured(megatron_built) -> None:
    """The loss target counts the keys Megatron's indexer loss reads: top-k with the sparse loss."""
    from nam56r.model.model import megatron_config

    config = get_preset("nam56r")
    assert megatron_config(config, meta=True).dsa_indexer_use_sparse_loss is config.dsa.sparse_indexer_loss is True
    dense = replace(config, dsa=replace(config.dsa, sparse_indexer_loss=False))
    assert megatron_config(dense, meta=True).dsa_indexer_use_sparse_loss is False
    target = "dsa indexer loss target"
    ratio = flops_per_token(dense, SEQ)[target].sequence / flops_per_token(config, SEQ)[target].sequence
    assert ratio == pytest.approx(causal_keys_per_query(SEQ) / sparse_keys_per_query(config.dsa.topk, SEQ))


def test_full_mla_score_flops_double_with_the_sequence() -> None:
    config = get_preset("nam56r")
    short, long = flops_per_token(config, 2048), flops_per_token(config, 4096)
    for name in ("mla attention", "mtp attention (mla)"):
        assert long[name].sequence == 2 * short[name].sequence > 0
        assert long[name].matmul == short[name].matmul
    mla = config.mla
    per_layer = 3 * 2 * mla.num_heads * (mla.qk_head_dim + mla.qk_rope_head_dim + mla.v_head_dim) * 4096 / 2
    assert long["mla attention"].sequence == 4 * per_layer  # 4 full MLA layers, s/2 keys per query


def test_dsa_sparse_attention_stops_growing_once_s_is_much_larger_than_topk() -> None:
    config = get_preset("nam56r")
    topk, mla = config.dsa.topk, config.mla
    long = [flops_per_token(config, s)["dsa attention"].sequence for s in (4096, 8192, 65536)]
    assert long[0] == long[1] == long[2] > 0
    per_key = 9 * 3 * 2 * mla.num_heads * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert long[0] == per_key * topk
    # below 2 x topk the indexer can pick every causal key: the causal s/2 count
    assert flops_per_token(config, topk)["dsa attention"].sequence == per_key * topk / 2


def test_indexer_scores_and_loss_target_scale_with_the_sequence() -> None:
    config = get_preset("nam56r")
    short, long = flops_per_token(config, 4096), flops_per_token(config, 8192)
    assert long["dsa indexer"].sequence == 2 * short["dsa indexer"].sequence > 0
    # the sparse loss target reads top-k keys per query: independent of s once s >> topk
    assert long["dsa indexer loss target"].sequence == short["dsa indexer loss target"].sequence > 0
    dense = replace(config, dsa=replace(config.dsa, sparse_indexer_loss=False))
    target = "dsa indexer loss target"
    assert flops_per_token(dense, 8192)[target].sequence == 2 * flops_per_token(dense, 4096)[target].sequence


def test_mamba3_scan_is_the_mimo_kernels_gemms_and_independent_of_s() -> None:
    config = get_preset("nam56r")
    m = config.mamba
    L, R, N, P, heads = m.chunk_size, m.mimo_rank, m.d_state, m.head_dim, m.num_heads(config.hidden_size)
    assert (L, R, N, P, heads) == (16, 4, 128, 64, 128)
    per_head = 4 * L * R * R * N + 2 * L * R * R * P + 4 * R * N * P  # per token, forward
    assert flops_per_token(config, 4096)["mamba3"].sequence == 17 * 3 * heads * per_head == 17 * 3 * 37_748_736
    assert flops_per_token(config, 1024)["mamba3"].sequence == flops_per_token(config, 65536)["mamba3"].sequence


def test_index_cache_lowers_the_indexer_by_exactly_the_shared_share() -> None:
    off, on = with_index_cache("nam56r", False), with_index_cache("nam56r", True)
    assert indexer_layers(off) == (9, 9) and indexer_layers(on) == (3, 9)
    b_off, b_on = flops_per_token(off, SEQ), flops_per_token(on, SEQ)
    for name in ("dsa indexer", "dsa indexer loss target"):
        assert b_on[name].total * 9 == b_off[name].total * 3  # 6 of 9 DSA layers are Shared
        assert b_on[name].matmul * 9 == b_off[name].matmul * 3 and b_on[name].sequence * 9 == b_off[name].sequence * 3
    for name in b_off.names:  # nothing else changes: Shared layers still run their sparse attention
        if not name.startswith("dsa indexer"):
            assert b_on[name] == b_off[name], name


def test_untrained_indexer_runs_forward_only_and_has_no_loss_target() -> None:
    config = get_preset("nam56r")
    config = replace(config, dsa=replace(config.dsa, indexer_loss_coeff=0.0)).validate()
    trained, frozen = flops_per_token(get_preset("nam56r"), SEQ), flops_per_token(config, SEQ)
    assert "dsa indexer loss target" not in frozen
    assert frozen["dsa indexer"].matmul * 2 == trained["dsa indexer"].matmul  # 2 x instead of 4 x
    assert frozen["dsa indexer"].sequence * 3 == trained["dsa indexer"].sequence


def test_step_flops_and_bad_arguments() -> None:
    config = get_preset("nam56r-proxy")
    assert step_flops(config, SEQ, 64) == flops_per_token(config, SEQ).total * SEQ * 64
    with pytest.raises(ValueError, match="seq_length must be a positive integer, got 0"):
        flops_per_token(config, 0)
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer, got -1"):
        step_flops(config, SEQ, -1)
    gated = replace(config, moe=replace(config.moe, gated=True))
    with pytest.raises(ValueError, match="moe.gated=True"):
        flops_per_token(gated, SEQ)
    with pytest.raises(KeyError, match="no component 'nope'"):
        flops_per_token(config, SEQ)["nope"]


def test_cli_prints_every_component_and_the_step_total() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nam56r.model.flops", "--preset", "nam56r-proxy", "--seq", "4096", "--global-batch", "64"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    breakdown = flops_per_token(get_preset("nam56r-proxy"), 4096)
    for name in breakdown.names:
        assert re.search(rf"^{re.escape(name)}\s", out, re.M), name
    total = re.search(r"^total\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+100\.0%$", out, re.M)
    assert total and float(total.group(1)) == pytest.approx(breakdown.total / 1e9, abs=1e-3)
    step = re.search(r"per step \(global batch 64 x seq 4096 = 262,144 tokens\): ([\d,.]+) TFLOP", out)
    assert step and float(step.group(1).replace(",", "")) == pytest.approx(breakdown.total * 262_144 / 1e12, abs=0.05)
