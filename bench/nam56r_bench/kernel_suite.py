"""The `kernels` suite (GPU): each fused kernel and memory patch against the path it replaces, same run,
same inputs, at the model's sizes (`kernel_shapes`: read from the nam56r preset; the micro-batches and token
counts are the bench's own, named there). Variants named ``upstream…`` or ``reference…`` are baselines;
ratios are taken against the fastest baseline of a case. Errors are max |candidate - baseline| / max |baseline|.

Cases (each size by the ModelConfig field it is read from):
- ``dsa-scores mb{1,8}``: causal indexer scores [b, seq, seq] (dsa.indexer_heads x dsa.indexer_head_dim,
  relu): core_v0.19.0's einsum (read from the pinned release), our Megatron patch 0002 (per head), TileLang's
  fused indexer logits (per sequence, as Megatron runs it; only the last sequence's logits are kept), the
  fused kernel.
- ``dsa-topk mb8``: top-(dsa.topk) causal selection: patch 0002's scores + ``torch.topk``, TileLang's
  indexer + ``torch.topk`` (``lighting_indexer_indices``), the fused scores + ``torch.topk``, the
  fused scores + exact per-query select (``index_topk_fused``).
- ``dsa layer fwd+bwd seq{seq} mb1``: one of NAM56R's DSA layers (input norm, absorbed MLA, indexer, sparse MLA,
  indexer loss; nam56r.model.model.build_dsa_layers, the model's spec on the recipe backend), forward+backward
  in training mode, on each indexer path (``DSAConfig.indexer``): Megatron's (with the preset's
  dsa.kernel_backend: TileLang's indexer+loss), the fused top-k with the sparse loss on the selected keys in torch
  (``"fused"``) or on Megatron's TileLang loss kernels (``"fused-tilelang-loss"``); the sparse MLA is Megatron's
  TileLang one on every path. ``dsa layers ... IndexCache``: the first IndexCache group (1 Full +
  index_cache.share_group - 1 Shared layers), one after another, on each path, against the same layers without
  IndexCache on Megatron's path (`layer_cases.dsa_layer_plan`). These steps are mostly host time (the GPU is busy
  for a third of one or less), so every variant is timed in interleaved rounds and each row is the median of all
  its samples, with the 10th-90th percentile spread and the GPU's kernel time per step in its extra fields.
- ``lm-head ce`` / ``mtp ce``: output layer + cross-entropy forward+backward at vocab_size: logits then
  fp32 cross-entropy (core_v0.19.0) vs Megatron patch 0007/0008's chunked fused linear CE (Liger) vs
  ``nam56r_kernels.linear_cross_entropy`` (one MTP depth).
- ``moe experts``: 32k tokens, top-(moe.topk) of moe.num_experts experts of FFN moe.expert_ffn,
  forward+backward: the per-expert loop (SequentialMLP's computation) vs two grouped GEMMs, with the eager
  activation and probs or the fused one (``nam56r_kernels.expert_activation``). ``moe expert activation``: that
  activation and scale alone on the same rows, eager vs fused.
- ``moe layer fwd+bwd (N tokens)``: one of NAM56R's MoE layers whole (pre-MLP norm, router with its aux loss,
  Megatron's token dispatcher and permutes, routed experts, shared expert of moe.shared_expert_ffn, residual;
  nam56r.model.model.build_moe_layer on the recipe backend) on N tokens as seq_length x N/seq_length sequences,
  in training mode: Megatron's per-expert ``SequentialMLP`` vs our grouped experts, with Megatron's all-to-all
  dispatcher and with ours at EP=1 (``MoEConfig.dispatch="fused-permute"``, nam56r.model.moe_dispatch), with the
  fused expert activation, with the fused router gating (nam56r_kernels.router_gating), with the fused routing
  (nam56r_kernels.moe_routing), and with the fused input norm (ModelConfig.residual_norm; the one-GPU recipes' path),
  same weights.
  ``moe layer fwd+bwd back-to-back``: the same steps ten at a time with no synchronization between them, as a
  training step runs its layers, so the host's launch time hides behind queued GPU work where it can (each
  ``fwd+bwd`` step starts from an idle GPU and counts it).
  ``moe layer stages``: each variant's forward split into its stages with CUDA events at module hooks (shared
  expert, router, dispatch+permute, experts, unpermute+combine), and the backward as the rest of the step.
  ``moe layer kernels``: the one-GPU recipes' variant's forward+backward and the same with torch's input norm
  (``ModelConfig.residual_norm="torch"``), kernel by kernel (PyTorch profiler; not with ``--quick``): the top 15 kernels
  with their share of the step, and the GPU-idle share.
- ``layer input norm + residual``: a transformer layer's input RMSNorm (eps norm_epsilon) and its residual,
  forward+backward on moe_tokens x hidden_size: torch's RMSNorm with autograd adding the residual's gradient vs
  ``nam56r_kernels.residual_rms_norm`` (``ModelConfig.residual_norm="fused"``).
- ``mamba3 adt``: the data-dependent-A region (mamba.num_heads(hidden_size) heads) at micro-batch 8, eager vs
  regional ``torch.compile``.
- ``mamba-mimo <kernel> mb{4,8}`` (group ``mamba-mimo-bwd``): launch configurations of Mamba-3's MIMO backward TileLang
  kernels against the one mamba_ssm launches (`nam56r_bench.mimo_bwd_sweep`: the candidates and why, compiled in
  parallel first, each measured in a worker process that a hang or crash costs one candidate only).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from nam56r_bench.case_measure import measure, relative_error
from nam56r_bench.harness import ROOT, Context, Row, require_gpu
from nam56r_bench.kernel_shapes import KernelShapes, KernelSweep, kernel_shapes, kernel_sweep
from nam56r_bench.layer_cases import dsa_layer_cases, moe_layer_cases
from nam56r_bench.mimo_bwd_sweep import mimo_bwd_cases


def _indexer_inputs(batch: int, shapes: KernelShapes):
    import torch

    seq, heads, dim = shapes.seq_length, shapes.indexer_heads, shapes.indexer_head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seq, batch, heads, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(seq, batch, dim, device="cuda", generator=g).bfloat16()
    w = (torch.randn(seq, batch, heads, device="cuda", generator=g) * heads**-0.5).bfloat16()
    return q, k, w


def _tilelang_indexer():
    """Megatron's TileLang indexer entry points, or the reason they are unavailable."""
    try:
        from megatron.core.transformer.experimental_attention_variant.ops import indexer, tilelang_indexer_fwd
    except ImportError as exc:
        return None, None, f"import failed: {exc}"
    if indexer.lighting_indexer_indices is None:
        return None, None, "TileLang indexer kernels are unavailable (tilelang not importable)"
    return tilelang_indexer_fwd.indexer_fwd_interface, indexer.lighting_indexer_indices, None


@dataclass(frozen=True)
class _DsaBaselines:
    """What every DSA case compares against, built once: the pinned release's scores, TileLang's indexer
    (or why it is missing), and the causal mask and per-row key ranges at the preset's sequence length."""

    shapes: KernelShapes
    upstream_scores: Callable
    tilelang_logits: Callable | None
    tilelang_topk: Callable | None
    tilelang_missing: str | None
    mask: object  # [seq, seq] fp32, -inf above the diagonal
    starts: object  # [seq] int32: each query row's first key (0)
    ends: object  # [seq] int32: one past its last key (row + 1)


def _dsa_baselines(shapes: KernelShapes) -> _DsaBaselines:
    import torch
    from megatron.core.transformer.experimental_attention_variant import dsa
    from nam56r_patchlane.pinned import PinnedRelease

    upstream_scores = PinnedRelease(ROOT / "third_party" / "megatron-lm").definition(
        dsa, "megatron/core/transformer/experimental_attention_variant/dsa.py", "_compute_index_scores"
    )
    seq = shapes.seq_length
    mask = torch.zeros(seq, seq, device="cuda").masked_fill_(torch.ones(seq, seq, dtype=torch.bool, device="cuda").triu_(1), float("-inf"))
    starts = torch.zeros(seq, dtype=torch.int32, device="cuda")
    ends = torch.arange(1, seq + 1, dtype=torch.int32, device="cuda")
    return _DsaBaselines(shapes, upstream_scores, *_tilelang_indexer(), mask, starts, ends)


def dsa_cases(ctx: Context, shapes: KernelShapes, sweep: KernelSweep) -> list[Row]:
    import torch

    base = _dsa_baselines(shapes)
    rows = []
    for batch in sweep.dsa_score_batches:
        rows += _dsa_scores_case(batch, base, ctx)
        torch.cuda.empty_cache()
    return rows + _dsa_topk_case(sweep.dsa_topk_batch, base, ctx)


def _dsa_scores_case(batch: int, base: _DsaBaselines, ctx: Context) -> list[Row]:
    from megatron.core.transformer.experimental_attention_variant import dsa
    from nam56r_kernels.dsa_indexer import index_scores_fused

    case = f"dsa-scores mb{batch}"
    q, k, w = _indexer_inputs(batch, base.shapes)
    upstream, ref = measure(case, "upstream (core_v0.19.0 einsum)", lambda: base.upstream_scores(q, w, k) + base.mask, ctx)
    patched, ref_patched = measure(case, "upstream + patch 0002 (per head)", lambda: dsa._compute_index_scores(q, w, k) + base.mask, ctx)
    rows = [upstream, patched]
    if base.tilelang_logits is not None:

        def tilelang_scores():
            for bi in range(batch):
                logits = base.tilelang_logits(q[:, bi].contiguous(), k[:, bi].contiguous(), w[:, bi].float().contiguous(), base.starts,
                                              base.ends, clean_logits=True, use_relu=True)
            return logits

        rows.append(measure(case, "upstream TileLang indexer (per sequence)", tilelang_scores, ctx)[0])
    else:
        rows.append(Row(case, "upstream TileLang indexer (per sequence)", extra={"error": base.tilelang_missing}))
    reference = ref if ref is not None else ref_patched
    rows.append(measure(case, "fused", lambda: index_scores_fused(q, k, w, causal=True), ctx, reference=reference)[0])
    return rows


def _dsa_topk_case(batch: int, base: _DsaBaselines, ctx: Context) -> list[Row]:
    import torch
    from megatron.core.transformer.experimental_attention_variant import dsa
    from nam56r_kernels.dsa_indexer import index_scores_fused, index_topk_fused

    seq, topk = base.shapes.seq_length, base.shapes.dsa_topk
    case = f"dsa-topk mb{batch}"
    q, k, w = _indexer_inputs(batch, base.shapes)
    naive, (ref_scores, _) = measure(
        case, "upstream + patch 0002 scores, torch.topk", lambda: (dsa._compute_index_scores(q, w, k) + base.mask).topk(topk, dim=-1), ctx
    )
    rows = [naive]
    if base.tilelang_topk is not None:

        def tilelang_selection() -> torch.Tensor:
            out = torch.empty(batch, seq, topk, dtype=torch.int32, device="cuda")
            for bi in range(batch):
                out[bi] = base.tilelang_topk(q[:, bi].contiguous(), k[:, bi].contiguous(), w[:, bi].float().contiguous(), base.starts,
                                             base.ends, topk)
            return out

        rows.append(measure(case, "upstream TileLang indexer + torch.topk", tilelang_selection, ctx)[0])
    else:
        rows.append(Row(case, "upstream TileLang indexer + torch.topk", extra={"error": base.tilelang_missing}))
    rows.append(measure(case, "fused scores + torch.topk", lambda: index_scores_fused(q, k, w, causal=True).topk(topk, dim=-1), ctx)[0])
    fused_row, fused = measure(case, "fused", lambda: index_topk_fused(q, k, w, topk), ctx)
    if fused is not None:
        same_rows = (fused[0].sort(-1).values == ref_scores.sort(-1).values).all(-1).float().mean().item()
        fused_row = Row(fused_row.case, fused_row.variant, fused_row.time_ms, fused_row.peak_extra_bytes,
                        relative_error(fused[0], ref_scores), {"rows_with_identical_scores": same_rows})
    rows.append(fused_row)
    return rows


def cross_entropy_cases(ctx: Context, shapes: KernelShapes, sweep: KernelSweep) -> list[Row]:
    import torch
    from megatron.core.fusions.fused_linear_cross_entropy import fused_linear_cross_entropy
    from nam56r_kernels.linear_cross_entropy import linear_cross_entropy

    batch, seq, hidden, vocab = sweep.ce_batch, shapes.seq_length, shapes.hidden_size, shapes.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(seq, batch, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)

    def unfused() -> tuple[torch.Tensor, ...]:
        logits = torch.nn.functional.linear(h, weight)  # [s, b, V], as the output layer returns them
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.t().reshape(-1), reduction="none")
        return (loss.view(seq, batch).t().float(), *torch.autograd.grad(loss.sum(), (h, weight)))

    def fused() -> tuple[torch.Tensor, ...]:
        loss, _ = fused_linear_cross_entropy(h, weight, labels)
        return (loss, *torch.autograd.grad(loss.sum(), (h, weight)))

    def chunked() -> tuple[torch.Tensor, ...]:
        loss = linear_cross_entropy(h.view(-1, hidden), weight, labels.t().reshape(-1)).loss
        hidden_grad, weight_grad = torch.autograd.grad(loss.sum(), (h, weight))
        return (loss.view(seq, batch).t(), hidden_grad, weight_grad)

    # The same computation at the LM head and at each of the mtp_depths MTP heads: one of each is measured.
    cases = ("lm-head ce", "mtp ce (one depth)") if shapes.mtp_depths else ("lm-head ce",)
    rows = []
    for case in cases:
        base, ref = measure(case, f"upstream (logits + fp32 CE), mb{batch}", unfused, ctx)
        rows.append(base)
        rows.append(measure(case, f"patch 0007/0008 fused linear CE, mb{batch}", fused, ctx, reference=ref)[0])
        rows.append(measure(case, f"chunked linear CE (nam56r_kernels), mb{batch}", chunked, ctx, reference=ref)[0])
        del ref
        if ctx.quick:
            break
    return rows


def moe_case(ctx: Context, shapes: KernelShapes, sweep: KernelSweep) -> list[Row]:
    import torch
    import torch.nn.functional as F
    from nam56r_kernels.grouped_mlp import grouped_mlp, grouped_mlp_reference

    experts, hidden, ffn, topk = shapes.num_experts, shapes.hidden_size, shapes.expert_ffn, shapes.expert_topk
    tokens = sweep.moe_tokens * topk  # one row per (token, chosen expert)
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.bincount(torch.randint(0, experts, (tokens,), device="cuda", generator=g), minlength=experts).cpu()
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    fc1 = (torch.randn(experts, ffn, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    fc2 = (torch.randn(experts, hidden, ffn, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    probs = torch.rand(tokens, device="cuda", generator=g)

    def step(fn):
        def run():
            out = fn(x, fc1, fc2, counts, F.gelu, per_token_scale=probs)
            return (out, *torch.autograd.grad(out.float().square().sum(), (x, fc1, fc2)))

        return run

    case = f"moe experts ({sweep.moe_tokens} tokens)"
    base, ref = measure(case, "reference (per-expert loop)", step(grouped_mlp_reference), ctx)
    rows = [base, measure(case, "grouped_mm", step(grouped_mlp), ctx, reference=ref)[0],
            measure(case, "grouped_mm + fused GELU x probs", step(partial(grouped_mlp, fused_activation=True)), ctx, reference=ref)[0]]
    del ref
    return rows + _expert_activation_rows(ctx, tokens, ffn)


def _expert_activation_rows(ctx: Context, rows: int, ffn: int) -> list[Row]:
    """The experts' activation and router-prob scale alone, forward+backward: eager (GELU, multiply by the fp32 probs,
    cast) against `nam56r_kernels.expert_activation.scaled_gelu`."""
    import torch
    from nam56r_kernels.expert_activation import scaled_gelu, scaled_gelu_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (3 * torch.randn(rows, ffn, device="cuda", generator=g)).bfloat16().requires_grad_()
    probs = torch.rand(rows, device="cuda", generator=g).requires_grad_()
    grad = torch.randn(rows, ffn, device="cuda", generator=g).bfloat16()

    def step(fn):
        def run():
            out = fn(h, probs)
            return (out, *torch.autograd.grad(out, (h, probs), grad))

        return run

    case = f"moe expert activation ({rows} x {ffn})"
    base, ref = measure(case, "reference (eager GELU, probs, cast)", step(scaled_gelu_reference), ctx)
    return [base, measure(case, "fused (scaled_gelu)", step(scaled_gelu), ctx, reference=ref)[0]]


def residual_norm_case(ctx: Context, shapes: KernelShapes, sweep: KernelSweep) -> list[Row]:
    """A transformer layer's input norm with its residual, forward+backward on moe_tokens x hidden_size bf16: torch's
    RMSNorm with autograd adding the residual's gradient (Megatron's local norm) against
    `nam56r_kernels.residual_rms_norm` (ModelConfig.residual_norm)."""
    import torch
    from nam56r_kernels.residual_rms_norm import rms_norm_residual, rms_norm_residual_reference

    tokens, hidden = sweep.moe_tokens, shapes.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16().requires_grad_()
    grad_normed, grad_residual = (torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16() for _ in range(2))

    def step(fn):
        def run():
            normed, residual = fn(x, weight, shapes.norm_epsilon)
            return (normed, *torch.autograd.grad((normed, residual), (x, weight), (grad_normed, grad_residual)))

        return run

    case = f"layer input norm + residual fwd+bwd ({tokens} x {hidden})"
    base, ref = measure(case, "upstream (torch RMSNorm, autograd's residual add)", step(rms_norm_residual_reference), ctx)
    return [base, measure(case, "fused (rms_norm_residual)", step(rms_norm_residual), ctx, reference=ref)[0]]


def mamba_region_case(ctx: Context, shapes: KernelShapes, sweep: KernelSweep) -> list[Row]:
    import torch
    from nam56r_kernels.mamba3_regions import adt_dt_compiled, adt_dt_reference

    batch, heads, a_floor = sweep.mamba_batch, shapes.mamba_heads, shapes.mamba_a_floor
    g = torch.Generator(device="cuda").manual_seed(0)
    dd_a, dd_dt = (torch.randn(batch, shapes.seq_length, heads, device="cuda", generator=g).bfloat16() for _ in range(2))
    dt_bias = torch.randn(heads, device="cuda", generator=g)
    compiled = adt_dt_compiled()
    start = time.perf_counter()
    compiled(dd_a, dd_dt, dt_bias, a_floor)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    case = f"mamba3 adt region mb{batch}"
    base, ref = measure(case, "reference (eager)", lambda: adt_dt_reference(dd_a, dd_dt, dt_bias, a_floor), ctx)
    return [base, measure(case, "torch.compile", lambda: compiled(dd_a, dd_dt, dt_bias, a_floor), ctx, reference=ref,
                           compile_s=round(compile_s, 2))[0]]


# The case groups by the name --kernel-cases takes, in the order they run.
CASE_GROUPS = {
    "dsa": dsa_cases,
    "dsa-layer": dsa_layer_cases,
    "ce": cross_entropy_cases,
    "moe-experts": moe_case,
    "moe-layer": moe_layer_cases,
    "norm": residual_norm_case,
    "mamba": mamba_region_case,
    "mamba-mimo-bwd": mimo_bwd_cases,
}
CASES = tuple(CASE_GROUPS.values())


def run(ctx: Context) -> list[Row]:
    require_gpu("kernels")
    shapes, sweep = kernel_shapes(), kernel_sweep(ctx.quick)
    rows: list[Row] = []
    for name, cases in CASE_GROUPS.items():
        if ctx.kernel_cases and name not in ctx.kernel_cases:
            continue
        try:
            rows += cases(ctx, shapes, sweep)
        except Exception as exc:  # noqa: BLE001 - one broken case group must not cost the others' measurements
            traceback.print_exc()
            rows.append(Row(cases.__name__, "all variants", extra={"error": f"{type(exc).__name__}: {exc}"[:2000]}))
    return rows
