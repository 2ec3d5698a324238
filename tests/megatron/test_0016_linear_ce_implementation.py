"""Patch megatron-lm 0016: fused_linear_cross_entropy calls the implementation that
TransformerConfig.fused_linear_cross_entropy_impl names ("module:function") with the loss mask that will
weight each token; with NAM56R's chunked linear CE (nam56r.model.linear_cross_entropy, the real Triton
kernel under Triton's CPU interpreter) the real HybridModel.forward and process_mtp_loss give the unfused
path's losses, gradients and MTP metrics."""

from __future__ import annotations

import textwrap

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

INTERPRETER_SCRIPT = textwrap.dedent(
    """
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nam56r.model.linear_cross_entropy import CHUNKED_LINEAR_CE

    S, B, H, V, DEPTHS = 12, 3, 16, 40, 2
    metrics = []
    mtp.MTPLossLoggingHelper.save_metrics_to_tracker = staticmethod(
        lambda loss, correct, total, layer, *a, **k: metrics.append((layer, float(loss), int(correct), int(total))))
    mtp.parallel_state.get_data_parallel_group = lambda **kwargs: None


    def ce(labels, logits):
        return F.cross_entropy(logits.float().permute(1, 2, 0), labels, reduction="none")


    class OutputLayer:
        sequence_parallel = False

        def __init__(self, weight):
            self.weight = weight

        def __call__(self, hidden, weight=None, runtime_gather_output=None):
            return hidden @ (self.weight if weight is None else weight).T, None


    def config(fused):
        return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, mtp_num_layers=DEPTHS,
                                 fused_linear_cross_entropy=fused, fused_linear_cross_entropy_impl=CHUNKED_LINEAR_CE)


    def inputs():
        g = torch.Generator().manual_seed(3)
        hidden = torch.randn((1 + DEPTHS) * S, B, H, generator=g, requires_grad=True)
        weight = (torch.randn(V, H, generator=g) / 4).requires_grad_(True)
        labels = torch.randint(0, V, (B, S), generator=g)
        loss_mask = (torch.rand(B, S, generator=g) > 0.2).float()
        return hidden, weight, labels, loss_mask


    def mtp_run(fused):
        metrics.clear()
        hidden, weight, labels, loss_mask = inputs()
        out = mtp.process_mtp_loss(hidden_states=hidden, labels=labels, loss_mask=loss_mask, output_layer=OutputLayer(weight),
                                   output_weight=None, runtime_gather_output=None, is_training=True,
                                   compute_language_model_loss=ce, config=config(fused))
        out.sum().backward()
        return out.detach(), hidden.grad, weight.grad, list(metrics)


    def head_run(fused, pass_mask=True):
        hidden, weight, labels, loss_mask = inputs()
        hidden = hidden[:S].detach().requires_grad_()
        model = SimpleNamespace(config=config(fused), pre_process=False, post_process=True, mtp_process=False,
                                position_embedding_type="none", decoder=lambda hidden_states, **kwargs: hidden_states,
                                share_embeddings_and_output_weights=False, output_layer=OutputLayer(weight), tp_group=None,
                                _scale_logits=lambda logits: logits, compute_language_model_loss=ce)
        loss = HybridModel.forward(model, input_ids=None, position_ids=None, attention_mask=None, decoder_input=hidden,
                                   labels=labels, loss_mask=loss_mask if pass_mask else None)
        (loss * loss_mask).sum().div(loss_mask.sum()).backward()  # the pretrain loss: masked tokens, one scale
        return loss.detach(), hidden.grad, weight.grad


    for name, fused, unfused in (("mtp", mtp_run(True), mtp_run(False)), ("head", head_run(True), head_run(False))):
        for got, want in zip(fused, unfused, strict=True):
            if isinstance(want, list):
                assert [m[0] for m in got] == [m[0] for m in want] and [m[2:] for m in got] == [m[2:] for m in want], (got, want)
                torch.testing.assert_close(torch.tensor([m[1] for m in got]), torch.tensor([m[1] for m in want]))
            else:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        print("matches unfused", name)

    try:
        head_run(True, pass_mask=False)
    except RuntimeError as exc:
        assert "must be c * loss_weight" in str(exc), exc
        print("unpassed mask refused")
    """
)


def test_the_chunked_implementation_matches_the_unfused_heads_under_the_triton_interpreter(run_interpreted, megatron_built) -> None:
    stdout = run_interpreted(INTERPRETER_SCRIPT, timeout=600)
    assert "matches unfused mtp" in stdout and "matches unfused head" in stdout and "unpassed mask refused" in stdout, stdout


@pytest.mark.parametrize("name", ["chunked", "nam56r.model.linear_cross_entropy"])
def test_the_config_refuses_a_name_that_is_not_module_function(name: str) -> None:
    with pytest.raises(ValueError, match="must be 'liger' or 'module:function'"):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, fused_linear_cross_entropy=True,
                          fused_linear_cross_entropy_impl=name)


def test_an_implementation_that_does_not_import_is_named() -> None:
    import torch
    from megatron.core.fusions.fused_linear_cross_entropy import fused_linear_cross_entropy

    with pytest.raises(ImportError, match="'nam56r.no_such_module:f' cannot be imported"):
        fused_linear_cross_entropy(torch.zeros(2, 1, 4), torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.long),
                                   implementation="nam56r.no_such_module:f")
