"""Megatron's DSA core attention with IndexCache: Shared DSA layers reuse a Full layer's top-k.

Megatron core_v0.19.0 has its own top-k sharing (`dsa_indexer_topk_freq`), but only at a fixed
stride of layer numbers, and its shared holder lives on the attention mask (or the config, when there
is none) across forward passes. NAM56R's plan is explicit (`IndexCachePlan`: 3 Full + 6 Shared of the
9 DSA layers), and the cache is checked on every read: a Shared layer without a valid entry for this
forward pass raises with the reason, instead of reusing a stale or wrong-shaped one.

A Shared layer has no indexer, as Megatron's skip layers have none. Parameters that no step trains would
hold optimizer state and be weight-decayed for nothing, and they break Megatron's --overlap-grad-reduce:
it issues a bucket's reduce-scatter once every parameter in the bucket has reported a gradient, and
asserts at the next step's start that the first step saw one for each.

Each forward the model calls `TopkCache.begin_forward()`. Full layers compute their top-k with the
holder on (Megatron's indexer, or the fused one with `DSAConfig.indexer="fused"` or `"fused-tilelang-loss"`,
`nam56r.model.dsa_fused_indexer`) and store it; Shared layers find the entry valid (same pass,
rows, batch, device) and run Megatron's skip branch with exactly that tensor.
"""

from __future__ import annotations

import torch
from nam56r_kernels.index_cache import IndexCachePlan, TopkCache

from nam56r.model.dsa_fused_indexer import FusedIndexerDSAttention


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
        if plan is not None and not plan.is_full(self.layer_number):
            # Megatron's constructor built it (its own sharing is off); this layer never runs it.
            self.indexer = None

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
                raise RuntimeError(
                    f"IndexCache: Shared DSA layer {self.layer_number} has no indexer and needs the top-k of Full layer {source} "
                    f"from this forward pass, but {reason}. Run the model's layers in order within one forward (the model "
                    "calls TopkCache.begin_forward() at its start), or build the model with IndexCache off (--index-cache off)"
                )
            holder[source], length = cached
            if length is not None:
                length_holder[source] = length
        self.index_share, self.skip_topk, self.source_layer = True, not is_full, source
        try:
            output = super().forward(query, key, value, attention_mask, x, qr, *args, packed_seq_params=packed_seq_params, **kwargs)
            if is_full:
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
