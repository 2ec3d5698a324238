"""nam56r_bench.kernel_shapes: the kernels suite's model sizes are the preset's fields, and at the nam56r
preset they are the sizes its cases have always been measured at (the rows stay comparable across runs)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields, replace

import pytest
from nam56r_bench.kernel_shapes import (
    FULL_SWEEP,
    MAMBA3_A_FLOOR,
    QUICK_SWEEP,
    KernelShapes,
    dsa_layer_config,
    kernel_shapes,
    kernel_sweep,
)

from nam56r.model.presets import PRESETS, get_preset


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_kernel_shapes_are_the_presets_fields(preset: str) -> None:
    config, shapes = get_preset(preset), kernel_shapes(preset)
    assert shapes == KernelShapes(
        preset=preset,
        seq_length=config.seq_length,
        hidden_size=config.hidden_size,
        norm_epsilon=config.norm_epsilon,
        vocab_size=config.vocab_size,
        mtp_depths=config.mtp.depths,
        indexer_heads=config.dsa.indexer_heads,
        indexer_head_dim=config.dsa.indexer_head_dim,
        dsa_topk=config.dsa.topk,
        num_experts=config.moe.num_experts,
        expert_topk=config.moe.topk,
        expert_ffn=config.moe.expert_ffn,
        mamba_heads=config.mamba.expand * config.hidden_size // config.mamba.head_dim,
        mamba_a_floor=MAMBA3_A_FLOOR,
    )


def test_the_suite_measures_nam56r_at_the_sizes_it_always_has() -> None:
    shapes = kernel_shapes()
    assert shapes.preset == "nam56r"
    assert (shapes.seq_length, shapes.hidden_size, shapes.vocab_size, shapes.mtp_depths) == (4096, 4096, 131072, 2)
    assert (shapes.indexer_heads, shapes.indexer_head_dim, shapes.dsa_topk) == (32, 64, 256)
    assert (shapes.num_experts, shapes.expert_topk, shapes.expert_ffn) == (16, 4, 896)
    assert (shapes.mamba_heads, shapes.mamba_a_floor) == (128, 1e-4)


def test_mamba3s_a_floor_is_mamba_ssms_default() -> None:
    """NAM56R's mixer leaves Mamba3's A_floor at its default, which the bench names as MAMBA3_A_FLOOR."""
    import inspect

    mamba3 = pytest.importorskip("mamba_ssm.modules.mamba3")
    assert inspect.signature(mamba3.Mamba3.__init__).parameters["A_floor"].default == MAMBA3_A_FLOOR


def test_an_unknown_preset_is_refused_with_the_known_ones() -> None:
    with pytest.raises(KeyError, match="unknown preset 'nam56r-huge'; known: nam56r"):
        kernel_shapes("nam56r-huge")


def test_the_sweep_is_the_micro_batches_and_tokens_the_case_names_carry() -> None:
    assert kernel_sweep(quick=False) == FULL_SWEEP and kernel_sweep(quick=True) == QUICK_SWEEP
    assert (FULL_SWEEP.dsa_score_batches, FULL_SWEEP.dsa_topk_batch, FULL_SWEEP.moe_tokens) == ((1, 8), 8, 32768)
    assert (FULL_SWEEP.ce_batch, FULL_SWEEP.mamba_batch, FULL_SWEEP.dsa_layer_batch) == (8, 8, 1)
    assert all(getattr(QUICK_SWEEP, f.name) <= getattr(FULL_SWEEP, f.name) for f in fields(QUICK_SWEEP) if f.name != "dsa_score_batches")


def test_the_dsa_layer_cases_model_is_the_preset_with_only_the_indexer_path_and_index_cache_set() -> None:
    preset = get_preset("nam56r")
    for indexer in ("megatron", "fused"):
        for index_cache in (False, True):
            config = dsa_layer_config("nam56r", indexer, index_cache)
            assert config == replace(preset, dsa=replace(preset.dsa, indexer=indexer),
                                     index_cache=replace(preset.index_cache, enabled=index_cache))
    assert (config.seq_length, config.dsa.topk, config.dsa.kernel_backend, config.index_cache.share_group) == (4096, 256, "tilelang", 3)


def test_the_dsa_layer_cases_measure_every_indexer_path(megatron_built) -> None:
    from nam56r_bench.kernel_suite import CASES
    from nam56r_bench.layer_cases import DSA_LAYER_VARIANTS, dsa_layer_cases

    from nam56r.model.config import DSA_INDEXER_PATHS

    assert tuple(DSA_LAYER_VARIANTS) == DSA_INDEXER_PATHS
    assert dsa_layer_cases in CASES


def test_the_dsa_layer_plan_measures_each_path_and_index_cache_against_megatrons_layers(megatron_built) -> None:
    from nam56r_bench.harness import BASELINE_PREFIXES
    from nam56r_bench.layer_cases import dsa_layer_plan

    from nam56r.model.config import DSA_INDEXER_PATHS

    runs = dsa_layer_plan(kernel_shapes(), FULL_SWEEP)
    single, group = sorted({run.case for run in runs}, key=[run.case for run in runs].index)
    assert single == "dsa layer fwd+bwd seq4096 mb1"
    assert group == "dsa layers fwd+bwd seq4096 mb1, 3 layers, IndexCache 1 Full + 2 Shared"
    by_case = {case: [run for run in runs if run.case == case] for case in (single, group)}
    # Each case: one baseline, first, on Megatron's indexer without IndexCache; then every path.
    for case, case_runs in by_case.items():
        baselines = [run for run in case_runs if run.variant.startswith(BASELINE_PREFIXES)]
        assert baselines == case_runs[:1] and (baselines[0].indexer, baselines[0].index_cache) == ("megatron", False), case
    assert [(r.indexer, r.index_cache, r.layers) for r in by_case[single]] == [(p, False, 1) for p in DSA_INDEXER_PATHS]
    group_runs = [(r.indexer, r.index_cache, r.layers) for r in by_case[group]]
    assert group_runs == [("megatron", False, 3)] + [(p, True, 3) for p in DSA_INDEXER_PATHS]
    assert "dsa_kernel_backend=tilelang" in by_case[single][0].variant
    # Errors only between runs of the same model: never across IndexCache on and off.
    variants = {(run.case, run.variant): run for run in runs}
    for run in runs:
        if run.error_against is not None:
            reference = variants[(run.case, run.error_against)]
            assert reference.index_cache == run.index_cache and reference.indexer == "megatron", run
    assert [run.error_against is None for run in by_case[group]] == [True, True, False, False]


# The `dsa layer` cases' step on CPU (Triton's interpreter) at nam56r-tiny's widths, 48 tokens, top-16.
DSA_LAYER_STEP_SCRIPT = """
import torch
from nam56r.model.model import build_dsa_layers, cuda_buffers_on
from nam56r_bench.layer_cases import _layers_step
from tests.nam56r.test_dsa_fused_indexer import layer_config

outputs = []
for indexer in ("megatron", "fused"):
    built = build_dsa_layers(layer_config(indexer, index_cache=True), "local")
    layers = [built.layers[n] for n in sorted(built.layers)]
    if outputs:
        for layer, state in zip(layers, states, strict=True):
            layer.load_state_dict(state)
    states = [layer.state_dict() for layer in layers]
    for layer in layers:
        layer.train()
    with cuda_buffers_on("cpu"):
        out, x_grad = _layers_step(layers, 2, 48, built.topk_cache.begin_forward)()
    assert out.shape == x_grad.shape == (48, 2, layers[0].config.hidden_size) and bool(torch.isfinite(x_grad).all())
    outputs.append((out, x_grad))
# The same computation on both paths, equal up to fp32 rounding: a loaded 2-core CI host has shown the two differ by
# 2.4e-7 in 5 % of the elements, as CPU GEMMs may split their sums differently from run to run.
torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
print("dsa layer step ok")
"""


def test_the_dsa_layer_cases_step_runs_both_paths_to_the_same_result(run_interpreted, megatron_built) -> None:
    assert "dsa layer step ok" in run_interpreted(DSA_LAYER_STEP_SCRIPT, timeout=600)


def test_the_kernel_suite_imports_without_torch_or_megatron() -> None:
    """`--list` and the CPU suites import every suite module: the kernel suite must not pull in torch or Megatron."""
    code = ("import sys, nam56r_bench.kernel_suite, nam56r_bench.kernel_shapes; "
            "print(sorted(m for m in ('torch', 'megatron', 'nam56r_kernels') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_the_moe_layer_cases_run_the_sweeps_tokens_as_whole_sequences() -> None:
    from nam56r_bench.kernel_shapes import moe_layer_batch

    shapes = kernel_shapes()
    assert moe_layer_batch(shapes, FULL_SWEEP) * shapes.seq_length == FULL_SWEEP.moe_tokens == 32768
    assert moe_layer_batch(shapes, QUICK_SWEEP) * shapes.seq_length == QUICK_SWEEP.moe_tokens
    with pytest.raises(ValueError, match="not a whole number of 4096-token sequences"):
        moe_layer_batch(shapes, replace(FULL_SWEEP, moe_tokens=5000))


def test_the_moe_layer_cases_compare_megatrons_sequential_experts_with_ours(megatron_built) -> None:
    from nam56r_bench.harness import BASELINE_PREFIXES
    from nam56r_bench.kernel_suite import CASES
    from nam56r_bench.layer_cases import MOE_LAYER_VARIANTS, PROFILED_MOE_VARIANTS, moe_layer_cases

    from nam56r.model.config import (
        EXPERT_ACTIVATION_PATHS,
        MOE_DISPATCH_PATHS,
        MOE_ROUTING_PATHS,
        RESIDUAL_NORM_PATHS,
        ROUTER_GATING_PATHS,
    )
    from nam56r.model.specs import MOE_EXPERTS
    from nam56r.training.recipe import get_recipe

    assert moe_layer_cases in CASES
    paths = list(zip(*MOE_LAYER_VARIANTS.values(), strict=True))
    assert [set(p) for p in paths] == [set(MOE_EXPERTS), set(MOE_DISPATCH_PATHS), set(EXPERT_ACTIVATION_PATHS),
                                       set(ROUTER_GATING_PATHS), set(MOE_ROUTING_PATHS), set(RESIDUAL_NORM_PATHS)]
    assert [v.startswith(BASELINE_PREFIXES) for v in MOE_LAYER_VARIANTS] == [True] + [False] * (len(MOE_LAYER_VARIANTS) - 1)
    # Megatron's layer as it ships
    assert MOE_LAYER_VARIANTS[next(iter(MOE_LAYER_VARIANTS))] == ("sequential", "megatron", "eager", "megatron", "megatron", "torch")
    # the last variant is the one-GPU recipes' path on the local backend, and it is profiled
    model = get_recipe("proxy-1gpu").model_config(backend="local")
    moe, last = model.moe, list(MOE_LAYER_VARIANTS)[-1]
    assert MOE_LAYER_VARIANTS[last] == ("grouped", moe.dispatch, moe.expert_activation, moe.router_gating, moe.routing,
                                        model.residual_norm)
    assert last in PROFILED_MOE_VARIANTS and set(PROFILED_MOE_VARIANTS) <= set(MOE_LAYER_VARIANTS)


def test_kernel_cases_runs_only_the_named_case_groups_in_suite_order(monkeypatch, tmp_path) -> None:
    from nam56r_bench import kernel_suite
    from nam56r_bench.harness import Context, Row

    ran: list[str] = []

    def group(name: str):
        return lambda ctx, shapes, sweep: ran.append(name) or [Row(name, "v", time_ms=1.0)]

    monkeypatch.setattr(kernel_suite, "require_gpu", lambda suite: None)
    monkeypatch.setattr(kernel_suite, "kernel_shapes", lambda: None)
    monkeypatch.setattr(kernel_suite, "kernel_sweep", lambda quick: None)
    monkeypatch.setattr(kernel_suite, "CASE_GROUPS", {name: group(name) for name in kernel_suite.CASE_GROUPS})
    rows = kernel_suite.run(Context(out_dir=tmp_path, quick=True, kernel_cases=("moe-layer", "dsa")))
    assert ran == ["dsa", "moe-layer"] and [row.case for row in rows] == ran
    ran.clear()
    kernel_suite.run(Context(out_dir=tmp_path, quick=True))
    assert ran == list(kernel_suite.CASE_GROUPS)
