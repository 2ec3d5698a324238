"""The kernels suite's whole-layer cases (GPU): NAM56R's DSA layers and an MoE layer, forward+backward in
training mode, each path against Megatron's on the same weights (the cases are described in
`nam56r_bench.kernel_suite`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from nam56r_bench.case_measure import measure
from nam56r_bench.harness import Context, Row, cuda_samples_ms
from nam56r_bench.kernel_shapes import KernelShapes, KernelSweep, dsa_layer_config, moe_layer_batch

DSA_LAYER_VARIANTS = {
    "megatron": "upstream (Megatron's indexer, dsa_kernel_backend={backend})",
    "fused": "fused top-k + sparse loss",
    "fused-tilelang-loss": "fused top-k + Megatron's TileLang sparse loss",
}


@dataclass(frozen=True)
class DsaLayerRun:
    """One variant of a `dsa layer` case: its layers' indexer path and IndexCache setting, how many of the preset's
    DSA layers run one after another, and the variant whose output its error is measured against (None: no error,
    as for the first variant, or where the model differs: IndexCache's Shared layers reuse another top-k)."""

    case: str
    variant: str
    indexer: str
    index_cache: bool
    layers: int
    error_against: str | None


def dsa_layer_plan(shapes: KernelShapes, sweep: KernelSweep) -> list[DsaLayerRun]:
    """The `dsa layer` cases: one DSA layer on each indexer path (Megatron's first, the baseline); then one IndexCache
    group of layers (1 Full + share_group - 1 Shared) on each indexer path against the same layers without IndexCache
    on Megatron's indexer (the baseline, which every layer's indexer computes), so that one run says whether IndexCache
    and each indexer path pay."""
    seq, batch = shapes.seq_length, sweep.dsa_layer_batch
    share_group = dsa_layer_config(shapes.preset, "megatron", True).index_cache.share_group
    kernel_backend = dsa_layer_config(shapes.preset, "megatron", False).dsa.kernel_backend
    labels = {indexer: label.format(backend=kernel_backend) for indexer, label in DSA_LAYER_VARIANTS.items()}
    single = f"dsa layer fwd+bwd seq{seq} mb{batch}"
    runs = [DsaLayerRun(single, label, indexer, False, 1, None if indexer == "megatron" else labels["megatron"])
            for indexer, label in labels.items()]
    group = f"dsa layers fwd+bwd seq{seq} mb{batch}, {share_group} layers, IndexCache 1 Full + {share_group - 1} Shared"
    runs.append(DsaLayerRun(group, f"upstream: {share_group} Full layers, no IndexCache (Megatron's indexer, dsa_kernel_backend="
                                   f"{kernel_backend})", "megatron", False, share_group, None))
    first_cached = f"IndexCache, {labels['megatron']}"
    runs += [DsaLayerRun(group, f"IndexCache, {label}", indexer, True, share_group, None if indexer == "megatron" else first_cached)
             for indexer, label in labels.items()]
    return runs


# A DSA layer at one 4096-token sequence keeps the GPU busy for a third of its step or less: the step's time is mostly
# the host's (Python and kernel launches), which drifts by several ms within a run. So the variants are timed in
# interleaved rounds, each round a few samples of every variant, and a row is the median of all its samples, with the
# 10th-90th percentile spread and the GPU's own kernel time per step beside it.
DSA_ROUNDS, DSA_SAMPLES_PER_ROUND = 6, 4


def dsa_layer_cases(ctx: Context, shapes: KernelShapes, sweep: KernelSweep) -> list[Row]:
    import torch

    from nam56r.model.model import build_dsa_layers
    from nam56r.model.specs import resolve_backend

    backend = resolve_backend("auto")
    rows, results, weights, timed = [], {}, None, []
    for run in dsa_layer_plan(shapes, sweep):
        config = dsa_layer_config(shapes.preset, run.indexer, run.index_cache)
        built = build_dsa_layers(config, backend, device="cuda", params_dtype=torch.bfloat16)
        layers = [built.layers[n] for n in sorted(built.layers)[: run.layers]]
        if weights is None or len(weights) < len(layers):
            weights = [as_trained(layer).state_dict() for layer in layers]
        for layer, state in zip(layers, weights[: len(layers)], strict=True):
            as_trained(layer).load_state_dict(state)
            layer.train()
        begin_pass = built.topk_cache.begin_forward if built.topk_cache is not None else None
        del built  # the preset's other DSA layers
        step = _layers_step(layers, sweep.dsa_layer_batch, shapes.seq_length, begin_pass)
        row, result = measure(run.case, run.variant, step, ctx, reference=results.get((run.case, run.error_against)), timed=False)
        results[(run.case, run.variant)] = result
        if result is not None:  # it ran out of memory otherwise
            timed.append((len(rows), step))
        rows.append(row)
    rounds = 2 if ctx.quick else DSA_ROUNDS
    samples: dict[int, list[float]] = {index: [] for index, _ in timed}
    for _ in range(rounds):
        for index, step in timed:
            samples[index] += cuda_samples_ms(step, warmup=1, iters=DSA_SAMPLES_PER_ROUND)
    for index, step in timed:
        ms = sorted(samples[index])
        rows[index] = replace(rows[index], time_ms=statistics.median(ms), extra={
            "samples": len(ms), "rounds": rounds, "p10_ms": round(ms[len(ms) // 10], 3), "p90_ms": round(ms[-1 - len(ms) // 10], 3),
            **_gpu_time(step)})
    return rows


def _gpu_time(step: Callable[[], tuple]) -> dict[str, float]:
    """The GPU's kernel time in one `step` and its share of the step (PyTorch profiler, two steps)."""
    from nam56r_bench.profile_trace import profile_step

    breakdown = profile_step(step, steps=2, count=1)
    return {"gpu_kernel_ms": round(breakdown["step_ms"] * breakdown["kernel_share"], 3),
            "gpu_busy_share": round(breakdown["gpu_busy_share"], 3)}


def as_trained(layer):
    """`layer` with the parameter dtypes training gives it: Megatron's Float16Module casts the model to bf16 except
    the parameters marked `keep_fp32` (patch 0003), including plain torch modules inside a layer (DSA's indexer
    LayerNorm) that the builder's params_dtype does not reach."""
    import torch
    from megatron.core.transformer.module import _cast_except_kept_fp32

    return _cast_except_kept_fp32(layer, torch.nn.Module.bfloat16)


def _layers_step(layers: list, batch: int, seq: int, begin_pass: Callable[[], None] | None = None) -> Callable[[], tuple]:
    """Forward+backward of `layers` in order on fixed hidden states [seq, batch, hidden] in the layers' configured
    `params_dtype` (what Float16Module hands a layer in training; some parameters, such as DSA's kept-fp32 ones, are
    not in that dtype) on their device, `begin_pass` called first (a new IndexCache pass): (output, the input's
    gradient)."""
    import torch

    params = [p for layer in layers for p in layer.parameters()]
    device, dtype = params[0].device, layers[0].config.params_dtype
    g = torch.Generator(device=device).manual_seed(0)
    hidden = layers[0].config.hidden_size
    x = torch.randn(seq, batch, hidden, device=device, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(seq, batch, hidden, device=device, generator=g).to(dtype)

    def step() -> tuple:
        x.grad = None
        for p in params:
            p.grad = None
        if begin_pass is not None:
            begin_pass()
        h = x
        for layer in layers:
            out = layer(h, attention_mask=None)
            h = out[0] if isinstance(out, tuple) else out
        h.backward(grad_out)
        return h.detach(), x.grad

    return step


# (routed experts, MoEConfig.dispatch, MoEConfig.expert_activation, MoEConfig.router_gating, MoEConfig.routing,
# ModelConfig.residual_norm) of each `moe layer` variant, the baseline first, each adding one path to the one before.
MOE_LAYER_VARIANTS = {
    "upstream: Megatron local (SequentialMLP experts)": ("sequential", "megatron", "eager", "megatron", "megatron", "torch"),
    "grouped_mm experts": ("grouped", "megatron", "eager", "megatron", "megatron", "torch"),
    "grouped_mm experts + fused-permute dispatch": ("grouped", "fused-permute", "eager", "megatron", "megatron", "torch"),
    "grouped_mm experts + fused-permute dispatch + fused activation": (
        "grouped", "fused-permute", "fused", "megatron", "megatron", "torch"),
    "grouped_mm experts + fused-permute dispatch + fused activation + fused router gating": (
        "grouped", "fused-permute", "fused", "fused", "megatron", "torch"),
    "grouped_mm experts + fused-permute dispatch + fused activation + fused router gating + fused routing": (
        "grouped", "fused-permute", "fused", "fused", "fused", "torch"),
    "grouped_mm experts + fused-permute dispatch + fused activation + fused router gating + fused routing + fused input norm": (
        "grouped", "fused-permute", "fused", "fused", "fused", "fused"),
}
# The variant the one-GPU recipes train with and the one before it: their steps are also profiled kernel by kernel.
PROFILED_MOE_VARIANTS = tuple(MOE_LAYER_VARIANTS)[-2:]


def moe_layer_cases(ctx: Context, shapes: KernelShapes, sweep: KernelSweep) -> list[Row]:
    import torch

    from nam56r.model.model import build_moe_layer
    from nam56r.model.presets import get_preset
    from nam56r.model.specs import resolve_backend

    seq, batch = shapes.seq_length, moe_layer_batch(shapes, sweep)
    config, backend = get_preset(shapes.preset), resolve_backend("auto")
    case = f"moe layer fwd+bwd ({sweep.moe_tokens} tokens)"
    rows, back_to_back, stage_rows, reference, weights = [], [], [], None, None
    for variant, (experts, dispatch, activation, gating, routing, norm) in MOE_LAYER_VARIANTS.items():
        moe = replace(config.moe, dispatch=dispatch, expert_activation=activation, router_gating=gating, routing=routing)
        variant_config = replace(config, moe=moe, residual_norm=norm)
        layer = build_moe_layer(variant_config, backend, device="cuda", params_dtype=torch.bfloat16, experts=experts)
        if weights is None:
            weights = as_trained(layer).state_dict()
        as_trained(layer).load_state_dict(weights)
        layer.train()
        step = _layers_step([layer], batch, seq)
        row, result = measure(case, variant, step, ctx, reference=reference)
        rows.append(row)
        reference = reference if reference is not None else result
        if row.time_ms is not None:
            back_to_back.append(_back_to_back_row(f"moe layer fwd+bwd back-to-back ({sweep.moe_tokens} tokens)", variant, step, ctx))
            stage_rows.append(_moe_stage_row(f"moe layer stages ({sweep.moe_tokens} tokens)", variant, layer, step, ctx))
            if variant in PROFILED_MOE_VARIANTS and not ctx.quick:
                stage_rows.append(_moe_kernel_row(f"moe layer kernels ({sweep.moe_tokens} tokens)", variant, step))
        del layer, step, result
        torch.cuda.empty_cache()
    return rows + back_to_back + stage_rows


BACK_TO_BACK_STEPS = 10


def _back_to_back_row(case: str, variant: str, step: Callable[[], tuple], ctx: Context) -> Row:
    """`step` BACK_TO_BACK_STEPS times in a row with no synchronization between them, as a training step runs its
    layers: the host queues a step's kernels while the GPU still runs the previous one's, so what the `fwd+bwd` row
    counts of the host's launch time between kernels (each of its steps starts from an idle GPU) is hidden wherever
    the GPU has queued work. Median over 3 repeats of the per-step time."""
    from nam56r_bench.harness import cuda_time_ms

    steps = 3 if ctx.quick else BACK_TO_BACK_STEPS
    return Row(case, variant, time_ms=cuda_time_ms(step, warmup=1, iters=3, calls_per_sample=steps), extra={"steps": steps})


# The MoE layer's forward stages, each between two CUDA events recorded at module hooks ("start"/"end" of a
# module's forward). MoELayer runs the shared expert first, then the router, then the dispatcher's permutes,
# the experts, and the unpermutes and the shared expert's add.
MOE_STAGES = {
    "shared expert": ("shared.start", "shared.end"),
    "router (+ aux loss)": ("router.start", "router.end"),
    "dispatch + permute": ("router.end", "experts.start"),
    "experts": ("experts.start", "experts.end"),
    "unpermute + combine": ("experts.end", "moe.end"),
}


def _moe_kernel_row(case: str, variant: str, step: Callable[[], tuple]) -> Row:
    """The layer's forward+backward, kernel by kernel (PyTorch profiler, two steps): the top 15 kernels with their
    share of the step and the GPU-idle share, to say which kernels stand between the layer and its FLOP floor."""
    from nam56r_bench.profile_trace import profile_step

    breakdown = profile_step(step, steps=2, count=15)
    return Row(case, variant, time_ms=breakdown["step_ms"], extra={"profile": breakdown})


def _moe_stage_row(case: str, variant: str, layer, step: Callable[[], tuple], ctx: Context) -> Row:
    """Median ms of each forward stage of `layer` (MOE_STAGES) over a few steps, the whole forward, and the rest
    of `step` (the backward, and the norm and residual): where the layer's time goes."""
    import statistics

    import torch

    moe = layer.mlp
    modules = {"shared": moe.shared_experts, "router": moe.router, "experts": moe.experts}
    events: dict[str, torch.cuda.Event] = {}

    def record(name: str):
        def hook(*_):
            events[name] = torch.cuda.Event(enable_timing=True)
            events[name].record()

        return hook

    handles = [module.register_forward_pre_hook(record(f"{name}.start")) for name, module in modules.items() if module is not None]
    handles += [module.register_forward_hook(record(f"{name}.end")) for name, module in modules.items() if module is not None]
    handles += [moe.register_forward_pre_hook(record("moe.start")), moe.register_forward_hook(record("moe.end"))]
    samples: dict[str, list[float]] = {}
    try:
        for _ in range(3 if ctx.quick else 10):
            events.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times = {stage: events[a].elapsed_time(events[b]) for stage, (a, b) in MOE_STAGES.items() if a in events and b in events}
            times["moe forward"] = events["moe.start"].elapsed_time(events["moe.end"])
            times["rest of step (backward, norm, residual)"] = start.elapsed_time(end) - times["moe forward"]
            for stage, ms in times.items():
                samples.setdefault(stage, []).append(ms)
    finally:
        for handle in handles:
            handle.remove()
    stages = {stage: round(statistics.median(ms), 3) for stage, ms in samples.items()}
    return Row(case, variant, time_ms=stages["moe forward"], extra={"stage_ms": stages})
