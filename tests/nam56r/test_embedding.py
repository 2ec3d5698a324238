"""Which projection the n-gram hash embedding runs (NgramHashConfig.kernel): the reference unless the config
names the fused kernel, and the fused kernel only on CUDA tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nam56r.model.embedding
from nam56r.model.config import ModelConfig, NgramHashConfig
from nam56r.model.embedding import NgramHashEmbedding
from nam56r.model.presets import PRESETS, get_preset


class _OnCuda(torch.Tensor):
    """CPU token ids that report CUDA, so the path choice is seen without a GPU."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("kernel", "cuda", "taken"),
    [("reference", True, "reference"), ("fused", True, "fused"), ("fused", False, "reference"), ("reference", False, "reference")],
)
def test_the_projection_follows_the_config(kernel: str, cuda: bool, taken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    for name in ("reference", "fused"):
        monkeypatch.setattr(nam56r.model.embedding, f"ngram_hash_project_{name}",
                            lambda ids, *rest, name=name: calls.append(name) or torch.zeros(*ids.shape, 4))
    embedding = NgramHashEmbedding(NgramHashConfig(heads=2, table_size=16, embed_dim=2, kernel=kernel), 4,
                                   params_dtype=torch.float32, init_std=0.02)
    ids = torch.randint(0, 100, (1, 5))
    embedding(ids.as_subclass(_OnCuda) if cuda else ids)
    assert calls == [taken]


def test_every_preset_takes_the_reference_and_the_choice_survives_the_config_file() -> None:
    assert {name: get_preset(name).ngram.kernel for name in PRESETS} == dict.fromkeys(PRESETS, "reference")
    fused = dataclasses.replace(get_preset("nam56r-tiny"), ngram=dataclasses.replace(get_preset("nam56r-tiny").ngram, kernel="fused"))
    assert ModelConfig.from_dict(fused.to_dict()).ngram.kernel == "fused"
    with pytest.raises(ValueError, match="ngram.kernel 'triton' must be 'reference' or 'fused'"):
        dataclasses.replace(fused, ngram=dataclasses.replace(fused.ngram, kernel="triton")).validate()
