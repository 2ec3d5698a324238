"""The `kernels` suite (GPU): each fused kernel and memory patch against the path it replaces, same run,
same inputs, at NAM56R's shapes. Variants named ``upstream…`` or ``reference…`` are baselines; ratios are
taken against the fastest baseline of a case. Errors are max |candidate - baseline| / max |baseline|.

Cases:
- ``dsa-scores mb{1,8}``: causal indexer scores [b, 4096, 4096] (32 heads x 64, relu): core_v0.19.0's
  einsum (read from the pinned release), our Megatron patch 0002 (per head), TileLang's fused indexer
  logits (per sequence, as Megatron runs it; only the last sequence's logits are kept), the fused kernel.
- ``dsa-topk mb8``: top-256 causal selection: patch 0002's scores + ``torch.topk``, TileLang's indexer +
  ``torch.topk`` (``lighting_indexer_indices``), the fused streaming top-k.
- ``lm-head ce`` / ``mtp ce``: output layer + cross-entropy forward+backward at vocab 131072: logits then
  fp32 cross-entropy (core_v0.19.0) vs Megatron patch 0007/0008's chunked fused linear CE (one MTP depth).
- ``moe experts``: 32k tokens, top-4 of 16 experts, hidden 4096, FFN 896, forward+backward: the per-expert
  loop (SequentialMLP's computation) vs two grouped GEMMs.
- ``ngram embed``: micro-batch 8 x 4096, orders (2, 3) x 8 heads, 500k x 16 tables, projected to 4096,
  forward+backward: reference embedding + linear vs the fused hash/gather/projection.
- ``mamba3 adt``: the data-dependent-A region at micro-batch 8, eager vs regional ``torch.compile``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nam56r_bench.harness import ROOT, Context, Row, cuda_peak_extra_bytes, cuda_time_ms, require_gpu

SEQ, INDEX_HEADS, INDEX_DIM, TOPK = 4096, 32, 64, 256


def _measure(case: str, variant: str, fn: Callable[[], object], ctx: Context, reference=None, **extra) -> tuple[Row, object]:
    import torch

    print(f"[kernels] {case} · {variant}", flush=True)
    try:
        peak, result = cuda_peak_extra_bytes(fn)
        error = None if reference is None else _relative_error(result, reference)
        ms = cuda_time_ms(fn, warmup=1 if ctx.quick else 3, iters=3 if ctx.quick else 10)
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return Row(case, variant, extra={"error": f"out of memory: {str(exc).splitlines()[0]}", **extra}), None
    return Row(case, variant, time_ms=ms, peak_extra_bytes=peak, max_error=error, extra=extra), result


def _relative_error(got, want) -> float:
    import torch

    pairs = zip(got, want, strict=True) if isinstance(got, (tuple, list)) else [(got, want)]
    worst = 0.0
    for a, b in pairs:
        a, b = a.float(), b.float()
        finite = torch.isfinite(b)
        if not torch.equal(finite, torch.isfinite(a)):
            return float("inf")
        scale = b[finite].abs().max().clamp_min(1e-30)
        worst = max(worst, ((a[finite] - b[finite]).abs().max() / scale).item())
    return worst


def _indexer_inputs(batch: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(SEQ, batch, INDEX_HEADS, INDEX_DIM, device="cuda", generator=g).bfloat16()
    k = torch.randn(SEQ, batch, INDEX_DIM, device="cuda", generator=g).bfloat16()
    w = (torch.randn(SEQ, batch, INDEX_HEADS, device="cuda", generator=g) * INDEX_HEADS**-0.5).bfloat16()
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


def dsa_cases(ctx: Context) -> list[Row]:
    import torch
    from megatron.core.transformer.experimental_attention_variant import dsa
    from nam56r_kernels.dsa_indexer import index_topk_fused
    from nam56r_patchlane.pinned import PinnedRelease

    upstream_scores = PinnedRelease(ROOT / "third_party" / "megatron-lm").definition(
        dsa, "megatron/core/transformer/experimental_attention_variant/dsa.py", "_compute_index_scores"
    )
    fwd_logits, tilelang_topk, tilelang_missing = _tilelang_indexer()
    mask = torch.zeros(SEQ, SEQ, device="cuda").masked_fill_(torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda").triu_(1), float("-inf"))
    starts = torch.zeros(SEQ, dtype=torch.int32, device="cuda")
    ends = torch.arange(1, SEQ + 1, dtype=torch.int32, device="cuda")
    rows = []
    for batch in (1,) if ctx.quick else (1, 8):
        rows += _dsa_scores_case(batch, upstream_scores, fwd_logits, tilelang_missing, mask, starts, ends, ctx)
        torch.cuda.empty_cache()

    batch = 1 if ctx.quick else 8
    case = f"dsa-topk mb{batch}"
    q, k, w = _indexer_inputs(batch)
    naive, (ref_scores, _) = _measure(
        case, "upstream + patch 0002 scores, torch.topk", lambda: (dsa._compute_index_scores(q, w, k) + mask).topk(TOPK, dim=-1), ctx
    )
    rows.append(naive)
    if tilelang_topk is not None:

        def tilelang_selection() -> torch.Tensor:
            out = torch.empty(batch, SEQ, TOPK, dtype=torch.int32, device="cuda")
            for bi in range(batch):
                out[bi] = tilelang_topk(q[:, bi].contiguous(), k[:, bi].contiguous(), w[:, bi].float().contiguous(), starts, ends, TOPK)
            return out

        rows.append(_measure(case, "upstream TileLang indexer + torch.topk", tilelang_selection, ctx)[0])
    else:
        rows.append(Row(case, "upstream TileLang indexer + torch.topk", extra={"error": tilelang_missing}))
    fused_row, fused = _measure(case, "fused", lambda: index_topk_fused(q, k, w, TOPK), ctx)
    if fused is not None:
        same_rows = (fused[0].sort(-1).values == ref_scores.sort(-1).values).all(-1).float().mean().item()
        fused_row = Row(fused_row.case, fused_row.variant, fused_row.time_ms, fused_row.peak_extra_bytes,
                        _relative_error(fused[0], ref_scores), {"rows_with_identical_scores": same_rows})
    rows.append(fused_row)
    return rows


def _dsa_scores_case(batch, upstream_scores, fwd_logits, tilelang_missing, mask, starts, ends, ctx: Context) -> list[Row]:
    from megatron.core.transformer.experimental_attention_variant import dsa
    from nam56r_kernels.dsa_indexer import index_scores_fused

    case = f"dsa-scores mb{batch}"
    q, k, w = _indexer_inputs(batch)
    base, ref = _measure(case, "upstream (core_v0.19.0 einsum)", lambda: upstream_scores(q, w, k) + mask, ctx)
    patched, ref_patched = _measure(case, "upstream + patch 0002 (per head)", lambda: dsa._compute_index_scores(q, w, k) + mask, ctx)
    rows = [base, patched]
    if fwd_logits is not None:

        def tilelang_scores():
            for bi in range(batch):
                logits = fwd_logits(q[:, bi].contiguous(), k[:, bi].contiguous(), w[:, bi].float().contiguous(), starts, ends,
                                    clean_logits=True, use_relu=True)
            return logits

        rows.append(_measure(case, "upstream TileLang indexer (per sequence)", tilelang_scores, ctx)[0])
    else:
        rows.append(Row(case, "upstream TileLang indexer (per sequence)", extra={"error": tilelang_missing}))
    reference = ref if ref is not None else ref_patched
    rows.append(_measure(case, "fused", lambda: index_scores_fused(q, k, w, causal=True), ctx, reference=reference)[0])
    return rows


def cross_entropy_cases(ctx: Context) -> list[Row]:
    import torch
    from megatron.core.fusions.fused_linear_cross_entropy import fused_linear_cross_entropy

    batch = 2 if ctx.quick else 8
    hidden, vocab = 4096, 131072
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(SEQ, batch, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (batch, SEQ), device="cuda", generator=g)

    def unfused() -> tuple[torch.Tensor, ...]:
        logits = torch.nn.functional.linear(h, weight)  # [s, b, V], as the output layer returns them
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.t().reshape(-1), reduction="none")
        return (loss.view(SEQ, batch).t().float(), *torch.autograd.grad(loss.sum(), (h, weight)))

    def fused() -> tuple[torch.Tensor, ...]:
        loss, _ = fused_linear_cross_entropy(h, weight, labels)
        return (loss, *torch.autograd.grad(loss.sum(), (h, weight)))

    rows = []
    for case in ("lm-head ce", "mtp ce (one depth)"):  # the same computation at each of NAM56R's three heads
        base, ref = _measure(case, f"upstream (logits + fp32 CE), mb{batch}", unfused, ctx)
        rows.append(base)
        rows.append(_measure(case, f"patch 0007/0008 fused linear CE, mb{batch}", fused, ctx, reference=ref)[0])
        del ref
        if ctx.quick:
            break
    return rows


def moe_case(ctx: Context) -> list[Row]:
    import torch
    import torch.nn.functional as F
    from nam56r_kernels.grouped_mlp import grouped_mlp, grouped_mlp_reference

    experts, hidden, ffn, topk = 16, 4096, 896, 4
    tokens = (8192 if ctx.quick else 32768) * topk
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

    case = f"moe experts ({tokens // topk} tokens)"
    base, ref = _measure(case, "reference (per-expert loop)", step(grouped_mlp_reference), ctx)
    return [base, _measure(case, "grouped_mm", step(grouped_mlp), ctx, reference=ref)[0]]


def ngram_case(ctx: Context) -> list[Row]:
    import torch
    from nam56r_kernels.ngram_hash import make_hash_params, ngram_hash_project_fused, ngram_hash_project_reference

    batch, orders, heads, rows_, dim, hidden = (2 if ctx.quick else 8), (2, 3), 8, 500_000, 16, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, 131072, (batch, SEQ), device="cuda", generator=g)
    tables = torch.randn(len(orders), rows_, dim, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(hidden, len(orders) * heads * dim, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    mult, offset = (p.cuda() for p in make_hash_params(orders, heads))
    grad = torch.randn(batch, SEQ, hidden, device="cuda", generator=g).bfloat16()

    def step(fn):
        def run():
            out = fn(tokens, tables, orders, mult, offset, weight)
            return (out, *torch.autograd.grad(out, (tables, weight), grad))

        return run

    case = f"ngram embed mb{batch}"
    base, ref = _measure(case, "reference (embedding + linear)", step(ngram_hash_project_reference), ctx)
    return [base, _measure(case, "fused", step(ngram_hash_project_fused), ctx, reference=ref)[0]]


def mamba_region_case(ctx: Context) -> list[Row]:
    import torch
    from nam56r_kernels.mamba3_regions import adt_dt_compiled, adt_dt_reference

    heads = 128  # d_inner 8192 / head dim 64
    g = torch.Generator(device="cuda").manual_seed(0)
    dd_a, dd_dt = (torch.randn(8, SEQ, heads, device="cuda", generator=g).bfloat16() for _ in range(2))
    dt_bias = torch.randn(heads, device="cuda", generator=g)
    compiled = adt_dt_compiled()
    start = time.perf_counter()
    compiled(dd_a, dd_dt, dt_bias, 1e-4)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    case = "mamba3 adt region mb8"
    base, ref = _measure(case, "reference (eager)", lambda: adt_dt_reference(dd_a, dd_dt, dt_bias, 1e-4), ctx)
    return [base, _measure(case, "torch.compile", lambda: compiled(dd_a, dd_dt, dt_bias, 1e-4), ctx, reference=ref,
                           compile_s=round(compile_s, 2))[0]]


def run(ctx: Context) -> list[Row]:
    require_gpu("kernels")
    rows: list[Row] = []
    for cases in (dsa_cases, cross_entropy_cases, moe_case, ngram_case, mamba_region_case):
        rows += cases(ctx)
    return rows
