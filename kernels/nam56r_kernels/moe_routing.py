"""The MoE router's sigmoid top-k routing, sequence-level aux loss and expert-load count in three Triton launches.

Why: Megatron's unfused ``TopKRouter.routing`` with a sigmoid score function, an expert bias and the "seq_aux_loss"
launches about 60 small kernels a step, forward and backward together (63 on an H200 at NAM56R's router shape:
sigmoid, top-k, gather, scatter, sums, the aux loss's second top-k and its reshapes, the load count). Each costs the
host a launch while the GPU, which finishes each one in microseconds, waits. Here the forward is one pass over the
logits plus one single-program reduction, and the backward is one pass; nothing synchronizes with the host and nothing
is atomic, so a run repeats bit for bit.

Contract (both implementations, ``sigmoid_topk_routing`` and ``sigmoid_topk_routing_reference``):

- ``logits``: fp32 [T, E], 1 <= E <= 256, T = S * B tokens in Megatron's [S, B] order flattened (token t = s * B + b),
  B = ``seq_aux_batch`` (the micro batch). ``expert_bias``: fp32 [E] or None, on the logits' device.
- Scores s = sigmoid(logits). Each token selects the ``topk`` largest s + bias (s without a bias). ``probs`` (fp32
  [T, E]) is zero except at the selected experts, where it is s / (the selected s summed + 1e-20) for topk > 1 and s for
  topk == 1, times ``scaling_factor`` where it is truthy: Megatron's ``topk_routing_with_score_function`` with
  score_function="sigmoid". ``routing_map`` (bool [T, E]) is True at the selected experts.
- ``aux_loss``: None where ``seq_aux_coeff`` is 0; else the 0-d fp32 sequence-level loss of ``_apply_seq_aux_loss`` at
  tensor/context parallel size 1 (one rank): with q = s / (s summed over all experts + 1e-20) and the aux selection the
  ``topk`` largest q (no bias), F[b, e] counts the positions s whose token s * B + b aux-selects e, P[b, e] sums q over
  them, and aux_loss = sum(P * F) * E * coeff / (topk * S * S) / B. The caller attaches it to probs (Megatron's
  ``MoEAuxLossAutoScaler``) and applies Megatron's per-token-loss or MTP scaling, if any.
- ``tokens_per_expert``: int64 [E], the routing map's column sums (what ``_apply_expert_bias`` adds to
  ``local_tokens_per_expert``).
- Differentiable in logits through probs and aux_loss; the selections and counts are constants of the backward, as in
  Megatron. Either incoming gradient may be absent.
- Ties: of equal keys the lower expert index is selected (torch.topk leaves the order unspecified). The aux selection
  ranks by s, which orders q the same way: q is s over one positive number per token, and fp32 division by it is
  monotone; where rounding makes two q equal, the larger s is selected, one of the orders torch.topk may pick. Without
  a bias the aux selection is therefore the routing selection itself.
- Values agree with Megatron's to fp32 rounding (sums run in another order); the selections are identical unless two
  keys are within rounding of each other.

Triton on CUDA tensors, or under Triton's CPU interpreter (the CPU tests); ``sigmoid_topk_routing_reference`` calls
Megatron's own functions (imported when called) and is the CPU path. Nothing falls back.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import triton
import triton.language as tl

from nam56r_kernels.triton_support import require_cuda_or_interpreter

__all__ = ["sigmoid_topk_routing", "sigmoid_topk_routing_reference"]

_MAX_EXPERTS = 256
# Elements of the [BLOCK_S, E_PAD] tile one program of the per-token kernels holds in registers.
_TILE = 2048
_MAX_BLOCK_S = 64

RoutingOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]


def sigmoid_topk_routing(logits: torch.Tensor, topk: int, expert_bias: torch.Tensor | None = None,
                         scaling_factor: float | None = None, seq_aux_coeff: float = 0.0, seq_aux_batch: int = 1) -> RoutingOutputs:
    """(probs fp32 [T, E], routing_map bool [T, E], aux_loss 0-d fp32 or None, tokens_per_expert int64 [E]) from the
    Triton kernels: two launches forward, one backward (module docstring)."""
    _check(logits, topk, expert_bias, scaling_factor, seq_aux_coeff, seq_aux_batch)
    require_cuda_or_interpreter(logits, "nam56r_kernels.moe_routing.sigmoid_topk_routing", "sigmoid_topk_routing_reference")
    return _SigmoidTopkRouting.apply(logits, topk, expert_bias, scaling_factor, float(seq_aux_coeff), seq_aux_batch)


def sigmoid_topk_routing_reference(logits: torch.Tensor, topk: int, expert_bias: torch.Tensor | None = None,
                                   scaling_factor: float | None = None, seq_aux_coeff: float = 0.0,
                                   seq_aux_batch: int = 1) -> RoutingOutputs:
    """`sigmoid_topk_routing` from Megatron's own functions, as ``TopKRouter.routing`` calls them (any device)."""
    _check(logits, topk, expert_bias, scaling_factor, seq_aux_coeff, seq_aux_batch)
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
        topk_routing_with_score_function,
    )

    tokens, experts = logits.shape
    probs, routing_map = topk_routing_with_score_function(logits, topk, scaling_factor=scaling_factor, score_function="sigmoid",
                                                          expert_bias=expert_bias)
    aux_loss = None
    if seq_aux_coeff:
        aux_map, scores = compute_routing_scores_for_aux_loss(logits, topk, "sigmoid")
        # _apply_seq_aux_loss folds the batch into the expert dim; get_tokens_per_expert_and_token_count at one rank is
        # the folded map's column sums and its row count (it needs a process group, so it is spelled out here).
        seq_len = tokens // seq_aux_batch
        folded_map = aux_map.reshape(seq_len, -1)
        aux_loss = switch_load_balancing_loss_func(probs=scores.reshape(seq_len, -1), tokens_per_expert=folded_map.sum(dim=0),
                                                   total_num_tokens=folded_map.shape[0], topk=topk, num_experts=experts,
                                                   moe_aux_loss_coeff=seq_aux_coeff) / seq_aux_batch
    return probs, routing_map, aux_loss, routing_map.sum(dim=0)


def _check(logits, topk, expert_bias, scaling_factor, seq_aux_coeff, seq_aux_batch) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be an fp32 [T, E] tensor, got {_describe(logits)}")
    tokens, experts = logits.shape
    if not 1 <= experts <= _MAX_EXPERTS or tokens == 0:
        raise ValueError(f"logits must have 1 to {_MAX_EXPERTS} experts and at least one token, got [T, E] = {[tokens, experts]}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"topk must be an int in [1, E = {experts}], got {topk!r}")
    if expert_bias is not None and (not isinstance(expert_bias, torch.Tensor) or expert_bias.shape != (experts,)
                                    or expert_bias.dtype != torch.float32 or expert_bias.device != logits.device):
        raise ValueError(f"expert_bias must be fp32 [E] = [{experts}] on {logits.device} or None, got {_describe(expert_bias)}")
    if scaling_factor is not None and (isinstance(scaling_factor, bool) or not isinstance(scaling_factor, Real)
                                       or not math.isfinite(scaling_factor)):
        raise ValueError(f"scaling_factor must be a finite number or None, got {scaling_factor!r}")
    if isinstance(seq_aux_coeff, bool) or not isinstance(seq_aux_coeff, Real) or not seq_aux_coeff >= 0 or not math.isfinite(seq_aux_coeff):
        raise ValueError(f"seq_aux_coeff must be a finite number >= 0, got {seq_aux_coeff!r}")
    if isinstance(seq_aux_batch, bool) or not isinstance(seq_aux_batch, int) or seq_aux_batch < 1:
        raise ValueError(f"seq_aux_batch must be an int >= 1 (the micro batch), got {seq_aux_batch!r}")
    if tokens % seq_aux_batch:
        raise ValueError(f"T = {tokens} tokens is not S * B for seq_aux_batch B = {seq_aux_batch}")


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__


def _blocks(seq_len: int, experts: int) -> tuple[int, int]:
    """(E_PAD, BLOCK_S): the expert dim padded to a power of 2, and the sequence positions per program."""
    experts_pad = triton.next_power_of_2(experts)
    return experts_pad, max(1, min(_TILE // experts_pad, _MAX_BLOCK_S, triton.next_power_of_2(seq_len)))


class _SigmoidTopkRouting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, expert_bias, scaling_factor, seq_aux_coeff, batch):
        logits = logits.contiguous()
        tokens, experts = logits.shape
        seq_len = tokens // batch
        experts_pad, block_s = _blocks(seq_len, experts)
        blocks = triton.cdiv(seq_len, block_s)
        has_aux, has_bias = seq_aux_coeff > 0, expert_bias is not None
        device = logits.device
        probs = torch.empty(tokens, experts, dtype=torch.float32, device=device)
        routing_map = torch.empty(tokens, experts, dtype=torch.bool, device=device)
        # Per (block, b, e): [0] routed tokens, [1] aux-selected tokens (with a bias; else [0] is the aux count too).
        counts = torch.empty(2 if has_aux and has_bias else 1, blocks, batch, experts, dtype=torch.int32, device=device)
        q_sums = torch.empty(blocks if has_aux else 0, batch, experts, dtype=torch.float32, device=device)
        tokens_per_expert = torch.empty(experts, dtype=torch.int64, device=device)
        aux_loss = torch.empty((), dtype=torch.float32, device=device) if has_aux else None
        aux_counts = torch.empty(batch, experts, dtype=torch.float32, device=device) if has_aux else None
        # Megatron's constant, rounded to fp32 where it multiplies the fp32 sum.
        aux_scale = experts * seq_aux_coeff / (topk * seq_len * seq_len)
        _routing_fwd[(blocks, batch)](
            logits, expert_bias if has_bias else logits, probs, routing_map.view(torch.uint8), counts, q_sums, seq_len, batch,
            float(scaling_factor or 1.0), TOPK=topk, EXPERTS=experts, E_PAD=experts_pad, BLOCK_S=block_s, HAS_BIAS=has_bias,
            HAS_SCALE=bool(scaling_factor), HAS_AUX=has_aux)
        _routing_reduce[(1,)](
            counts, q_sums, tokens_per_expert, aux_loss if has_aux else probs, aux_counts if has_aux else probs, blocks, batch,
            aux_scale, EXPERTS=experts, E_PAD=experts_pad, B_PAD=triton.next_power_of_2(batch), HAS_AUX=has_aux,
            AUX_COUNTS=1 if has_aux and has_bias else 0)
        ctx.save_for_backward(logits, routing_map, aux_counts)
        ctx.topk, ctx.scaling_factor, ctx.aux_scale, ctx.batch = topk, scaling_factor, aux_scale, batch
        ctx.mark_non_differentiable(routing_map, tokens_per_expert)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero tensors made to be read
        return probs, routing_map, aux_loss, tokens_per_expert

    @staticmethod
    def backward(ctx, grad_probs, _grad_map, grad_aux, _grad_counts):
        logits, routing_map, aux_counts = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_probs is None and grad_aux is None):
            return None, None, None, None, None, None
        tokens, experts = logits.shape
        batch = ctx.batch
        seq_len = tokens // batch
        experts_pad, block_s = _blocks(seq_len, experts)
        has_grad_probs, has_grad_aux = grad_probs is not None, grad_aux is not None
        grad_probs = grad_probs.float().contiguous() if has_grad_probs else logits
        grad_aux = grad_aux.float() if has_grad_aux else logits  # 0-d, read by pointer in the kernel: no host sync
        grad_logits = torch.empty_like(logits)
        _routing_bwd[(triton.cdiv(seq_len, block_s), batch)](
            logits, routing_map.view(torch.uint8), aux_counts if has_grad_aux else logits, grad_probs, grad_aux, grad_logits,
            seq_len, batch, float(ctx.scaling_factor or 1.0), ctx.aux_scale, EXPERTS=experts, E_PAD=experts_pad,
            BLOCK_S=block_s, NORMALIZE=ctx.topk > 1, HAS_SCALE=bool(ctx.scaling_factor), HAS_GRAD_PROBS=has_grad_probs,
            HAS_GRAD_AUX=has_grad_aux)
        return grad_logits, None, None, None, None, None


@triton.jit
def _select_topk(key, es, TOPK: tl.constexpr, E_PAD: tl.constexpr):
    """Each row's TOPK largest keys (padding is -inf), of equal keys the lowest index: TOPK rounds of row max."""
    selected = tl.zeros(key.shape, dtype=tl.int1)
    for _ in range(TOPK):
        best = tl.max(key, axis=1)
        first = tl.min(tl.where(key == best[:, None], es[None, :], E_PAD), axis=1)
        hit = es[None, :] == first[:, None]
        selected = selected | hit
        key = tl.where(hit, float("-inf"), key)
    return selected


@triton.jit
def _score_tile(logits_ptr, seq_len, batch, EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_S: tl.constexpr):
    """This program's tile, BLOCK_S positions of sequence b (program ids (block, b)): (its sigmoid scores, 0 outside;
    its offsets into the [T, E] tensors; the expert indices; which positions, which experts and which cells are in
    range)."""
    block, b = tl.program_id(0), tl.program_id(1)
    pos = block * BLOCK_S + tl.arange(0, BLOCK_S)
    es = tl.arange(0, E_PAD)
    pos_in, e_in = pos < seq_len, es < EXPERTS
    inside = pos_in[:, None] & e_in[None, :]
    offsets = (pos.to(tl.int64) * batch + b)[:, None] * EXPERTS + es[None, :]
    scores = tl.where(inside, tl.sigmoid(tl.load(logits_ptr + offsets, mask=inside, other=0.0)), 0.0)
    return scores, offsets, es, pos_in, e_in, inside


@triton.jit
def _routing_fwd(logits_ptr, bias_ptr, probs_ptr, map_ptr, counts_ptr, q_sums_ptr, seq_len, batch, scaling,
                 TOPK: tl.constexpr, EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_S: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_AUX: tl.constexpr):
    """BLOCK_S sequence positions of one sequence b: their probs and map rows, and the block's per-expert counts and
    q sums (the [block, b, e] partials the reduction kernel sums in a fixed order)."""
    scores, offsets, es, pos_in, e_in, inside = _score_tile(logits_ptr, seq_len, batch, EXPERTS, E_PAD, BLOCK_S)
    block, b = tl.program_id(0), tl.program_id(1)
    key = scores
    if HAS_BIAS:
        key = key + tl.load(bias_ptr + es, mask=e_in, other=0.0)[None, :]
    selected = _select_topk(tl.where(e_in[None, :], key, float("-inf")), es, TOPK, E_PAD)
    chosen = tl.where(selected, scores, 0.0)
    probs = chosen
    if TOPK > 1:
        probs = chosen / (tl.sum(chosen, axis=1)[:, None] + 1e-20)
    if HAS_SCALE:
        probs = probs * scaling
    tl.store(probs_ptr + offsets, probs, mask=inside)
    tl.store(map_ptr + offsets, selected.to(tl.uint8), mask=inside)

    partial = (block * batch + b) * EXPERTS + es
    routed = selected & pos_in[:, None]
    tl.store(counts_ptr + partial, tl.sum(routed.to(tl.int32), axis=0), mask=e_in)
    if HAS_AUX:
        q = scores / (tl.sum(scores, axis=1)[:, None] + 1e-20)
        tl.store(q_sums_ptr + partial, tl.sum(q, axis=0), mask=e_in)
        if HAS_BIAS:
            aux_selected = _select_topk(tl.where(e_in[None, :], scores, float("-inf")), es, TOPK, E_PAD) & pos_in[:, None]
            tl.store(counts_ptr + tl.num_programs(0) * batch * EXPERTS + partial, tl.sum(aux_selected.to(tl.int32), axis=0),
                     mask=e_in)


@triton.jit
def _routing_reduce(counts_ptr, q_sums_ptr, tokens_per_expert_ptr, aux_loss_ptr, aux_counts_ptr, blocks, batch, aux_scale,
                    EXPERTS: tl.constexpr, E_PAD: tl.constexpr, B_PAD: tl.constexpr, HAS_AUX: tl.constexpr,
                    AUX_COUNTS: tl.constexpr):
    """One program: the forward kernel's [block, b, e] partials summed block by block (a fixed order), into the routed
    tokens per expert and, with the aux loss, F [b, e] (kept for the backward) and the loss."""
    bs, es = tl.arange(0, B_PAD), tl.arange(0, E_PAD)
    inside = (bs < batch)[:, None] & (es < EXPERTS)[None, :]
    cell = bs[:, None] * EXPERTS + es[None, :]
    stride = batch * EXPERTS
    routed = tl.zeros([B_PAD, E_PAD], dtype=tl.int32)
    aux_selected = tl.zeros([B_PAD, E_PAD], dtype=tl.int32)
    q_sums = tl.zeros([B_PAD, E_PAD], dtype=tl.float32)
    for block in range(blocks):
        routed += tl.load(counts_ptr + block * stride + cell, mask=inside, other=0)
        if HAS_AUX:
            q_sums += tl.load(q_sums_ptr + block * stride + cell, mask=inside, other=0.0)
            if AUX_COUNTS:
                aux_selected += tl.load(counts_ptr + (blocks + block) * stride + cell, mask=inside, other=0)
    tl.store(tokens_per_expert_ptr + es, tl.sum(routed.to(tl.int64), axis=0), mask=es < EXPERTS)
    if HAS_AUX:
        if not AUX_COUNTS:
            aux_selected = routed
        f = aux_selected.to(tl.float32)
        tl.store(aux_counts_ptr + cell, f, mask=inside)
        tl.store(aux_loss_ptr, tl.sum(tl.sum(q_sums * f, axis=1), axis=0) * aux_scale / batch)


@triton.jit
def _routing_bwd(logits_ptr, map_ptr, aux_counts_ptr, grad_probs_ptr, grad_aux_ptr, grad_logits_ptr, seq_len, batch, scaling,
                 aux_scale, EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_S: tl.constexpr, NORMALIZE: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_GRAD_PROBS: tl.constexpr, HAS_GRAD_AUX: tl.constexpr):
    """dlogits = s (1 - s) (dS_probs + dS_aux) for BLOCK_S positions of one sequence b, the scores recomputed."""
    scores, offsets, es, _, e_in, inside = _score_tile(logits_ptr, seq_len, batch, EXPERTS, E_PAD, BLOCK_S)
    b = tl.program_id(1)
    grad_scores = tl.zeros([BLOCK_S, E_PAD], dtype=tl.float32)
    if HAS_GRAD_PROBS:
        selected = tl.load(map_ptr + offsets, mask=inside, other=0) != 0
        g = tl.where(selected, tl.load(grad_probs_ptr + offsets, mask=inside, other=0.0), 0.0)
        if HAS_SCALE:
            g = g * scaling
        if NORMALIZE:  # probs = s / D over the selected s, D = their sum + 1e-20
            chosen = tl.where(selected, scores, 0.0)
            denom = tl.sum(chosen, axis=1)[:, None] + 1e-20
            g = tl.where(selected, g / denom - tl.sum(g * chosen, axis=1)[:, None] / (denom * denom), 0.0)
        grad_scores += g
    if HAS_GRAD_AUX:  # q = s / D' over all s; d aux / d q[t, e] = grad_aux / B * scale * F[b, e]
        coeff = tl.load(grad_aux_ptr) / batch * aux_scale
        a = coeff * tl.load(aux_counts_ptr + b * EXPERTS + es, mask=e_in, other=0.0)[None, :]
        denom = tl.sum(scores, axis=1)[:, None] + 1e-20
        grad_scores += tl.where(inside, a / denom - tl.sum(a * scores, axis=1)[:, None] / (denom * denom), 0.0)
    tl.store(grad_logits_ptr + offsets, scores * (1.0 - scores) * grad_scores, mask=inside)
