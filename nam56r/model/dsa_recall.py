"""Recall of a DSA layer's indexer: how many of dense attention's top-k keys its own top-k finds.

For one DSA layer on the inputs of one forward, with k the layer's configured top-k
(`config.dsa_indexer_topk`, never the dense warm-up's widened `index_topk`):

    recall@k = mean over query rows i of |topk(s[i], k) & topk(A[i], k)| / min(k, keys visible to i)

    s[i, j] = sum_h w[i, h] * act(q[i, h] . k[j])                                the indexer's scores
    A[i, j] = sum_heads softmax_{j <= i}(softmax_scale * query[i, head] . key[j])  dense attention

both over the causal keys j <= i only. A is the target of Megatron's `compute_dsa_indexer_loss` before its
L1 normalization (a per-row positive scale, so the same top-k). A row that sees no more than k keys keeps
all of them in both sets: its recall is 1 by definition.

`RecallHook` measures it on a layer's real inputs: a forward pre-hook on the DSAttention module (ours,
`FusedIndexerDSAttention`, for either indexer path) that reads the call's query, key, x and qr, recomputes
the indexer's q, k and weights with the layer's own `indexer.forward_before_topk` (deterministic, no state),
and computes both score matrices in fp32 under no_grad, a block of query rows at a time. It changes nothing
the forward computes and removes itself after firing once (so a recompute in the backward does not fire it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
from megatron.core.utils import get_pg_size

# fp32 elements of one [rows, heads, keys] block of scores: 64 Mi (256 MiB), whatever the sequence length.
BLOCK_ELEMENTS = 1 << 26
_FORWARD = inspect.signature(DSAttention.forward)


class RecallUnsupported(RuntimeError):
    """The recall probe cannot measure this layer call; the message names what it lacks."""


@dataclass(frozen=True)
class RecallSample:
    """The per-row recalls of one measurement, summed, and how many query rows they are over."""

    recall_sum: float
    rows: int
    topk: int

    @property
    def recall(self) -> float:
        return self.recall_sum / self.rows


def index_scores_rows(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, rows: slice, *, use_relu: bool) -> torch.Tensor:
    """fp32 [R, sk] indexer scores of query rows `rows` of one sequence (Megatron's `_compute_index_scores`).
    q [sq, H, D], k [sk, D], weights [sq, H]."""
    per_head = torch.matmul(q[rows].float(), k.float().t())  # [R, H, sk]
    if use_relu:
        per_head = per_head.relu()
    return (per_head * weights[rows].float().unsqueeze(-1)).sum(dim=1)


def attention_target_rows(query: torch.Tensor, key: torch.Tensor, rows: slice, softmax_scale: float) -> torch.Tensor:
    """fp32 [R, sk]: dense causal attention of query rows `rows` of one sequence, softmax over the visible keys
    summed over heads. query [sq, heads, d]; key [sk, heads or 1, d] (absorbed MLA: one latent head)."""
    logits = torch.matmul(query[rows].float().transpose(0, 1), key.float().permute(1, 2, 0)) * softmax_scale  # [heads, R, sk]
    visible = causal_visibility(rows, key.shape[0], query.device)
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).sum(dim=0)


def causal_visibility(rows: slice, keys: int, device: torch.device) -> torch.Tensor:
    """bool [R, keys]: key j is visible to query row i iff j <= i."""
    return torch.arange(keys, device=device) <= torch.arange(rows.start, rows.stop, device=device).unsqueeze(1)


def row_recalls(index_scores: torch.Tensor, target: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """fp32 [R]: per row, |top-k of index_scores & top-k of target| / min(topk, visible keys), over visible keys."""
    width = min(topk, index_scores.shape[-1])
    hits = visible.clone()
    for scores in (index_scores, target):
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, scores.masked_fill(~visible, float("-inf")).topk(width, dim=-1).indices, True)
        hits &= chosen  # slots a row fills past its visible keys point at masked keys: dropped here
    return hits.sum(-1).float() / visible.sum(-1).clamp(max=topk).float()


@torch.no_grad()
def indexer_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    topk: int,
    softmax_scale: float,
    use_relu: bool,
    block_elements: int = BLOCK_ELEMENTS,
) -> RecallSample:
    """recall@topk (the module docstring) over every query row of every sequence. Megatron's layouts: q
    [sq, b, H, D], k [sk, b, D], weights [sq, b, H], query [sq, b, heads, d], key [sk, b, heads or 1, d]."""
    sq, batch, heads = query.shape[0], query.shape[1], query.shape[2]
    sk = key.shape[0]
    if key.shape[2] not in (1, heads):
        raise RecallUnsupported(f"a key of {key.shape[2]} heads for a query of {heads} (one latent head, or one per query head)")
    rows_per_block = max(1, block_elements // (max(heads, q.shape[2]) * sk))
    total = torch.zeros((), dtype=torch.float64, device=query.device)
    for b in range(batch):
        for start in range(0, sq, rows_per_block):
            rows = slice(start, min(start + rows_per_block, sq))
            scores = index_scores_rows(q[:, b], k[:, b], weights[:, b], rows, use_relu=use_relu)
            target = attention_target_rows(query[:, b], key[:, b], rows, softmax_scale)
            total += row_recalls(scores, target, causal_visibility(rows, sk, query.device), topk).double().sum()
    return RecallSample(recall_sum=float(total), rows=sq * batch, topk=topk)


def check_recall_call(layer: DSAttention, query, key, attention_mask, attn_mask_type, packed_seq_params) -> None:
    """Raise RecallUnsupported naming each thing of this call the probe does not measure."""
    problems = []
    if layer.indexer is None:
        problems.append("a layer without its own indexer (one that reuses another layer's top-k)")
    if packed_seq_params is not None:
        problems.append("packed sequences (packed_seq_params)")
    if attn_mask_type != AttnMaskType.causal:
        problems.append(f"attention mask type {attn_mask_type} (causal self-attention only)")
    if attention_mask is not None:
        problems.append("an explicit attention mask (the causal mask is built from the positions)")
    for group in ("tp", "cp"):
        if (size := get_pg_size(getattr(layer.pg_collection, group, None))) > 1:
            problems.append(f"{group} size {size} (rows and heads must all be on this rank)")
    if query.ndim != 4 or key.ndim != 4 or query.shape[0] != key.shape[0]:
        problems.append(f"query {tuple(query.shape)} and key {tuple(key.shape)} (causal self-attention, [s, b, heads, d] both)")
    if problems:
        raise RecallUnsupported(f"the indexer recall probe (DSA layer {layer.layer_number}) does not support " + "; ".join(problems))


@torch.no_grad()
def layer_recall(layer: DSAttention, call: dict) -> RecallSample:
    """recall@k of `layer` on the arguments of one of its forward calls (`call`: DSAttention.forward's, by name)."""
    query, key = call["query"], call["key"]
    check_recall_call(layer, query, key, call["attention_mask"], call.get("attn_mask_type"), call.get("packed_seq_params"))
    q, k, weights = layer.indexer.forward_before_topk(call["x"].detach(), call["qr"].detach(), None)
    return indexer_recall(q, k, weights, query.detach(), key.detach(), topk=layer.config.dsa_indexer_topk,
                          softmax_scale=layer.softmax_scale, use_relu=layer.config.dsa_indexer_scoring_relu)


class RecallHook:
    """Measures `layer`'s recall on its next forward call, once: `sample` is set when it has fired."""

    def __init__(self, layer: DSAttention) -> None:
        self.layer = layer
        self.sample: RecallSample | None = None
        self._handle = layer.register_forward_pre_hook(self._fire, with_kwargs=True)

    def _fire(self, module: DSAttention, args: tuple, kwargs: dict) -> None:
        self._handle.remove()
        bound = _FORWARD.bind(module, *args, **kwargs)
        bound.apply_defaults()
        self.sample = layer_recall(module, bound.arguments)

    def cancel(self) -> None:
        self._handle.remove()
