"""Parameter counts on the meta device for every preset, checked against the sizes that define
them, and the nam56r-h3584 cross-check against the original's published figures."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace

import pytest

from nam56r.model.params import compare_with_claims, count_parameters, format_table
from nam56r.model.pattern import LayerKind, layout_of
from nam56r.model.presets import ORIGINAL_CLAIMS, PRESETS, get_preset

_cache: dict = {}


def counts_of(name: str):
    if name not in _cache:
        _cache[name] = count_parameters(get_preset(name))
    return _cache[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_rows_follow_from_the_config(name: str, megatron_built) -> None:
    c, counts = get_preset(name), counts_of(name)
    layout = layout_of(c)
    n = layout.counts()
    h, moe, mamba = c.hidden_size, c.moe, c.mamba
    assert counts.total == sum(counts.rows.values())
    assert counts.rows["token embedding"] == counts.rows["output layer"] == c.vocab_size * h  # untied
    assert counts.rows["moe routed experts"] == n[LayerKind.MOE] * moe.num_experts * 2 * h * moe.expert_ffn  # non-gated
    assert counts.rows["moe shared expert"] == n[LayerKind.MOE] * 2 * h * moe.shared_expert_ffn
    assert counts.rows["moe router"] == n[LayerKind.MOE] * moe.num_experts * h
    heads = mamba.num_heads(h)
    d_inner = mamba.expand * h
    rope_angles = int(mamba.d_state * mamba.rope_fraction) // 2
    in_proj = h * (2 * d_inner + 2 * mamba.d_state * mamba.ngroups * mamba.mimo_rank + 3 * heads + rope_angles)
    mamba_small = heads * 2 + 2 * heads * mamba.mimo_rank * mamba.d_state + 3 * heads * mamba.mimo_rank * mamba.head_dim + 2 * mamba.d_state
    assert counts.rows["mamba3"] == n[LayerKind.MAMBA3] * (in_proj + d_inner * h + mamba_small + h)  # + pre-norm
    assert counts.rows["mtp dense mlp"] == c.mtp.depths * (2 * h * c.mtp.dense_ffn + h)
    g = c.ngram
    assert counts.rows["n-gram hash embedding"] == len(g.orders) * (g.table_size * g.embed_dim + g.heads * g.embed_dim * h)
    idle = counts.rows["moe routed experts"] * (moe.num_experts - moe.topk) // moe.num_experts
    assert counts.total - counts.active == idle


def test_only_index_cache_full_layers_have_an_indexer(megatron_built) -> None:
    config = get_preset("nam56r")
    with_cache, without = (
        count_parameters(replace(config, index_cache=replace(config.index_cache, enabled=on)).validate()) for on in (True, False)
    )
    assert (with_cache.layers["dsa indexer"], without.layers["dsa indexer"]) == (3, 9)  # 3 Full + 6 Shared, or 9 of their own
    assert with_cache.rows["dsa indexer"] * 3 == without.rows["dsa indexer"]
    assert without.total - with_cache.total == without.rows["dsa indexer"] - with_cache.rows["dsa indexer"]


def test_h3584_cross_check_against_the_original_claims(megatron_built) -> None:
    counts = counts_of("nam56r-h3584")
    claims = ORIGINAL_CLAIMS["nam56r-h3584"]
    mtp = sum(n for c, n in counts.rows.items() if c.startswith("mtp"))
    # The claims match the model without its MTP heads to about 1%, and the idle-expert share exactly.
    assert abs(counts.total - mtp - claims["total"]) / claims["total"] < 0.011
    assert abs((counts.total - counts.active) - (claims["total"] - claims["active"])) / claims["total"] < 0.002
    lines = compare_with_claims(counts, claims)
    assert lines[0].startswith("original claim total: 4,730,000,000; ours 5,038,025,056 (+6.51%)")


def test_table_lists_every_component(megatron_built) -> None:
    table = format_table(counts_of("nam56r-tiny"))
    for component in ("mamba3", "moe routed experts", "dsa indexer", "mla attention", "n-gram hash embedding", "mtp dense mlp"):
        assert re.search(rf"^{re.escape(component)}\s", table, re.M), component


def test_cli_ends_with_plain_integer_totals(megatron_built, tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nam56r.model.params", "--preset", "nam56r-tiny", "--json", str(tmp_path / "c.json")],
        capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()
    counts = counts_of("nam56r-tiny")
    assert out[-2:] == [f"total: {counts.total}", f"active: {counts.active}"]
    assert '"total": ' + str(counts.total) in (tmp_path / "c.json").read_text()


def test_cli_rejects_unknown_presets() -> None:
    proc = subprocess.run([sys.executable, "-m", "nam56r.model.params", "--preset", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr
