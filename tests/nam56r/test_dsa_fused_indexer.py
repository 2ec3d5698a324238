"""The fused DSA indexer path (`DSAConfig.indexer="fused"`, nam56r.model.dsa_fused_indexer) against Megatron's:
the same top-k, indexer loss and gradients w.r.t. the indexer's q, k and weights (Megatron's naive
`FusedDSAIndexerLoss`), the same layer output and parameter gradients for NAM56R's real DSA layers with
IndexCache on and off, the switch reaching the layers the model builders build, and the refusals. The fused
top-k runs under Triton's CPU interpreter here, in fp32 (its bf16 GEMMs are covered on a GPU by
tests/kernels/test_dsa_indexer.py)."""

from __future__ import annotations

import textwrap
from dataclasses import replace

import pytest
import torch

from nam56r.model.presets import get_preset


def indexer_loss_inputs(sq: int, batch: int, heads: int, dim: int, attn_heads: int, attn_dim: int, seed: int):
    """Indexer q [sq, b, H, D], k [sk, b, D], weights [sq, b, H] (positive, so that relu's zeros tie only
    below every positive score) and the attention's absorbed query [sq, b, heads, d] and key [sk, b, 1, d]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, batch, heads, dim, generator=g)
    k = torch.randn(sq, batch, dim, generator=g)
    weights = torch.rand(sq, batch, heads, generator=g) * heads**-0.5
    query = torch.randn(sq, batch, attn_heads, attn_dim, generator=g)
    key = torch.randn(sq, batch, 1, attn_dim, generator=g)
    return q, k, weights, query, key


def megatron_indexer_loss(q, k, weights, query, key, topk: int, *, use_relu: bool, per_token: bool, softmax_scale: float, coeff: float,
                          sparse: bool = True):
    """(indices, loss, grad q, grad k, grad weights) from Megatron's `FusedDSAIndexerLoss` (the sparse loss
    unless `sparse=False`), called as DSAttention calls it for causal self-attention (row-wise key bounds,
    the key expanded to every head)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import FusedDSAIndexerLoss

    from nam56r.model.model import single_process_groups

    sq = q.shape[0]
    q, k, weights = (t.clone().requires_grad_() for t in (q, k, weights))
    starts, ends = torch.zeros(sq, dtype=torch.int64), torch.arange(1, sq + 1)
    indices, loss = FusedDSAIndexerLoss.apply(
        q, weights, k, query, key.expand(-1, -1, query.shape[2], -1), softmax_scale, topk, coeff, None, sparse,
        single_process_groups(), starts, ends, None, None, per_token, use_relu,
    )
    loss.backward()
    return indices, loss.detach(), q.grad, k.grad, weights.grad


def fused_indexer_loss(q, k, weights, query, key, topk: int, *, use_relu: bool, per_token: bool, softmax_scale: float, coeff: float):
    from nam56r.model.dsa_fused_indexer import select_topk_scored, sparse_indexer_loss

    q, k, weights = (t.clone().requires_grad_() for t in (q, k, weights))
    _, indices = select_topk_scored(q, k, weights, topk, use_relu=use_relu)
    loss = sparse_indexer_loss(q, k, weights, indices, query, key, softmax_scale=softmax_scale, loss_coeff=coeff, use_relu=use_relu,
                               calculate_per_token_loss=per_token)
    loss.backward()
    return indices, loss.detach(), q.grad, k.grad, weights.grad


def assert_same_loss_path(megatron, fused) -> None:
    """Same selected key sets per row (-1 where no key is visible), same loss, same gradients (fp32 sums in
    another order)."""
    (m_idx, m_loss, *m_grads), (f_idx, f_loss, *f_grads) = megatron, fused
    assert f_idx.shape == m_idx.shape, (f_idx.shape, m_idx.shape)
    assert torch.equal(f_idx.long().sort(-1).values, m_idx.long().sort(-1).values), "the selected keys differ"
    torch.testing.assert_close(f_loss, m_loss, rtol=1e-5, atol=0)
    for name, f_grad, m_grad in zip(("q", "k", "weights"), f_grads, m_grads, strict=True):
        scale = m_grad.abs().max()
        assert scale > 0, f"Megatron's gradient w.r.t. {name} is zero: the comparison would prove nothing"
        torch.testing.assert_close(f_grad / scale, m_grad / scale, rtol=0, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


# 40 rows, top-12: rows 0..10 keep every visible key and hold -1 slots, the others select. The attention
# head dim (32 + 16) is absorbed MLA's latent + rope, 3 heads sharing one key.
LOSS_SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.nam56r.test_dsa_fused_indexer import assert_same_loss_path, fused_indexer_loss, indexer_loss_inputs, megatron_indexer_loss

    inputs = indexer_loss_inputs(40, 2, 4, 16, 3, 48, seed=0)
    for use_relu, per_token, coeff in ((True, False, 1.0), (False, True, 0.5)):
        kwargs = dict(use_relu=use_relu, per_token=per_token, softmax_scale=48**-0.5, coeff=coeff)
        megatron, fused = megatron_indexer_loss(*inputs, 12, **kwargs), fused_indexer_loss(*inputs, 12, **kwargs)
        assert fused[0].dtype == torch.int32 and bool((fused[0] == -1).any()), "not int32 with -1 in empty slots"
        assert float(megatron[1]) > 1e-2, "a vanishing loss would compare nothing"
        assert_same_loss_path(megatron, fused)
        print("loss path ok", use_relu, per_token, float(fused[1]))
    """
)


def test_fused_loss_path_matches_megatrons_sparse_indexer_loss(run_interpreted, megatron_built) -> None:
    stdout = run_interpreted(LOSS_SCRIPT, timeout=600)
    assert stdout.count("loss path ok") == 2, stdout


def test_the_comparison_catches_other_keys_and_the_dense_loss(megatron_built) -> None:
    """Another selection, or Megatron's dense indexer loss (normalized over every causal key) on the same
    selection, fail the comparison; Megatron's own path stands in for the fused top-k here (no interpreter)."""
    inputs = indexer_loss_inputs(40, 2, 4, 16, 3, 48, seed=0)
    kwargs = dict(use_relu=True, per_token=False, softmax_scale=48**-0.5, coeff=1.0)
    sparse = megatron_indexer_loss(*inputs, 12, **kwargs)
    assert_same_loss_path(sparse, sparse)
    with pytest.raises(AssertionError, match="selected keys differ"):
        assert_same_loss_path(sparse, (sparse[0].roll(1, dims=1), *sparse[1:]))
    dense = megatron_indexer_loss(*inputs, 12, sparse=False, **kwargs)
    assert torch.equal(dense[0], sparse[0])
    with pytest.raises(AssertionError, match="Scalars are not close"):
        assert_same_loss_path(sparse, dense)
    with pytest.raises(AssertionError, match="grad q"):
        assert_same_loss_path(sparse, (sparse[0], sparse[1], dense[2], *sparse[3:]))


def test_index_scores_at_the_indices_are_the_reference_scores_there() -> None:
    from nam56r_kernels.dsa_indexer import index_scores_reference, index_topk_reference

    from nam56r.model.dsa_fused_indexer import index_scores_at

    q, k, weights, _, _ = indexer_loss_inputs(24, 2, 4, 16, 1, 16, seed=3)
    for use_relu in (True, False):
        _, indices = index_topk_reference(q, k, weights, 8, use_relu=use_relu)
        full = index_scores_reference(q, k, weights, use_relu=use_relu, causal=True)
        got = index_scores_at(q, k, weights, indices, use_relu=use_relu)
        valid = indices >= 0
        torch.testing.assert_close(got[valid], full.gather(-1, indices.clamp(min=0).long())[valid], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- NAM56R's DSA layers


def layer_config(indexer: str, index_cache: bool):
    """nam56r-tiny at 48 tokens and top-16 (the fused top-k selects; Triton's interpreter stays quick)."""
    base = get_preset("nam56r-tiny")
    return replace(
        base, seq_length=48, dsa=replace(base.dsa, topk=16, indexer=indexer), index_cache=replace(base.index_cache, enabled=index_cache)
    ).validate()


def run_layers_fwd_bwd(built, seed: int = 0) -> dict:
    """NAM56R's DSA layers in training mode, one after another as in the model (a new IndexCache pass first),
    on hidden states [48, 2, hidden]: their output, the input's gradient, every parameter gradient and
    each layer's indexer loss from Megatron's tracker."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    from nam56r.model.model import cuda_buffers_on

    g = torch.Generator().manual_seed(seed)
    hidden = built.layers[min(built.layers)].config.hidden_size
    x = torch.randn(48, 2, hidden, generator=g).requires_grad_()
    grad_out = torch.randn(48, 2, hidden, generator=g)
    if built.topk_cache is not None:
        built.topk_cache.begin_forward()
    with cuda_buffers_on("cpu"):
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        h = x
        for layer in built.layers.values():
            layer.train()
            out = layer(h, attention_mask=None)
            h = out[0] if isinstance(out, tuple) else out
        h.backward(grad_out)
        losses = DSAIndexerLossLoggingHelper.tracker["values"].clone()
    grads = {f"{n}.{name}": p.grad for n, layer in built.layers.items() for name, p in layer.named_parameters()}
    return {"output": h.detach(), "input grad": x.grad, "losses": losses, "grads": grads}


def same_weights(reference, other) -> None:
    """`other`'s layers take `reference`'s parameters, the indexers' projections scaled up so that their
    score distributions are peaked and the indexer loss is far from zero."""
    for number, layer in reference.layers.items():
        indexer = layer.self_attention.core_attention.indexer
        if indexer is not None:
            with torch.no_grad():
                for linear, scale in ((indexer.linear_wq_b, 8.0), (indexer.linear_wk, 8.0), (indexer.linear_weights_proj, 64.0)):
                    linear.weight.mul_(scale)
        other.layers[number].load_state_dict(layer.state_dict())


LAYER_SCRIPT = textwrap.dedent(
    """
    import torch
    import nam56r.model.dsa_fused_indexer as fused_indexer
    from megatron.core.transformer.experimental_attention_variant import dsa
    from nam56r.model.model import build_dsa_layers
    from tests.nam56r.test_dsa_fused_indexer import layer_config, run_layers_fwd_bwd, same_weights

    calls = {"fused top-k": 0, "megatron loss": 0}
    real_topk, real_loss = fused_indexer.index_topk_fused, dsa.FusedDSAIndexerLoss.apply
    def counting_topk(*a, **k):
        calls["fused top-k"] += 1
        return real_topk(*a, **k)
    def counting_loss(*a, **k):
        calls["megatron loss"] += 1
        return real_loss(*a, **k)
    fused_indexer.index_topk_fused, dsa.FusedDSAIndexerLoss.apply = counting_topk, counting_loss

    for index_cache in (True, False):
        torch.manual_seed(0)
        megatron = build_dsa_layers(layer_config("megatron", index_cache), "local")
        fused = build_dsa_layers(layer_config("fused", index_cache), "local")
        same_weights(megatron, fused)
        calls.update({"fused top-k": 0, "megatron loss": 0})
        want = run_layers_fwd_bwd(megatron)
        assert calls == {"fused top-k": 0, "megatron loss": 3 - 2 * index_cache}, calls
        got = run_layers_fwd_bwd(fused)
        assert calls == {"fused top-k": 3 - 2 * index_cache, "megatron loss": 3 - 2 * index_cache}, calls
        computing = [n - 1 for n in megatron.layers if megatron.index_cache_plan is None or megatron.index_cache_plan.is_full(n)]
        assert bool((want["losses"][computing] > 1e-2).all()), want["losses"]
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(got["output"], want["output"], rtol=0, atol=0)
        torch.testing.assert_close(got["input grad"], want["input grad"], rtol=0, atol=0)
        assert got["grads"].keys() == want["grads"].keys()
        trained = {name for name, grad in want["grads"].items() if grad is not None}
        assert trained == {name for name, grad in got["grads"].items() if grad is not None}
        # Every parameter trains; a Shared layer has no indexer (IndexCache reuses another layer's top-k there).
        assert trained == want["grads"].keys()
        with_indexer = {int(name.split(".")[0]) - 1 for name in trained if ".indexer." in name}
        assert with_indexer == set(computing), (with_indexer, computing)
        for name in trained:
            grad = want["grads"][name]
            scale = grad.abs().max().clamp_min(1e-30)
            torch.testing.assert_close(got["grads"][name] / scale, grad / scale, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        print("layers ok", index_cache, [round(float(v), 4) for v in got["losses"][computing]])
    """
)


def test_fused_dsa_layers_match_megatrons_with_and_without_index_cache(run_interpreted, megatron_built) -> None:
    stdout = run_interpreted(LAYER_SCRIPT, timeout=900)
    assert stdout.count("layers ok") == 2, stdout


def test_the_switch_reaches_the_layers_of_the_model_builder(megatron_built) -> None:
    from nam56r.model.config import DSA_INDEXER_PATHS
    from nam56r.model.dsa_fused_indexer import FusedIndexerDSAttention
    from nam56r.model.model import build_model
    from nam56r.model.pattern import LayerKind

    for indexer in DSA_INDEXER_PATHS:
        config = replace(get_preset("nam56r-tiny"), dsa=replace(get_preset("nam56r-tiny").dsa, indexer=indexer))
        built = build_model(config, "local", device="meta")
        dsa_layers = [built.model.decoder.layers[n - 1] for n in built.layout.layer_numbers(LayerKind.DSA)]
        assert len(dsa_layers) == 3
        for layer in dsa_layers:
            attention = layer.self_attention.core_attention
            assert isinstance(attention, FusedIndexerDSAttention) and attention.indexer_path == indexer


# ---------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def fused_layers(megatron_built):
    from nam56r.model.model import build_dsa_layers

    return build_dsa_layers(layer_config("fused", index_cache=False), "local")


def _attention_call(built, **overrides):
    from megatron.core.transformer.enums import AttnMaskType

    layer = built.layers[min(built.layers)]
    config = layer.config
    absorbed = config.kv_lora_rank + config.qk_pos_emb_head_dim
    call = dict(
        query=torch.randn(48, 2, config.num_attention_heads, absorbed),
        key=torch.randn(48, 2, 1, absorbed),
        value=None,
        attention_mask=None,
        x=torch.randn(48, 2, config.hidden_size),
        qr=torch.randn(48, 2, config.q_lora_rank),
        attn_mask_type=AttnMaskType.causal,
        up_v_weight=layer.self_attention._get_v_up_weight(),
    )
    return layer.self_attention.core_attention, {**call, **overrides}


def test_cpu_tensors_without_the_interpreter_are_refused_naming_the_switch(fused_layers, monkeypatch) -> None:
    from nam56r.model.model import cuda_buffers_on

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    attention, call = _attention_call(fused_layers)
    with cuda_buffers_on("cpu"), pytest.raises(RuntimeError, match=r"DSAConfig.indexer='fused' or 'fused-tilelang-loss'\) needs CUDA "
                                                                     r"tensors, got device cpu; use DSAConfig.indexer='megatron' for CPU"):
        attention(**call)


def test_the_tilelang_loss_path_refuses_cpu_tensors_even_under_the_interpreter(megatron_built, monkeypatch) -> None:
    """Megatron's TileLang loss kernels have no interpreter: the layer names what it got and the two other paths."""
    from nam56r.model.dsa_fused_indexer import FusedIndexerUnsupported
    from nam56r.model.model import build_dsa_layers, cuda_buffers_on

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    attention, call = _attention_call(build_dsa_layers(layer_config("fused-tilelang-loss", index_cache=False), "local"))
    attention.train()
    with cuda_buffers_on("cpu"), pytest.raises(FusedIndexerUnsupported, match=(
            r"DSAConfig.indexer='fused-tilelang-loss', layer \d+\) does not support q on cpu, query on cpu, q in torch.float32, "
            r"k in torch.float32, query in torch.float32, key in torch.float32: Megatron's TileLang sparse-loss kernels take CUDA bf16 "
            r"tensors; set DSAConfig.indexer='fused' \(the loss in torch\) or 'megatron'")):
        attention(**call)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attn_mask_type": None}, r"attention mask type None \(causal self-attention only\)"),
        ({"packed_seq_params": object()}, r"packed sequences"),
        ({"key": torch.randn(48, 2, 4, 128), "value": torch.randn(48, 2, 4, 64)}, r"absorbed MLA only"),
        ({"key": torch.randn(40, 2, 1, 128)}, r"query rows 48 != key rows 40"),
    ],
)
def test_calls_outside_the_fused_paths_cover_are_refused(fused_layers, overrides, message) -> None:
    from nam56r.model.dsa_fused_indexer import FusedIndexerUnsupported

    attention, call = _attention_call(fused_layers, **overrides)
    with pytest.raises(FusedIndexerUnsupported, match=message + r".*set DSAConfig.indexer='megatron'"):
        attention(**call)


def test_the_dense_loss_and_unknown_paths_are_refused(megatron_built, monkeypatch) -> None:
    from nam56r.model.model import build_dsa_layers

    base = get_preset("nam56r-tiny")
    for indexer in ("fused", "fused-tilelang-loss"):
        with pytest.raises(ValueError, match=f"dsa.indexer '{indexer}' trains the indexer with the sparse loss only"):
            replace(base, dsa=replace(base.dsa, indexer=indexer, sparse_indexer_loss=False)).validate()
    with pytest.raises(ValueError, match="dsa.indexer 'triton' must be one of 'megatron', 'fused', 'fused-tilelang-loss'"):
        replace(base, dsa=replace(base.dsa, indexer="triton")).validate()
    # A Megatron config from elsewhere (the training flags) with the dense loss: the layer refuses it when built.
    import nam56r.model.model as model

    real = model.megatron_config

    def dense_loss(*a, **k):
        cfg = real(*a, **k)
        cfg.dsa_indexer_use_sparse_loss = False
        return cfg

    monkeypatch.setattr(model, "megatron_config", dense_loss)
    with pytest.raises(ValueError, match="sparse indexer loss only"):
        build_dsa_layers(replace(base, dsa=replace(base.dsa, indexer="fused")), "local", device="meta")


def test_fused_indexer_shapes_are_checked_before_launch(megatron_built) -> None:
    from nam56r.model.fused_constraints import fused_kernel_violations

    base = get_preset("nam56r-tiny")
    fused = replace(base, dsa=replace(base.dsa, indexer="fused"))
    assert fused_kernel_violations(fused) == []
    # The TileLang indexer backward's head counts no longer apply: the fused path does not call it.
    assert fused_kernel_violations(replace(fused, dsa=replace(fused.dsa, indexer_heads=12))) == []
    # Any top-k: the select keeps as many keys as asked; a row longer than it holds in registers is refused.
    assert fused_kernel_violations(replace(fused, seq_length=4096, dsa=replace(fused.dsa, topk=2048))) == []
    (too_long,) = fused_kernel_violations(replace(fused, seq_length=65536))
    assert "seq_length 65536 exceeds the 32768 keys per query" in too_long
    (odd_dim,) = fused_kernel_violations(replace(fused, dsa=replace(fused.dsa, indexer_head_dim=48)))
    assert "dsa.indexer_head_dim 48 is not a power of two >= 16" in odd_dim


def test_the_tilelang_loss_path_is_held_to_megatrons_loss_kernel_shapes(megatron_built) -> None:
    """`fused-tilelang-loss` selects with the fused top-k and trains with Megatron's TileLang loss kernels: the
    preflight checks both contracts, where "fused" (the loss in torch) needs only the top-k's."""
    from nam56r.model.fused_constraints import fused_kernel_violations

    nam56r = get_preset("nam56r")
    for indexer in ("fused", "fused-tilelang-loss"):
        assert fused_kernel_violations(replace(nam56r, dsa=replace(nam56r.dsa, indexer=indexer))) == []
    few_heads = {indexer: fused_kernel_violations(replace(nam56r, dsa=replace(nam56r.dsa, indexer=indexer, indexer_heads=12)))
                 for indexer in ("fused", "fused-tilelang-loss")}
    assert few_heads["fused"] == []
    assert any("indexer heads 12 unsupported by the TileLang indexer backward" in p for p in few_heads["fused-tilelang-loss"])
    (narrow_topk,) = [p for p in fused_kernel_violations(replace(nam56r, dsa=replace(nam56r.dsa, indexer="fused-tilelang-loss", topk=192)))
                      if "sparse KL kernel" in p]
    assert "top-k 192" in narrow_topk
    (select_limit,) = fused_kernel_violations(replace(nam56r, seq_length=65536, dsa=replace(nam56r.dsa, indexer="fused-tilelang-loss")))
    assert "exceeds the 32768 keys per query" in select_limit


def _tilelang_contracts_in_torch(monkeypatch) -> dict:
    """Megatron's three TileLang sparse-loss interfaces replaced by torch functions of their documented contracts
    (the TileLang kernels run on CUDA only; tests/nam56r/test_gpu_dsa_indexer_paths.py runs the real ones), counting
    their calls: what `sparse_indexer_loss_tilelang` hands them and does with their results is the glue under test."""
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_indexer_bwd, tilelang_indexer_loss

    from nam56r.model.dsa_fused_indexer import index_scores_at

    calls = {"target": 0, "kl": 0, "indexer backward": 0}

    def target(query, key, indices, softmax_scale):  # [sq, H, d], [sk, d], [sq, topk] -> fp32 [sq, topk], summed over heads
        calls["target"] += 1
        valid = (indices >= 0).unsqueeze(1)
        logits = torch.einsum("shd,skd->shk", query.float(), key.float()[indices.clamp(min=0).long()]) * softmax_scale
        return torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1).masked_fill(~valid, 0).sum(dim=1)

    def kl(target, logits, valid):  # (sum of KL(T / sum T || softmax(logits)) over rows, its gradient w.r.t. logits)
        calls["kl"] += 1
        t = target.masked_fill(~valid, 0) / target.masked_fill(~valid, 0).sum(-1, keepdim=True)
        log_p = torch.log_softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
        terms = torch.where(valid & (t > 0), t * (t.clamp_min(1e-30).log() - log_p), torch.zeros_like(t))
        return terms.sum(), (log_p.exp() - t).masked_fill(~valid, 0)

    def indexer_backward(q, weights, k, indices, grad_scores, use_relu=True):  # -> grad q, grad weights, grad k
        calls["indexer backward"] += 1
        q, weights, k = (t.detach().requires_grad_() for t in (q, weights, k))
        with torch.enable_grad():
            scores = index_scores_at(q.unsqueeze(1), k.unsqueeze(1), weights.unsqueeze(1), indices.unsqueeze(0), use_relu=use_relu)[0]
            grad_q, grad_w, grad_k = torch.autograd.grad((scores * grad_scores).masked_fill(indices < 0, 0).sum(), (q, weights, k))
        return grad_q, grad_w, grad_k

    monkeypatch.setattr(tilelang_indexer_loss, "sparse_indexer_target_interface", target)
    monkeypatch.setattr(tilelang_indexer_loss, "sparse_indexer_kl_interface", kl)
    monkeypatch.setattr(tilelang_indexer_bwd, "indexer_bwd_interface", indexer_backward)
    return calls


def test_the_tilelang_loss_glue_gives_the_torch_paths_loss_and_gradients(megatron_built, monkeypatch) -> None:
    from nam56r_kernels.dsa_indexer import index_topk_reference

    from nam56r.model.dsa_fused_indexer import sparse_indexer_loss, sparse_indexer_loss_tilelang

    calls = _tilelang_contracts_in_torch(monkeypatch)
    q, k, weights, query, key = indexer_loss_inputs(40, 2, 4, 16, 3, 48, seed=0)
    for use_relu, per_token, coeff in ((True, False, 1.0), (False, True, 0.5)):
        scores, indices = index_topk_reference(q, k, weights, 12, use_relu=use_relu)
        assert bool((indices == -1).any()), "rows with empty slots are part of the contract"
        results = []
        for tilelang in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, k, weights)]
            kwargs = dict(softmax_scale=48**-0.5, loss_coeff=coeff, use_relu=use_relu, calculate_per_token_loss=per_token)
            loss = (sparse_indexer_loss_tilelang(*leaves, indices, scores, query, key, **kwargs) if tilelang
                    else sparse_indexer_loss(*leaves, indices, query, key, **kwargs))
            loss.backward()
            results.append((indices, loss.detach(), *(leaf.grad for leaf in leaves)))
        assert float(results[0][1]) > 1e-2, "a vanishing loss would compare nothing"
        assert_same_loss_path(results[0], results[1])
    assert calls == {"target": 4, "kl": 4, "indexer backward": 4}, calls  # per sequence, twice
