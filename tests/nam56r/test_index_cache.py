"""IndexCache: the Full/Shared selection, the per-forward cache, and the DSA layer that uses them."""

from __future__ import annotations

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


def test_shared_layers_reuse_the_full_layers_topk_and_have_no_indexer(tiny_cpu_model, monkeypatch) -> None:
    built = tiny_cpu_model
    model = built.model
    assert built.index_cache_plan.full_layers == (5,) and built.index_cache_plan.shared_layers == (9, 13)
    attention = {n: model.decoder.layers[n - 1].self_attention.core_attention for n in (5, 9, 13)}
    assert attention[5].indexer is not None and attention[9].indexer is None and attention[13].indexer is None
    indexer_runs: list[int] = []
    original = attention[5].indexer.forward_before_topk

    def counting(*a, **k):
        indexer_runs.append(5)
        return original(*a, **k)

    monkeypatch.setattr(attention[5].indexer, "forward_before_topk", counting)
    x = torch.randn(16, 2, built.model.config.hidden_size)

    model.topk_cache.begin_forward()
    outputs = _run_dsa_layers(built, x)
    assert indexer_runs == [5]  # the Shared layers used layer 5's top-k
    assert all(torch.isfinite(o).all() for o in outputs.values())


def test_a_shared_layer_without_this_passs_topk_raises_with_the_reason(tiny_cpu_model) -> None:
    built = tiny_cpu_model
    built.model.topk_cache.begin_forward()
    x = torch.randn(16, 2, built.model.config.hidden_size)
    with pytest.raises(RuntimeError, match=r"Shared DSA layer 9 has no indexer .* layer 5 stored no top-k in this forward pass"):
        _run_dsa_layers(built, x, skip=(5,))  # no Full layer ran in this pass
    built.model.topk_cache.begin_forward()
    _run_dsa_layers(built, x, skip=(9, 13))
    with pytest.raises(RuntimeError, match=r"layer 5's top-k covers rows=16 batch=2, this layer has rows=8 batch=2"):
        _run_dsa_layers(built, x[:8], skip=(5,))  # a stale entry of another shape is never reused


def test_a_pipeline_stage_whose_shared_layer_reads_another_stages_full_layer_is_refused(tiny_cpu_model) -> None:
    from nam56r.model.model import _check_index_cache_sources

    built = tiny_cpu_model
    layers = built.model.decoder.layers
    _check_index_cache_sources(torch.nn.ModuleList([layers[4], layers[8], layers[12]]), built.index_cache_plan)
    second_stage = torch.nn.ModuleList([layers[8], layers[12]])  # a split between layers 5 and 9
    with pytest.raises(ValueError, match=r"layer 9 from layer 5, layer 13 from layer 5.*--index-cache off"):
        _check_index_cache_sources(second_stage, built.index_cache_plan)


class _CpuStream:
    """The current stream's waits, as Megatron's reduce dispatch makes them; on CPU there is nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def test_megatron_ddp_with_overlapped_grad_reduce_sees_a_gradient_for_every_dsa_parameter(monkeypatch) -> None:
    """Megatron's real DistributedDataParallel with --overlap-grad-reduce around the tiny preset's three DSA layers
    (1 Full + 2 Shared; a one-rank gloo group on CPU, CUDA queries answered for CPU as tests/nam56r/checkpoint_worker.py
    does). Overlap issues a bucket's reduce-scatter once every parameter in it has reported its gradient, and the first
    step records which ones do: a parameter no step trains (a Shared layer's indexer, if it had one) fails Megatron's
    bare `assert len(self.per_param_grad_ready_counts) == len(self.params)` at the next step's start."""
    from checkpoint_worker import CudaNamesOnCpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from nam56r.model.model import build_dsa_layers, cuda_buffers_on
    from nam56r.model.presets import get_preset

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _CpuStream())
    built = build_dsa_layers(get_preset("nam56r-tiny"), "local")
    assert built.index_cache_plan.shared_layers == (9, 13)
    stack = torch.nn.ModuleList(built.layers[n] for n in sorted(built.layers))
    config = stack[0].config
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=None)
    with CudaNamesOnCpu():
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=stack)
    x = torch.randn(64, 2, config.hidden_size)
    stack.train()
    for _ in range(3):
        with CudaNamesOnCpu():
            ddp.zero_grad_buffer()
        built.topk_cache.begin_forward()
        hidden = x
        with cuda_buffers_on("cpu"):
            for layer in stack:
                out = layer(hidden, attention_mask=None)
                hidden = out[0] if isinstance(out, tuple) else out
        hidden.float().square().mean().backward()  # the indexer loss rides on the output (DSAIndexerLossAutoScaler)
        with CudaNamesOnCpu():
            ddp.finish_grad_sync()
    groups = ddp.bucket_groups + ddp.expert_parallel_bucket_groups
    assert groups and all(len(g.golden_per_param_grad_ready_counts) == len(g.params) for g in groups)
