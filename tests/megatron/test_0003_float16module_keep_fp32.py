"""Patch megatron-lm 0003: Float16Module leaves parameters marked `keep_fp32` in fp32, values intact."""

from __future__ import annotations

import pytest
import torch

module_mod = pytest.importorskip("megatron.core.transformer.module")
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

MODULE_PATH = "megatron/core/transformer/module.py"


class _Mixer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)
        # Values that bf16 cannot hold exactly: a bf16 round trip would change them.
        self.D = torch.nn.Parameter(torch.full((4,), 1.0 + 2.0**-12))
        self.D.keep_fp32 = True
        self.dt_bias = torch.nn.Parameter(torch.linspace(-3.0, 3.0, 4) + 2.0**-15)
        self.dt_bias.keep_fp32 = True
        self.register_buffer("table", torch.ones(3))


def _config(**precision: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, **precision)


@pytest.mark.parametrize("precision,low", [({"bf16": True}, torch.bfloat16), ({"fp16": True}, torch.float16)])
def test_marked_parameters_stay_fp32_with_their_values(precision, low) -> None:
    mixer = _Mixer()
    d_before, dt_before = mixer.D.detach().clone(), mixer.dt_bias.detach().clone()
    wrapped = module_mod.Float16Module(_config(**precision), mixer)
    inner = wrapped.module
    assert inner.proj.weight.dtype == low
    assert inner.table.dtype == low
    assert inner.D.dtype == torch.float32 and inner.dt_bias.dtype == torch.float32
    assert torch.equal(inner.D.detach(), d_before) and torch.equal(inner.dt_bias.detach(), dt_before)
    assert inner.D is mixer.D  # the same Parameter object: optimizers and hooks see one tensor


def test_marked_parameter_must_be_created_fp32() -> None:
    mixer = _Mixer()
    mixer.D.data = mixer.D.data.to(torch.bfloat16)
    with pytest.raises(TypeError, match="keep_fp32"):
        module_mod.Float16Module(_config(bf16=True), mixer)


def test_pinned_release_casts_every_parameter(pinned_release) -> None:
    """The bug: the pinned release's Float16Module casts marked parameters to bf16 as well."""
    base_float16_module = pinned_release.definition(module_mod, MODULE_PATH, "Float16Module")
    wrapped = base_float16_module(_config(bf16=True), _Mixer())
    assert wrapped.module.D.dtype == torch.bfloat16
    assert wrapped.module.D.detach().float().ne(1.0 + 2.0**-12).all()  # the fp32 value is lost
