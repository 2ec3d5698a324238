"""Patches megatron-lm 0007 and 0008: the hybrid LM head and every MTP depth compute their loss with
the fused linear cross-entropy (TransformerConfig.fused_linear_cross_entropy), no [s, b, V] logits.

Liger's fused linear CE is a Triton kernel that the Triton interpreter cannot run on CPU (its
cross-entropy kernel loops over a runtime bound, which the 3.6 interpreter rejects), so these tests
put a PyTorch stand-in with Liger's call signature behind the seam and check Megatron's side: the
loss contract ([b, s] float32 against [b, s] labels), the options passed to Liger (reduction='none',
fp32 weight-gradient accumulation), the MTP label/mask rolling, loss scaling and acceptance metric,
and the fail-closed checks. The real kernel's loss, gradients and memory are the GPU reproducer's
(patches/packs/14-hybrid-fused-linear-ce/repro.py, recorded in the manifest)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from megatron.core.fusions import fused_linear_cross_entropy as flce  # megatron-lm patch 0007
from megatron.core.transformer import multi_token_prediction as mtp
from megatron.core.transformer.transformer_config import TransformerConfig

S, B, H, V = 12, 3, 16, 40


class LigerStandIn:
    """LigerFusedLinearCrossEntropyFunction.apply's positional API, in chunks of 5 tokens."""

    calls: list[tuple] = []

    @classmethod
    def apply(cls, _input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
              reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
              return_predicted_tokens):
        cls.calls.append((reduction, accum_dtype, return_predicted_tokens, tuple(_input.shape), tuple(target.shape)))
        losses, preds = [], []
        for rows in torch.split(torch.arange(_input.shape[0]), 5):
            logits = (_input[rows] @ weight.T).float()
            losses.append(F.cross_entropy(logits, target[rows], reduction="none", ignore_index=ignore_index))
            preds.append(logits.argmax(dim=-1))
        return torch.cat(losses), None, None, (torch.cat(preds) if return_predicted_tokens else None)


@pytest.fixture
def liger(monkeypatch):
    import liger_kernel.ops.fused_linear_cross_entropy as liger_flce

    LigerStandIn.calls = []
    monkeypatch.setattr(liger_flce, "LigerFusedLinearCrossEntropyFunction", LigerStandIn)
    return LigerStandIn


def _unfused_loss(hidden, weight, labels):
    """What compute_language_model_loss returns on the output layer's logits: [b, s] float32."""
    logits = hidden @ weight.T  # [s, b, V]
    return F.cross_entropy(logits.float().permute(1, 2, 0), labels, reduction="none")


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) / 4).requires_grad_(True)
    labels = torch.randint(0, V, (B, S), generator=g)
    return hidden, weight, labels


def test_loss_and_gradients_match_the_unfused_head(liger) -> None:
    hidden, weight, labels = _inputs()
    loss, preds = flce.fused_linear_cross_entropy(hidden, weight, labels)
    assert preds is None and loss.shape == (B, S) and loss.dtype == torch.float32
    assert liger.calls == [("none", torch.float32, False, (S * B, H), (S * B,))]
    h2, w2 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    reference = _unfused_loss(h2, w2, labels)
    torch.testing.assert_close(loss, reference)
    mask = torch.rand(B, S, generator=torch.Generator().manual_seed(1)).round()  # a per-token loss mask
    (loss * mask).sum().backward()
    (reference * mask).sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)


def test_predictions_are_the_argmax_per_position(liger) -> None:
    hidden, weight, labels = _inputs()
    _, preds = flce.fused_linear_cross_entropy(hidden, weight, labels, return_predictions=True)
    assert torch.equal(preds, (hidden @ weight.T).argmax(dim=-1))  # [s, b]


def test_bad_shapes_are_rejected_with_the_values(liger) -> None:
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=r"labels must be \[b, s\] = \[3, 12\], got \(12, 3\)"):
        flce.fused_linear_cross_entropy(hidden, weight, labels.T)
    with pytest.raises(ValueError, match=r"weight must be \[V, 16\]"):
        flce.fused_linear_cross_entropy(hidden, weight[:, :8], labels)


def test_missing_liger_fails_closed(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_cross_entropy", None)
    hidden, weight, labels = _inputs()
    with pytest.raises(ImportError, match="needs liger-kernel >= 0.8.2"):
        flce.fused_linear_cross_entropy(hidden, weight, labels)


@pytest.mark.parametrize("extra, message", [({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size 1 only"),
                                            ({"use_mup": True}, "use_mup")])
def test_config_rejects_what_the_fused_head_cannot_do(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, fused_linear_cross_entropy=True, **extra)


class _OutputLayer:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.calls = 0

    def __call__(self, hidden, weight=None, runtime_gather_output=None):
        self.calls += 1
        return hidden @ (self.weight if weight is None else weight).T, None


def _process_mtp_loss(fused: bool, monkeypatch) -> dict:
    depths = 2
    metrics: list[tuple] = []
    monkeypatch.setattr(mtp.MTPLossLoggingHelper, "save_metrics_to_tracker",
                        staticmethod(lambda loss, correct, total, layer, *a, **k: metrics.append((layer, loss, correct, total))))
    monkeypatch.setattr(mtp.parallel_state, "get_data_parallel_group", lambda **kwargs: None)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn((1 + depths) * S, B, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) / 4).requires_grad_(True)
    labels = torch.randint(0, V, (B, S), generator=g)
    loss_mask = (torch.rand(B, S, generator=g) > 0.2).float()
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, mtp_num_layers=depths,
                               fused_linear_cross_entropy=fused)
    output_layer = _OutputLayer(weight)
    out = mtp.process_mtp_loss(
        hidden_states=hidden, labels=labels, loss_mask=loss_mask, output_layer=output_layer, output_weight=None,
        runtime_gather_output=None, is_training=True,
        compute_language_model_loss=lambda lab, logits: F.cross_entropy(logits.float().permute(1, 2, 0), lab, reduction="none"),
        config=config,
    )
    out.sum().backward()  # MTPLossAutoScaler sends the scaled MTP losses' gradients back with it
    return {"out": out.detach(), "hidden_grad": hidden.grad, "weight_grad": weight.grad, "metrics": metrics,
            "output_layer_calls": output_layer.calls}


def test_mtp_depths_match_the_unfused_path(liger, monkeypatch) -> None:
    fused = _process_mtp_loss(True, monkeypatch)
    unfused = _process_mtp_loss(False, monkeypatch)
    assert fused["output_layer_calls"] == 0 and unfused["output_layer_calls"] == 2  # no logits when fused
    assert [c[0] for c in liger.calls] == ["none", "none"] and all(c[2] for c in liger.calls)
    torch.testing.assert_close(fused["out"], unfused["out"])
    torch.testing.assert_close(fused["hidden_grad"], unfused["hidden_grad"])
    torch.testing.assert_close(fused["weight_grad"], unfused["weight_grad"])
    assert fused["hidden_grad"][S:].abs().sum() > 0  # the MTP depths did receive gradients
    assert len(fused["metrics"]) == 2
    for (layer_f, loss_f, correct_f, total_f), (layer_u, loss_u, correct_u, total_u) in zip(
            fused["metrics"], unfused["metrics"], strict=True):
        assert layer_f == layer_u
        torch.testing.assert_close(loss_f, loss_u)
        assert correct_f.item() == correct_u.item() and total_f.item() == total_u.item()


def _hybrid_forward(fused: bool, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """HybridModel.forward on the last pipeline stage (decoder input given, decoder an identity)."""
    from types import SimpleNamespace

    from megatron.core.models.hybrid.hybrid_model import HybridModel

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, fused_linear_cross_entropy=fused)
    output_layer = _OutputLayer(weight)
    output_layer.sequence_parallel = False
    model = SimpleNamespace(
        config=config, pre_process=False, post_process=True, mtp_process=False, position_embedding_type="none",
        decoder=lambda hidden_states, **kwargs: hidden_states, share_embeddings_and_output_weights=False,
        output_layer=output_layer, tp_group=None, _scale_logits=lambda logits: logits,
        compute_language_model_loss=lambda lab, logits: F.cross_entropy(logits.float().permute(1, 2, 0), lab, reduction="none"),
    )
    loss = HybridModel.forward(model, input_ids=None, position_ids=None, attention_mask=None, decoder_input=hidden,
                               labels=labels)
    return loss, output_layer.calls


def test_hybrid_forward_returns_the_fused_loss_without_logits(liger) -> None:
    hidden, weight, labels = _inputs()
    fused, fused_calls = _hybrid_forward(True, hidden, weight, labels)
    unfused, unfused_calls = _hybrid_forward(False, hidden, weight, labels)
    assert fused_calls == 0 and unfused_calls == 1 and len(liger.calls) == 1
    assert fused.shape == unfused.shape == (B, S)
    torch.testing.assert_close(fused, unfused)
