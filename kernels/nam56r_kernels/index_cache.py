"""IndexCache: which DSA layers compute the lightning indexer's top-k and which reuse it, and the
per-forward store that hands a Full layer's top-k to the Shared layers after it.

A Shared layer reuses a cached top-k only when the entry belongs to the current forward pass
(`TopkCache.begin_forward` starts one) and matches the Shared layer's rows, batch and device;
otherwise `lookup` returns no entry and the reason, which the Shared layer raises with (it has no
indexer of its own). It never reuses a stale or wrong-shaped entry.

Torch only: the Megatron attention that consults this lives in `nam56r.model.dsa_index_cache`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IndexCachePlan:
    """`sources[layer]` is the layer whose top-k `layer` uses: itself for a Full layer, the nearest
    preceding Full layer for a Shared one. Layer numbers are Megatron's (1-based, whole stack)."""

    sources: dict[int, int]

    @classmethod
    def build(cls, dsa_layer_numbers: Sequence[int], share_group: int) -> IndexCachePlan:
        """DSA ordinals 0, share_group, 2*share_group, ... are Full; each other layer is Shared with
        the nearest Full layer before it."""
        if share_group < 1:
            raise ValueError(f"share_group must be positive, got {share_group}")
        layers = list(dsa_layer_numbers)
        if layers != sorted(set(layers)) or (layers and layers[0] < 1):
            raise ValueError(f"DSA layer numbers must be increasing positive integers, got {layers}")
        sources: dict[int, int] = {}
        current_full = None
        for ordinal, layer in enumerate(layers):
            if ordinal % share_group == 0:
                current_full = layer
            sources[layer] = current_full
        return cls(sources=sources)

    def source_of(self, layer: int) -> int:
        if layer not in self.sources:
            raise KeyError(f"layer {layer} is not a DSA layer of this plan (DSA layers: {sorted(self.sources)})")
        return self.sources[layer]

    def is_full(self, layer: int) -> bool:
        return self.source_of(layer) == layer

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, source in self.sources.items() if layer == source)

    @property
    def shared_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, source in self.sources.items() if layer != source)


@dataclass
class _Entry:
    topk: torch.Tensor
    topk_length: torch.Tensor | None
    rows: int
    batch: int


class TopkCache:
    """The Full layers' top-k of the current forward pass, keyed by layer number."""

    def __init__(self) -> None:
        self.generation = 0
        self._entries: dict[int, _Entry] = {}

    def begin_forward(self) -> None:
        """Start a forward pass: entries of earlier passes become unusable (and are released)."""
        self.generation += 1
        self._entries.clear()

    def store(self, layer: int, topk: torch.Tensor, topk_length: torch.Tensor | None, *, rows: int, batch: int) -> None:
        if self.generation == 0:
            raise RuntimeError("TopkCache.store before begin_forward(): the model's forward must start each pass")
        self._entries[layer] = _Entry(topk, topk_length, rows, batch)

    def lookup(
        self, source: int, *, rows: int, batch: int, device: torch.device
    ) -> tuple[tuple[torch.Tensor, torch.Tensor | None] | None, str]:
        """(topk, topk_length) of `source` if valid for a layer with these rows/batch/device,
        else (None, why not)."""
        if self.generation == 0:
            return None, "no forward pass was started (TopkCache.begin_forward was never called)"
        entry = self._entries.get(source)
        if entry is None:
            return None, f"layer {source} stored no top-k in this forward pass (forward {self.generation})"
        if (entry.rows, entry.batch) != (rows, batch):
            return None, f"layer {source}'s top-k covers rows={entry.rows} batch={entry.batch}, this layer has rows={rows} batch={batch}"
        if entry.topk.device != device:
            return None, f"layer {source}'s top-k is on {entry.topk.device}, this layer runs on {device}"
        return (entry.topk, entry.topk_length), "ok"
