"""Megatron's DSA core attention with IndexCache: Shared DSA layers reuse a Full layer's top-k.

Megatron core_v0.19.0 has its own top-k sharing (`dsa_indexer_topk_freq`), but a skip layer there
has no indexer and raises when the source layer's top-k is missing, and the shared holder lives on
the attention mask (or the config, when there is none) across forward passes. NAM56R's plan is
explicit (`IndexCachePlan`: 3 Full + 6 Shared of the 9 DSA layers) and every DSA layer keeps its
indexer, so a Shared layer without a valid entry for this forward pass computes its own top-k and
says so once, instead of reusing a stale or wrong-shaped one.

Each forward the model calls `TopkCache.begin_forward()`. Full layers compute their top-k with the
holder on (Megatron's indexer, or the fused one with `DSAConfig.indexer="fused"` or `"fused-tilelang-loss"`,
`nam56r.model.dsa_fused_indexer`) and store it; Shared layers find the entry valid (same pass,
rows, batch, device) and run Megatron's skip branch with exactly that tensor.
"""

from __future__ import annotations

import logging

import torch
from nam56r_kernels.index_cache import IndexCachePlan, TopkCache

from nam56r.model.dsa_fused_indexer import FusedIndexerDSAttention

logger = logging.getLogger(__name__)


class IndexCacheDSAttention(FusedIndexerDSAttention):
    """DSAttention that consults `plan` and `cache`; with plan=None every layer computes its own top-k
    (through the indexer its `indexer` argument names, `FusedIndexerDSAttention`)."""

    def __init__(self, *args, plan: IndexCachePlan | None = None, cache: TopkCache | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.index_share:
            raise ValueError(
                "IndexCacheDSAttention replaces Megatron's dsa_indexer_topk_freq sharing; leave dsa_indexer_topk_freq at 1 "
                f"(got {self.config.dsa_indexer_topk_freq})"
            )
        if (plan is None) != (cache is None):
            raise ValueError("IndexCacheDSAttention needs both plan and cache, or neither")
        self.plan = plan
        self.cache = cache
        self._warned_recompute = False

    def forward(self, query, key, value, attention_mask, x, qr, *args, packed_seq_params=None, **kwargs):
        if self.plan is None:
            return super().forward(query, key, value, attention_mask, x, qr, *args, packed_seq_params=packed_seq_params, **kwargs)
        rows, batch = x.shape[0], x.shape[1]
        source = self.plan.source_of(self.layer_number)
        holder = self._get_index_share_topk_holder(packed_seq_params, attention_mask)
        length_holder = self._get_index_share_topk_length_holder(packed_seq_params, attention_mask)
        holder.clear()
        length_holder.clear()
        is_full = source == self.layer_number
        if not is_full:
            cached, reason = self.cache.lookup(source, rows=rows, batch=batch, device=x.device)
            if cached is None:
                if not self._warned_recompute:
                    logger.warning(
                        "IndexCache: DSA layer %d computes its own top-k (no valid cache from layer %d: %s)",
                        self.layer_number, source, reason,
                    )
                    self._warned_recompute = True
                is_full = True
            else:
                holder[source], length = cached
                if length is not None:
                    length_holder[source] = length
        self.index_share, self.skip_topk, self.source_layer = True, not is_full, source if not is_full else self.layer_number
        try:
            output = super().forward(query, key, value, attention_mask, x, qr, *args, packed_seq_params=packed_seq_params, **kwargs)
            if is_full and source == self.layer_number:
                self.cache.store(self.layer_number, holder[self.layer_number], length_holder.get(self.layer_number), rows=rows, batch=batch)
        finally:
            self.index_share, self.skip_topk, self.source_layer = False, False, self.layer_number
            holder.clear()
            length_holder.clear()
        return output


def topk_cache_for(model: torch.nn.Module) -> TopkCache | None:
    """The TopkCache shared by `model`'s DSA layers, or None when IndexCache is off."""
    caches = {id(m.cache): m.cache for m in model.modules() if isinstance(m, IndexCacheDSAttention) and m.cache is not None}
    if len(caches) > 1:
        raise RuntimeError(f"a model's DSA layers must share one TopkCache, found {len(caches)}")
    return next(iter(caches.values()), None)
