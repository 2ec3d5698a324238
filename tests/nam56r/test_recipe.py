"""Recipes: checks that refuse bad run shapes, and the lowering accepted by Megatron's own parser
with a model config equal to NAM56R's."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from nam56r.model.megatron_fields import architecture_mismatches
from nam56r.training.data.layout import DataDir, DataPaths
from nam56r.training.launcher.flags import (
    REFUSED_FLAGS,
    RunPaths,
    megatron_flags,
    megatron_validate,
    refused_flags,
    transformer_config_from_args,
)
from nam56r.training.launcher.train import main as train_main
from nam56r.training.recipe import RECIPES, Recipe, RecipeError, get_recipe
from nam56r.training.settings import with_overrides

LAYOUT = DataDir(Path("/data"))
DATA = DataPaths(LAYOUT.train_prefix, LAYOUT.valid_prefix, LAYOUT.tokenizer_dir)
RUN = RunPaths(Path("/runs/r"), Path("/runs/r/checkpoints"), None)


def _validated(recipe: Recipe, backend: str = "local", run: RunPaths = RUN):
    argv = megatron_flags(recipe, recipe.model_config(), DATA, run, backend)
    with contextlib.redirect_stdout(io.StringIO()):
        margs = megatron_validate(argv, recipe.world_size)
        return argv, margs, transformer_config_from_args(margs)


@pytest.mark.parametrize("name", ["tiny-1gpu", "proxy-1gpu", "h200x2-ep2", "h200x8-bf16"])
def test_recipe_lowers_to_flags_megatron_accepts_with_our_architecture(megatron_built, name):
    recipe = get_recipe(name)
    argv, margs, cfg = _validated(recipe)
    assert architecture_mismatches(recipe.model_config(), margs, cfg) == []
    assert margs.world_size == recipe.world_size
    assert margs.data_parallel_size == recipe.data_parallel
    assert margs.expert_model_parallel_size == recipe.parallel.ep
    assert margs.micro_batch_size == recipe.batch.micro_batch and margs.global_batch_size == recipe.batch.global_batch
    assert margs.train_iters == recipe.batch.steps
    assert margs.tokenizer_type == "HuggingFaceTokenizer" and not margs.mock_data
    assert margs.ckpt_format == "torch_dist" and margs.save == str(RUN.save)
    assert cfg.fused_linear_cross_entropy is True
    assert cfg.num_layers == recipe.model_config().num_layers
    assert margs.mtp_num_layers == recipe.model_config().mtp.depths


def test_h200x8_recipes_match_the_original_production_topologies():
    bf16, fp8 = get_recipe("h200x8-bf16"), get_recipe("h200x8-fp8")
    shape = [(r.world_size, r.parallel.pp, r.parallel.ep, r.batch.micro_batch, r.kernels.precision) for r in (bf16, fp8)]
    assert shape == [(8, 1, 4, 8, "bf16"), (8, 1, 8, 10, "fp8-tensorwise")]
    assert not bf16.runtime.cuda_graphs and not fp8.runtime.cuda_graphs  # the original found CG unaffordable at PP=1
    assert fp8.kernels.backend == "te"


def test_lowering_drift_is_caught(megatron_built):
    """A dropped architecture flag, or an extra flag that contradicts one, is named by the cross-check,
    in Megatron's config or in its arguments; a runtime row (the MoE dispatcher) may be replaced."""
    recipe = get_recipe("tiny-1gpu")
    argv = megatron_flags(recipe, recipe.model_config(), DATA, RUN, "local")
    i = argv.index("--rope-type")
    del argv[i : i + 2]
    argv += ["--hidden-dropout", "0.1", "--make-vocab-size-divisible-by", "64", "--moe-token-dispatcher-type", "allgather"]
    with contextlib.redirect_stdout(io.StringIO()):
        margs = megatron_validate(argv, 1)
        cfg = transformer_config_from_args(margs)
    problems = architecture_mismatches(recipe.model_config(), margs, cfg)
    assert [p.split(":")[0] for p in problems] == ["rope_type", "hidden_dropout", "make_vocab_size_divisible_by"], problems
    assert problems[1] == "hidden_dropout: flags give 0.1, NAM56R defines 0.0 (set by --hidden-dropout)"


def test_resume_lowers_load_and_exits_on_missing_checkpoint(megatron_built):
    run = RunPaths(Path("/runs/r"), Path("/ckpt"), Path("/ckpt"))
    argv, margs, _ = _validated(get_recipe("tiny-1gpu"), run=run)
    assert margs.load == "/ckpt" and margs.exit_on_missing_checkpoint


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"cuda_graphs": True, "backend": "te"}, "cuda_graphs at pp=1 refused"),
        ({"ep": 3, "gpus_per_node": 3}, "does not divide the 16 experts"),
        ({"micro_batch": 3}, "global_batch 8 is not a multiple of micro_batch"),
        ({"tp": 2, "gpus_per_node": 2}, "tensor parallel 1 only"),
        ({"precision": "fp8-tensorwise", "backend": "local"}, "needs TransformerEngine"),
        ({"compile_mamba_elementwise": True}, "not wired into training"),
        ({"warmup_steps": 500}, "warmup_steps 500 must be below steps 300"),
        ({"micro_batch": 0}, "micro_batch must be >= 1"),
    ],
)
def test_recipe_refuses(overrides, fragment):
    with pytest.raises(RecipeError, match=fragment):
        get_recipe("proxy-1gpu", **overrides)



@pytest.mark.parametrize(
    ("name", "overrides", "data_parallel", "refused"),
    [
        ("h200x8-bf16", {"micro_batch": 2, "global_batch": 24}, 8, True),  # 24 is a multiple of 2, not of 2 x 8
        ("h200x8-bf16", {"micro_batch": 2, "global_batch": 32}, 8, False),
        ("h200x8-bf16", {"micro_batch": 2, "global_batch": 24, "pp": 2}, 4, False),  # tp*pp ranks share a data replica
        ("h200x2-ep2", {"micro_batch": 2, "global_batch": 6}, 2, True),
        ("tiny-1gpu", {"micro_batch": 2, "global_batch": 24, "gpus_per_node": 8}, 8, True),
    ],
)
def test_global_batch_is_a_multiple_of_micro_batch_times_data_parallel(name, overrides, data_parallel, refused):
    """Each step takes micro_batch sequences on every data-parallel rank: global_batch must be a multiple of both."""
    recipe = with_overrides(RECIPES[name](), overrides)
    assert recipe.data_parallel == data_parallel
    if not refused:
        assert recipe.check(kernels=False) is recipe
        return
    with pytest.raises(RecipeError) as err:
        get_recipe(name, kernels=False, **overrides)
    micro, gbs = overrides["micro_batch"], overrides["global_batch"]
    assert err.value.problems == [
        f"global_batch {gbs} is not a multiple of micro_batch x data-parallel = {micro} x {data_parallel}"]


def test_the_launcher_refuses_a_global_batch_short_of_the_data_parallel_ranks(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ["--recipe", "tiny-1gpu", "--dry-run", "--gpus-per-node", "8", "--mbs", "2", "--gbs", "24", "--run-dir", str(tmp_path)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main(argv)
    assert code == 2, out.getvalue() + err.getvalue()
    assert "global_batch 24 is not a multiple of micro_batch x data-parallel = 2 x 8" in err.getvalue()

def test_recipe_reports_every_problem_at_once():
    with pytest.raises(RecipeError) as err:
        with_overrides(get_recipe("proxy-1gpu"), {"micro_batch": 3, "warmup_steps": 999}).check()
    assert len(err.value.problems) == 2


def test_cuda_graphs_allowed_with_pipeline_stages_on_te():
    recipe = get_recipe("h200x2-ep2", cuda_graphs=True, backend="te", pp=2, ep=1)
    assert recipe.runtime.cuda_graphs and recipe.parallel.pp == 2


def test_unknown_recipe_and_field_are_named():
    with pytest.raises(KeyError, match="unknown recipe 'nope'"):
        get_recipe("nope")
    with pytest.raises(KeyError, match=r"unknown settings \['batch'\]"):
        get_recipe("tiny-1gpu", batch=3)


def test_overrides_of_none_keep_the_recipe():
    assert get_recipe("proxy-1gpu", steps=None, ep=None) == RECIPES["proxy-1gpu"]()


def test_refused_flags_found_in_either_spelling():
    assert refused_flags(["--mock-data"]) == ["mock data"]
    assert refused_flags(["--tokenizer-type", "NullTokenizer"]) == ["the null tokenizer"]
    assert refused_flags(["--tokenizer-type=NullTokenizer"]) == ["the null tokenizer"]
    assert refused_flags(["--lr", "1e-4"]) == []


def test_model_config_round_trips_through_json():
    import json

    from nam56r.model.config import ModelConfig

    model = get_recipe("h200x8-bf16").model_config()
    assert model.index_cache.enabled
    assert ModelConfig.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({**model.to_dict(), "hiden_size": 1})


def test_overlap_dp_comm_lowers_to_megatrons_grad_reduce_overlap_and_needs_data_parallel(megatron_built):
    recipe = get_recipe("h200x2-ep2", overlap_dp_comm=True)
    argv, margs, _ = _validated(recipe)
    assert margs.overlap_grad_reduce and not margs.overlap_param_gather and margs.use_distributed_optimizer
    assert refused_flags([*argv, "--overlap-param-gather"]) == [REFUSED_FLAGS["--overlap-param-gather"]]
    _, margs, _ = _validated(get_recipe("h200x2-ep2"))
    assert not margs.overlap_grad_reduce and not margs.overlap_param_gather
    with pytest.raises(RecipeError, match="runs data parallel 1"):
        get_recipe("proxy-1gpu", overlap_dp_comm=True)


def test_moe_shared_expert_overlap_lowers_to_megatrons_flag_beside_its_all_to_all_only(megatron_built):
    _, margs, cfg = _validated(get_recipe("h200x2-ep2", moe_shared_expert_overlap=True))
    assert margs.moe_shared_expert_overlap and cfg.moe_shared_expert_overlap and cfg.moe_token_dispatcher_type == "alltoall"
    with pytest.raises(RecipeError, match="moe_dispatch 'fused-permute' has no communication to overlap"):
        get_recipe("proxy-1gpu", moe_shared_expert_overlap=True)


def test_reshardable_checkpoints_lower_to_megatrons_fully_reshardable_optimizer_state(megatron_built):
    _, margs, _ = _validated(get_recipe("h200x8-bf16", gpus_per_node=4, reshardable_checkpoints=True))
    assert margs.use_distributed_optimizer and margs.dist_ckpt_optim_fully_reshardable
    _, margs, _ = _validated(get_recipe("h200x8-bf16", gpus_per_node=4))
    assert not margs.dist_ckpt_optim_fully_reshardable
    # one rank has no distributed optimizer: its optimizer state is per parameter already, and no flag is needed
    argv, _, _ = _validated(get_recipe("proxy-1gpu", reshardable_checkpoints=True))
    assert "--dist-ckpt-optim-fully-reshardable" not in argv and "--use-distributed-optimizer" not in argv
