"""IndexCache: the Full/Shared selection, the per-forward cache, and the DSA layer that uses them."""

from __future__ import annotations

import logging

import pytest
import torch
from nam56r_kernels.index_cache import IndexCachePlan, TopkCache

NAM56R_DSA_LAYERS = (5, 9, 13, 21, 25, 29, 37, 41, 45)


def test_nam56r_plan_is_three_full_six_shared_each_from_the_nearest_preceding_full() -> None:
    plan = IndexCachePlan.build(NAM56R_DSA_LAYERS, share_group=3)
    assert plan.full_layers == (5, 21, 37)
    assert plan.shared_layers == (9, 13, 25, 29, 41, 45)
    assert [plan.source_of(n) for n in plan.shared_layers] == [5, 5, 21, 21, 37, 37]
    assert plan.is_full(21) and not plan.is_full(25)


def test_share_group_one_makes_every_layer_full() -> None:
    assert IndexCachePlan.build(NAM56R_DSA_LAYERS, share_group=1).shared_layers == ()


@pytest.mark.parametrize(("layers", "group", "message"), [((9, 5), 3, "increasing"), ((0, 4), 3, "positive"), ((5,), 0, "share_group")])
def test_bad_plans_are_rejected(layers, group, message) -> None:
    with pytest.raises(ValueError, match=message):
        IndexCachePlan.build(layers, share_group=group)


def test_non_dsa_layer_has_no_source() -> None:
    with pytest.raises(KeyError, match="layer 6 is not a DSA layer"):
        IndexCachePlan.build(NAM56R_DSA_LAYERS, 3).source_of(6)


def test_cache_hands_out_only_entries_of_this_pass_with_matching_shape() -> None:
    cache = TopkCache()
    topk = torch.zeros(2, 16, 8, dtype=torch.long)
    assert cache.lookup(5, rows=16, batch=2, device=topk.device)[0] is None  # never started
    with pytest.raises(RuntimeError, match="before begin_forward"):
        cache.store(5, topk, None, rows=16, batch=2)
    cache.begin_forward()
    cache.store(5, topk, None, rows=16, batch=2)
    hit, _ = cache.lookup(5, rows=16, batch=2, device=topk.device)
    assert hit is not None and hit[0] is topk
    miss, why = cache.lookup(5, rows=32, batch=2, device=topk.device)
    assert miss is None and "rows=16 batch=2" in why and "rows=32" in why
    miss, why = cache.lookup(21, rows=16, batch=2, device=topk.device)
    assert miss is None and "layer 21 stored no top-k" in why
    miss, why = cache.lookup(5, rows=16, batch=2, device=torch.device("meta"))
    assert miss is None and "runs on meta" in why
    cache.begin_forward()  # a new pass: the old entry is gone, never reused
    miss, why = cache.lookup(5, rows=16, batch=2, device=topk.device)
    assert miss is None and "stored no top-k in this forward pass" in why


def _run_dsa_layers(built, x, skip=()):
    from nam56r.model.model import cuda_buffers_on
    from nam56r.model.pattern import LayerKind

    outputs = {}
    with cuda_buffers_on("cpu"), torch.no_grad():
        for number in built.layout.layer_numbers(LayerKind.DSA):
            if number not in skip:
                out = built.model.decoder.layers[number - 1](x, attention_mask=None)
                outputs[number] = out[0] if isinstance(out, tuple) else out
    return outputs


def test_shared_layers_reuse_the_full_layers_topk_and_compute_their_own_without_a_valid_cache(tiny_cpu_model, monkeypatch, caplog) -> None:
    built = tiny_cpu_model
    model = built.model
    assert built.index_cache_plan.full_layers == (5,) and built.index_cache_plan.shared_layers == (9, 13)
    indexer_runs: list[int] = []
    for number in (5, 9, 13):
        indexer = model.decoder.layers[number - 1].self_attention.core_attention.indexer
        original = indexer.forward_before_topk
        def counting(*a, _n=number, _f=original, **k):
            indexer_runs.append(_n)
            return _f(*a, **k)

        monkeypatch.setattr(indexer, "forward_before_topk", counting)
    x = torch.randn(16, 2, built.model.config.hidden_size)

    model.topk_cache.begin_forward()
    outputs = _run_dsa_layers(built, x)
    assert indexer_runs == [5]  # the Shared layers used layer 5's top-k
    assert all(torch.isfinite(o).all() for o in outputs.values())

    indexer_runs.clear()
    model.topk_cache.begin_forward()
    with caplog.at_level(logging.WARNING, logger="nam56r.model.dsa_index_cache"):
        _run_dsa_layers(built, x, skip=(5,))  # no Full layer ran in this pass
    assert indexer_runs == [9, 13]  # each computed its own instead of reusing the stale entry
    assert "DSA layer 9 computes its own top-k (no valid cache from layer 5" in caplog.text
