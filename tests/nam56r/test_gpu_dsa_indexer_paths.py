"""GPU: NAM56R's DSA layer at its own widths and sequence length, bf16, on every indexer path
(`DSAConfig.indexer`), same weights, forward+backward in training mode. `fused-tilelang-loss` runs the fused
top-k's selection through Megatron's real TileLang target, KL and indexer-backward kernels (counted here), so
against `fused` (the same selection, the loss in torch) its output is the same and its indexer loss and indexer
gradients differ only by those kernels' rounding; against Megatron's path, whose TileLang indexer sums the same
products in another order, its loss agrees to within the selections that a near-tie flips."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: the fused top-k and the TileLang DSA kernels run on CUDA only"),
]

SEQ, BATCH = 4096, 1


def _layer(indexer: str, weights: dict | None):
    from nam56r_bench.layer_cases import as_trained

    from nam56r.model.model import build_dsa_layers
    from nam56r.model.presets import get_preset

    base = get_preset("nam56r")
    config = replace(base, dsa=replace(base.dsa, indexer=indexer)).validate()
    built = build_dsa_layers(config, "local", device="cuda", params_dtype=torch.bfloat16)
    layer = as_trained(built.layers[min(built.layers)])
    if weights is None:
        indexer_module = layer.self_attention.core_attention.indexer
        with torch.no_grad():  # peaked index scores: the loss and its gradients are far from zero
            scales = {"linear_wq_b": 4.0, "linear_wk": 4.0, "linear_weights_proj": 16.0}
            for name, scale in scales.items():
                getattr(indexer_module, name).weight.mul_(scale)
    else:
        layer.load_state_dict(weights)
    return layer.train()


def _fwd_bwd(layer) -> dict:
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(SEQ, BATCH, layer.config.hidden_size, device="cuda", generator=g).bfloat16().requires_grad_()
    grad_out = torch.randn(SEQ, BATCH, layer.config.hidden_size, device="cuda", generator=g).bfloat16()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    out = layer(x, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_out)
    loss = DSAIndexerLossLoggingHelper.tracker["values"][layer.layer_number - 1].clone()
    grads = {name: p.grad.float() for name, p in layer.named_parameters() if ".indexer." in name and p.grad is not None}
    return {"output": out.detach().float(), "input grad": x.grad.float(), "loss": loss, "indexer grads": grads}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def test_fused_tilelang_loss_runs_megatrons_kernels_and_matches_the_other_paths(megatron_built, monkeypatch) -> None:
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_indexer_bwd, tilelang_indexer_loss

    calls = {"target": 0, "kl": 0, "indexer backward": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    for module, name, counter in ((tilelang_indexer_loss, "sparse_indexer_target_interface", "target"),
                                  (tilelang_indexer_loss, "sparse_indexer_kl_interface", "kl"),
                                  (tilelang_indexer_bwd, "indexer_bwd_interface", "indexer backward")):
        monkeypatch.setattr(module, name, counted(counter, getattr(module, name)))

    torch.manual_seed(0)
    megatron_layer = _layer("megatron", None)
    weights = megatron_layer.state_dict()
    results = {"megatron": _fwd_bwd(megatron_layer)}
    del megatron_layer
    for indexer in ("fused", "fused-tilelang-loss"):
        before = dict(calls)
        results[indexer] = _fwd_bwd(_layer(indexer, weights))
        ran = {name: calls[name] - before[name] for name in calls}
        per_sequence = 0 if indexer == "fused" else BATCH
        assert ran == {"target": per_sequence, "kl": per_sequence, "indexer backward": per_sequence}, ran

    torch_loss, tilelang, megatron = results["fused"], results["fused-tilelang-loss"], results["megatron"]
    assert float(megatron["loss"]) > 1e-2, f"a vanishing indexer loss ({float(megatron['loss'])}) would compare nothing"
    assert tilelang["indexer grads"].keys() == torch_loss["indexer grads"].keys() == megatron["indexer grads"].keys() != set()
    # The same selection: the attention, and so the output and the input's gradient, are the same computation.
    assert _relative(tilelang["output"], torch_loss["output"]) == 0.0
    assert _relative(tilelang["input grad"], torch_loss["input grad"]) < 1e-2
    torch.testing.assert_close(tilelang["loss"], torch_loss["loss"], rtol=1e-3, atol=0)
    for name, grad in tilelang["indexer grads"].items():
        # Megatron's TileLang indexer backward runs its GEMMs on fp32 tiles, so on tensor cores in TF32, evaluates
        # the ReLU mask on those TF32 logits and sums dK with atomics in no fixed order; the key-side gradients
        # (linear_wk, k_norm) sum over every query with cancellation. On an H100 the worst of them differs from the
        # torch loss's by 4.2e-2 of its largest element, with cosine 0.99906; the bounds are twice that spread.
        # A wrong index, scale or mask moves the direction far more.
        want = torch_loss["indexer grads"][name]
        cosine = float(torch.nn.functional.cosine_similarity(grad.flatten(), want.flatten(), dim=0))
        print(f"indexer grad {name}: max error {_relative(grad, want):.2e} of the largest, cosine {cosine:.6f}")
        assert cosine > 0.998, (name, cosine)
        assert _relative(grad, want) < 8e-2, name
    # Against Megatron's path: its TileLang indexer's fp32 sums in another order can flip a near-tie's selection.
    torch.testing.assert_close(tilelang["loss"], megatron["loss"], rtol=1e-2, atol=0)
    assert _relative(tilelang["output"], megatron["output"]) < 5e-2
    print(f"DSA_INDEXER_PATHS_GPU_OK losses megatron={float(megatron['loss']):.5f} fused={float(torch_loss['loss']):.5f} "
          f"fused-tilelang-loss={float(tilelang['loss']):.5f}")
