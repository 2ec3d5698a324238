"""DSA's indexer top-k and sparse indexer loss on the fused Triton top-k (`DSAConfig.indexer="fused"`).

Why: Megatron core_v0.19.0 (and Megatron-LM main, whose DSA files are the same) selects each query's top-k
keys from fp32 index scores over every key. Its naive path builds the [b, sq, sk] scores with autograd
bookkeeping in forward and again in backward (`FusedDSAIndexerLoss`); its TileLang path writes fp32 logits
for blocks of 8192 query rows x all keys, then runs `torch.topk` (`ops/tilelang_dsa.py`). Here the selection
is `nam56r_kernels.dsa_indexer.index_topk_fused` (fused scores, one sequence at a time, then an exact
per-query select), and the indexer loss reads only the selected pairs.

The loss, exactly (Megatron's `compute_dsa_indexer_loss` with `dsa_indexer_use_sparse_loss=True`). For query
row i of sequence b, let S = {j : j is one of its top-k indices, j >= 0} (causal by construction: the kernel
marks slots with no visible key -1) and

    s[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])                      index logits, with gradients
    T[i, j] = A[i, j] / sum_{j' in S} A[i, j'],
    A[i, j] = sum_heads softmax_{j in S}(softmax_scale * query[i, head] . key[j])      target, no gradient
    log P[i, j] = s[i, j] - logsumexp_{j' in S} s[i, j']
    loss = loss_coeff * sum_{b, i} sum_{j in S} T[i, j] (log T[i, j] - log P[i, j]) / (b * sq)

(per token: the sum, not divided, with calculate_per_token_loss). Megatron adds -inf outside the top-k to
both its attention and its index scores before either softmax, so neither a term of the loss nor either
normalizer reads a key outside S, and the gradient w.r.t. s, P - T on S, is zero elsewhere. The
differentiable index scores are therefore needed at the b * sq * topk selected pairs only: keys gathered at
the indices, plain torch, autograd (recomputed in backward, so the graph holds q, k, weights and the
indices, as Megatron's TileLang `IndexerFunction` does). No normalizer over all keys is involved. The dense
loss (`sparse_indexer_loss=False`) normalizes P over every causal key: its gradient is non-zero at every
key, which takes the full scores with gradients, so the fused path refuses it. The normalization, KL and
reduction are Megatron's own helpers (`dsa_masking`, `dsa_indexer_loss`), on [b, sq, topk] instead of
[b, sq, sk] masked tensors.

The attention side is Megatron's unchanged: `FusedIndexerDSAttention` hands the indices to DSAttention's
own branch for a layer whose top-k comes from elsewhere (the one its top-k sharing and IndexCache use),
which runs the sparse MLA on them; the indices are int32 [b, sq, topk] with -1 in empty slots, the layout
Megatron's TileLang indexer produces and both its sparse MLA paths read.

Two implementations of that loss, named by `DSAConfig.indexer`:

- ``"fused"``: the scores at the selected pairs in plain torch (keys gathered at the indices, autograd,
  recomputed in backward) and the target by chunks of query rows in fp32; runs under Triton's CPU interpreter
  too, which is how the CPU tests hold it to Megatron's naive loss.
- ``"fused-tilelang-loss"``: the selected pairs' scores are the ones the fused top-k kernel kept (no second
  pass), and the rest is Megatron's own TileLang kernels from its streaming sparse loss
  (`ops/tilelang_dsa.py`): the target (`sparse_indexer_target_interface`), the KL and its logits gradient
  (`SparseIndexerKLLoss`), and the indexer backward at the selected keys (`indexer_bwd_interface`, the
  backward of Megatron's `IndexerFunction`). What Megatron's path computes and this one does not is the fp32
  logits over every key and `torch.topk` over them. CUDA and bf16 only (the TileLang kernels' contract).

The fused paths cover what NAM56R trains: causal self-attention, absorbed MLA (one latent KV head),
tensor and context parallel 1, no packed sequences, CUDA tensors (or Triton's CPU interpreter for
``"fused"``). Anything else raises `FusedIndexerUnsupported` naming it; nothing falls back to Megatron's
indexer silently.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant import dsa_indexer_loss, dsa_masking
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossAutoScaler,
    DSAIndexerLossLoggingHelper,
    DSAttention,
)
from megatron.core.utils import get_pg_size
from nam56r_kernels.dsa_indexer import index_topk_fused
from nam56r_kernels.triton_support import require_cuda_or_interpreter
from torch.utils.checkpoint import checkpoint

from nam56r.model.config import DSA_INDEXER_PATHS, DSAIndexerPath

# Every path but Megatron's selects with the fused top-k.
FUSED_SELECTION_PATHS: tuple[str, ...] = tuple(path for path in DSA_INDEXER_PATHS if path != "megatron")
# Query rows per chunk of the target: bounds its gathered keys and [b, rows, heads, topk] logits (fp32).
TARGET_ROW_CHUNK = 1024


class FusedIndexerUnsupported(RuntimeError):
    """The fused indexer path cannot run this layer call; the message names what it lacks."""


def select_topk_scored(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                       use_relu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scores, int32 indices) [b, sq, min(topk, sk)] of the causal top-k, without gradients: -inf and -1 in
    slots with no visible key.

    q [sq, b, H, D], k [sk, b, D], weights [sq, b, H] (Megatron's indexer layouts)."""
    where = "the fused DSA top-k (DSAConfig.indexer='fused' or 'fused-tilelang-loss')"
    require_cuda_or_interpreter(q, where, "DSAConfig.indexer='megatron'")
    with torch.no_grad():
        return index_topk_fused(q.detach(), k.detach(), weights.detach(), topk, use_relu=use_relu, causal=True)


def index_scores_at(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, *, use_relu: bool) -> torch.Tensor:
    """fp32 [b, sq, topk]: sum_h weights[i, b, h] * act(q[i, b, h] . k[indices[b, i, t], b]), differentiable
    w.r.t. q, k and weights. Slots with index -1 read key 0; the caller masks them. Computed in fp32, as
    Megatron's `_compute_index_scores` is: the q . k GEMM's operands are bf16 in training, exact even where fp32
    matmuls run as TF32, and the weighted sum over heads is elementwise, never rounded to TF32."""
    sq, batch, _, dim = q.shape
    if indices.shape[:2] != (batch, sq):
        raise ValueError(f"indices must be [b={batch}, sq={sq}, topk], got {tuple(indices.shape)}")
    sk, topk = k.shape[0], indices.shape[-1]
    # Row b * sk + j of the flattened keys is key j of sequence b.
    flat = indices.clamp(min=0).long() + torch.arange(batch, device=k.device).view(batch, 1, 1) * sk
    keys = k.transpose(0, 1).reshape(batch * sk, dim).index_select(0, flat.view(-1)).view(batch, sq, topk, dim)
    per_head = torch.matmul(q.transpose(0, 1).float(), keys.float().transpose(-1, -2))  # [b, sq, H, topk]
    if use_relu:
        per_head = torch.relu(per_head)
    return (per_head * weights.transpose(0, 1).float().unsqueeze(-1)).sum(dim=-2)


@torch.no_grad()
def sparse_attention_target(query: torch.Tensor, key: torch.Tensor, indices: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """T: fp32 [b, sq, topk], the attention heads' softmax over each row's top-k keys, summed over heads and
    L1-normalized per row (0 in slots with index -1). query [sq, b, heads, d]; key [sk, b, 1, d], absorbed
    MLA's one latent KV head."""
    sq, batch, _, dim = query.shape
    sk, topk = key.shape[0], indices.shape[-1]
    valid = indices >= 0
    flat = indices.clamp(min=0).long() + torch.arange(batch, device=key.device).view(batch, 1, 1) * sk
    flat_keys = key[:, :, 0].transpose(0, 1).reshape(batch * sk, dim)
    target = torch.empty(batch, sq, topk, dtype=torch.float32, device=query.device)
    for start in range(0, sq, TARGET_ROW_CHUNK):
        rows = slice(start, min(start + TARGET_ROW_CHUNK, sq))
        keys = flat_keys.index_select(0, flat[:, rows].reshape(-1)).view(batch, -1, topk, dim).float()
        logits = torch.matmul(query[rows].transpose(0, 1).float(), keys.transpose(-1, -2)) * softmax_scale  # [b, rows, heads, topk]
        row_valid = valid[:, rows].unsqueeze(2).expand_as(logits)
        target[:, rows] = dsa_masking.masked_softmax(logits, row_valid, dim=-1).sum(dim=2)
    return dsa_indexer_loss.normalize_indexer_target(target)


def sparse_indexer_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    softmax_scale: float,
    loss_coeff: float,
    use_relu: bool,
    calculate_per_token_loss: bool,
) -> torch.Tensor:
    """The sparse indexer KL loss (the module docstring's formula), a scalar differentiable w.r.t. q, k and
    weights only; query and key are the attention's, read without gradients."""
    target = sparse_attention_target(query.detach(), key.detach(), indices, softmax_scale)
    scores = checkpoint(index_scores_at, q, k, weights, indices, use_relu=use_relu, use_reentrant=False)
    valid = indices >= 0
    log_probs = dsa_masking.masked_log_softmax(scores, valid, dim=-1)
    return dsa_indexer_loss.indexer_loss_from_target(
        target, log_probs, loss_coeff, calculate_per_token_loss=calculate_per_token_loss, valid_mask=valid
    )


class _SelectedIndexScores(torch.autograd.Function):
    """One sequence's index scores at its selected keys: the values the fused top-k kept, differentiable
    w.r.t. q [sq, H, D], k [sk, D] and weights [sq, H] (fp32) through Megatron's TileLang indexer backward at
    `indices` [sq, topk] (int32, -1 in empty slots), as in the backward of Megatron's `IndexerFunction`."""

    @staticmethod
    def forward(ctx, q, k, weights, indices, scores, use_relu):
        ctx.save_for_backward(q, k, weights, indices)
        ctx.use_relu = use_relu
        return scores.clone()

    @staticmethod
    def backward(ctx, grad_scores):
        from megatron.core.transformer.experimental_attention_variant.ops.tilelang_indexer_bwd import indexer_bwd_interface

        q, k, weights, indices = ctx.saved_tensors
        grad_q, grad_weights, grad_k = indexer_bwd_interface(q, weights, k, indices, grad_scores.contiguous(), use_relu=ctx.use_relu)
        return grad_q, grad_k, grad_weights, None, None, None


def tilelang_kernel_problems(q: torch.Tensor, k: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> list[str]:
    """What keeps Megatron's TileLang sparse-loss kernels from these tensors (CUDA, bf16 indexer q/k and
    attention query/key); [] when they take them."""
    problems = [f"{name} on {t.device}" for name, t in (("q", q), ("query", query)) if t.device.type != "cuda"]
    problems += [f"{name} in {t.dtype}" for name, t in (("q", q), ("k", k), ("query", query), ("key", key)) if t.dtype != torch.bfloat16]
    return problems


def sparse_indexer_loss_tilelang(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    scores: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    softmax_scale: float,
    loss_coeff: float,
    use_relu: bool,
    calculate_per_token_loss: bool,
) -> torch.Tensor:
    """`sparse_indexer_loss` on Megatron's TileLang kernels, one sequence at a time: the target over the selected
    keys, the KL with its logits gradient, and the indexer backward, with the fused top-k's `scores` [b, sq, topk]
    (fp32, -inf in empty slots) as the index logits. A scalar differentiable w.r.t. q, k and weights only."""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_indexer_loss import (
        SparseIndexerKLLoss,
        sparse_indexer_target_interface,
    )

    sq, batch = q.shape[:2]
    valid = indices >= 0
    kl_sum = torch.zeros((), dtype=torch.float32, device=q.device)
    for bi in range(batch):
        logits = _SelectedIndexScores.apply(q[:, bi].contiguous(), k[:, bi].contiguous(), weights[:, bi].float().contiguous(),
                                            indices[bi].contiguous(), scores[bi], use_relu)
        with torch.no_grad():
            target = sparse_indexer_target_interface(query[:, bi].detach().contiguous(), key[:, bi, 0].detach().contiguous(),
                                                     indices[bi].contiguous(), softmax_scale)
        kl_sum = kl_sum + SparseIndexerKLLoss.apply(target, logits, valid[bi].contiguous())
    kl = dsa_indexer_loss.reduce_indexer_kl_sum(kl_sum, num_rows=batch * sq, calculate_per_token_loss=calculate_per_token_loss,
                                                valid_row_count=None)
    return kl * loss_coeff


class FusedIndexerDSAttention(DSAttention):
    """Megatron's DSAttention whose top-k computing layers select with the fused kernel and train their
    indexer with the sparse loss on the selected pairs, in torch (`indexer="fused"`) or on Megatron's TileLang
    loss kernels (`"fused-tilelang-loss"`); with `indexer="megatron"` it is Megatron's DSAttention. Layers that
    reuse another layer's top-k run Megatron's code on every path."""

    def __init__(self, *args, indexer: DSAIndexerPath = "megatron", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if indexer not in DSA_INDEXER_PATHS:
            raise ValueError(f"indexer must be one of {DSA_INDEXER_PATHS}, got {indexer!r}")
        trains_indexer = (self.config.dsa_indexer_loss_coeff or 0.0) > 0
        if indexer in FUSED_SELECTION_PATHS and trains_indexer and not self.config.dsa_indexer_use_sparse_loss:
            raise ValueError(
                f"the fused DSA indexer ({indexer!r}) trains with the sparse indexer loss only (dsa_indexer_use_sparse_loss=True): "
                "the dense loss normalizes over every causal key and needs the full index scores with gradients; set "
                "DSAConfig.sparse_indexer_loss=True or DSAConfig.indexer='megatron'"
            )
        self.indexer_path: DSAIndexerPath = indexer

    def forward(self, query, key, value, attention_mask, x, qr, position_ids=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, up_v_weight=None):
        call = dict(position_ids=position_ids, attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                    packed_seq_params=packed_seq_params, up_v_weight=up_v_weight)
        if self.indexer_path == "megatron" or self.skip_topk:
            return super().forward(query, key, value, attention_mask, x, qr, **call)
        self._check_fused_call(query, key, value, attn_mask_type, packed_seq_params)
        loss_coeff = self.config.dsa_indexer_loss_coeff or 0.0
        use_loss = self.training and torch.is_grad_enabled() and loss_coeff > 0
        # Megatron detaches x and qr: the indexer loss trains the indexer only.
        with torch.enable_grad() if use_loss else torch.no_grad():
            q, k, weights = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
        use_relu = self.config.dsa_indexer_scoring_relu
        tilelang_loss = use_loss and self.indexer_path == "fused-tilelang-loss"
        if tilelang_loss and (problems := tilelang_kernel_problems(q, k, query, key)):
            raise FusedIndexerUnsupported(
                f"{self._where()} does not support {', '.join(problems)}: Megatron's TileLang sparse-loss kernels take CUDA "
                "bf16 tensors; set DSAConfig.indexer='fused' (the loss in torch) or 'megatron'"
            )
        scores, indices = select_topk_scored(q, k, weights, self.index_topk, use_relu=use_relu)
        loss = None
        options = dict(softmax_scale=self.softmax_scale, loss_coeff=loss_coeff, use_relu=use_relu,
                       calculate_per_token_loss=self.config.calculate_per_token_loss)
        if tilelang_loss:
            loss = sparse_indexer_loss_tilelang(q, k, weights, indices, scores, query, key, **options)
        elif use_loss:
            loss = sparse_indexer_loss(q, k, weights, indices, query, key, **options)
        output = self._attend_with_topk(indices, query, key, value, attention_mask, x, qr, call)
        if loss is not None:
            DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss=loss, layer_number=self.layer_number, num_layers=self.config.num_layers)
            output = DSAIndexerLossAutoScaler.apply(output, loss)
        return output

    def _where(self) -> str:
        return f"the fused DSA indexer (DSAConfig.indexer={self.indexer_path!r}, layer {self.layer_number})"

    def _attend_with_topk(self, indices, query, key, value, attention_mask, x, qr, call: dict) -> torch.Tensor:
        """Megatron's DSAttention on `indices`: its branch for a layer that reuses a top-k, with this layer as
        the source. The entry stays in the holder when sharing is on (IndexCache or Megatron's own sharing
        reads it after this layer); otherwise it is removed."""
        holder = self._get_index_share_topk_holder(call["packed_seq_params"], attention_mask)
        saved = (self.index_share, self.skip_topk, self.source_layer)
        holder[self.layer_number] = indices
        self.index_share, self.skip_topk, self.source_layer = True, True, self.layer_number
        try:
            return super().forward(query, key, value, attention_mask, x, qr, **call)
        finally:
            self.index_share, self.skip_topk, self.source_layer = saved
            if not self.index_share:
                holder.pop(self.layer_number, None)

    def _check_fused_call(self, query, key, value, attn_mask_type, packed_seq_params) -> None:
        where = self._where()
        problems = []
        if packed_seq_params is not None:
            problems.append(f"packed sequences (packed_seq_params, qkv_format={getattr(packed_seq_params, 'qkv_format', None)!r})")
        if attn_mask_type != AttnMaskType.causal:
            problems.append(f"attention mask type {attn_mask_type} (causal self-attention only)")
        for group in ("tp", "cp"):
            size = get_pg_size(getattr(self.pg_collection, group, None))
            if size > 1:
                problems.append(f"{group} size {size} (it runs at tensor and context parallel 1, NAM56R's only ones)")
        if value is not None or key.ndim != 4 or key.size(2) != 1:
            problems.append(f"a key of shape {tuple(key.shape)} with value {'given' if value is not None else 'None'} "
                            "(absorbed MLA only: one latent KV head, value None)")
        elif query.size(0) != key.size(0):
            problems.append(f"query rows {query.size(0)} != key rows {key.size(0)} (causal self-attention)")
        if problems:
            raise FusedIndexerUnsupported(f"{where} does not support " + "; ".join(problems) + "; set DSAConfig.indexer='megatron'")
