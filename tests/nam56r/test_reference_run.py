"""A reference GPT run (`--reference`, issue #46) through the launcher's own path, on CPU with the real objects: the
recipe's lowered flags through Megatron's parser, the ranks' model provider building Megatron's GPTModel from them, the
launcher's dry run, its refusals, and the run directory the run readers (summarize, compare, arms) read."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from test_reference_model import foreign_modules
from trainrun_testlib import write_train_run

from nam56r.training.data.layout import DataDir, DataPaths
from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate, transformer_config_from_args
from nam56r.training.recipe import RECIPES, RecipeError, get_recipe
from nam56r.training.recipe_settings import Recompute
from nam56r.training.settings import with_overrides

LAYOUT = DataDir(Path("/data"))
DATA = DataPaths(LAYOUT.train_prefix, LAYOUT.valid_prefix, LAYOUT.tokenizer_dir)
RUN = RunPaths(Path("/runs/r"), Path("/runs/r/checkpoints"), None)
# What makes the reference's tokens line up with the NAM56R run it mirrors: Megatron's parsed values of both.
SAME_RUN = ("micro_batch_size", "global_batch_size", "train_iters", "seq_length", "lr", "min_lr", "lr_decay_style",
            "lr_warmup_iters", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad", "seed", "bf16", "optimizer",
            "train_data_path", "valid_data_path", "tokenizer_model", "eval_interval", "eval_iters", "data_parallel_size")


def _validated(recipe, run: RunPaths = RUN, data: DataPaths = DATA, extra: tuple[str, ...] = ()):
    argv = megatron_flags(recipe, recipe.trained_model("local"), data, run, "local") + list(extra)
    with contextlib.redirect_stdout(io.StringIO()):
        margs = megatron_validate(argv, recipe.world_size)
        return argv, margs, transformer_config_from_args(margs)


@pytest.mark.parametrize("name", ["tiny-1gpu", "proxy-1gpu", "h200x2-ep2", "h200x8-bf16"])
def test_reference_flags_pass_megatrons_parser_and_mirror_the_nam56r_run(megatron_built, name):
    from nam56r.model.reference_model import reference_mismatches

    reference = get_recipe(name, reference=True)
    argv, margs, cfg = _validated(reference)
    assert reference_mismatches(reference.trained_model("local"), margs, cfg) == []
    assert type(cfg).__name__ == "TransformerConfig" and margs.transformer_impl == "local"
    assert not cfg.multi_latent_attention and cfg.num_moe_experts is None and margs.mtp_num_layers is None
    assert not cfg.fused_linear_cross_entropy and margs.hybrid_layer_pattern is None and margs.expert_model_parallel_size == 1
    nam56r = get_recipe(name)
    _, nam56r_args, _ = _validated(nam56r)
    assert {k: getattr(margs, k) for k in SAME_RUN} == {k: getattr(nam56r_args, k) for k in SAME_RUN}


def test_an_extra_flag_that_changes_the_reference_is_caught(megatron_built):
    from nam56r.model.reference_model import reference_mismatches

    reference = get_recipe("tiny-1gpu", reference=True)
    _, margs, cfg = _validated(reference, extra=("--ffn-hidden-size", "512", "--qk-layernorm"))
    found = reference_mismatches(reference.trained_model("local"), margs, cfg)
    assert [line.split(":")[0] for line in found] == ["ffn_hidden_size", "qk_layernorm"]


def test_a_reference_recipe_records_upstreams_paths_and_refuses_what_it_cannot_honour():
    recipe = get_recipe("h200x2-ep2", reference=True, kernels=False)
    assert recipe.reference and recipe.parallel.ep == 1 and recipe.data_parallel == 2
    assert (recipe.kernels.linear_ce, recipe.kernels.backend, recipe.phases.dsa.dense_warmup_steps) == ("logits", "local", 0)
    assert recipe.trained_model().name == "nam56r-proxy-reference"
    for name, overrides, why in [
        ("h200x8-fp8", {}, "fp8-tensorwise on backend 'te'"),
        ("proxy-1gpu", {"recompute": Recompute(mamba=True)}, "drop --recompute mamba"),
        ("proxy-1gpu", {"indexer_recall_interval": 10}, "no DSA indexer to probe"),
        ("proxy-1gpu", {"model": "nam56r-h3584"}, "model nam56r-h3584 has no reference model"),
    ]:
        with pytest.raises(RecipeError, match=why):
            get_recipe(name, kernels=False, reference=True, **overrides)
    with pytest.raises(RecipeError, match="make it with Recipe.as_reference"):
        with_overrides(RECIPES["tiny-1gpu"](), {"reference": True}).check(kernels=False)
    with pytest.raises(ValueError, match="cannot train nam56r-tiny"):
        megatron_flags(get_recipe("tiny-1gpu", reference=True, kernels=False), get_recipe("tiny-1gpu").model_config(), DATA, RUN, "local")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, megatron_built) -> Path:
    """A real HuggingFace BPE tokenizer (byte level, 300 tokens) over this test's own source."""
    from nam56r.training.data.build import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer([Path(__file__).read_text()], 300, out)
    return out


@pytest.fixture
def megatron_globals():
    """Megatron's global args and tokenizer, set as `parse_and_validate_args` sets them for `pretrain`; unset after."""
    from megatron.training.global_vars import set_global_variables, unset_global_variables

    def set_them(args) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            set_global_variables(args)

    yield set_them
    unset_global_variables()


@pytest.mark.parametrize(("name", "device"), [("tiny-1gpu", "cpu"), ("proxy-1gpu", "meta")])
def test_the_ranks_provider_builds_megatrons_gpt_from_the_flags(name, device, tokenizer_dir, tmp_path, megatron_globals, monkeypatch):
    from megatron.core.models.gpt.gpt_model import GPTModel

    import nam56r.model.reference_model
    import nam56r.training.launcher.preflight
    from nam56r.training.launcher.pretrain import reference_model_provider

    recipe = get_recipe(name, reference=True)
    reference = recipe.trained_model("local")
    _, args, _ = _validated(recipe, RunPaths(tmp_path, None, None), DataPaths(DataDir(tmp_path).train_prefix, None, tokenizer_dir))
    Path(args.nam56r_model_config).write_text(json.dumps(reference.to_dict()))  # as the launcher writes it
    megatron_globals(args)
    real_build, builds = nam56r.model.reference_model.build_reference_model, []

    def build_here(*a, device: str, **k):
        builds.append(device)
        return real_build(*a, device=device_here, **k)

    device_here = device
    real_preflight, preflights = nam56r.training.launcher.preflight.run_preflight, []

    def preflight_without_gpu(config, **k):
        preflights.append(config)
        return real_preflight(config, require_gpu=False, **k)

    monkeypatch.setattr(nam56r.model.reference_model, "build_reference_model", build_here)
    monkeypatch.setattr(nam56r.training.launcher.preflight, "run_preflight", preflight_without_gpu)
    model = reference_model_provider(pre_process=True, post_process=True)

    assert builds == ["cuda"] and preflights == [reference]  # the provider's own GPU build, redirected on this CPU machine
    assert type(model) is GPTModel and len(model.decoder.layers) == reference.num_layers
    assert sum(p.numel() for p in model.parameters()) == reference.total_params()
    assert foreign_modules(model) == []
    assert model.config.transformer_impl == "local" and not model.config.fused_linear_cross_entropy


def test_the_preflight_of_a_reference_checks_the_patched_megatron_and_no_fused_kernel(megatron_built):
    from nam56r.training.launcher.preflight import run_preflight

    report = run_preflight(get_recipe("proxy-1gpu", reference=True, kernels=False).trained_model(), require_gpu=False)
    assert [check.name for check in report.checks] == ["patches megatron-lm"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, megatron_built) -> Path:
    from nam56r.training.data.build import CorpusConfig, build, torch_include_dir

    out = tmp_path_factory.mktemp("data") / "cpp"
    build(out, 512, CorpusConfig(sources=(torch_include_dir(),), max_docs=20))
    return out


def test_the_launchers_dry_run_lowers_the_reference(tiny_data, tmp_path):
    import shlex

    from nam56r.training.launcher.train import main as train_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main(["--recipe", "tiny-1gpu", "--reference", "--dry-run", "--data", str(tiny_data), "--run-dir", str(tmp_path / "r")])
    assert code == 0, err.getvalue()
    text = out.getvalue()
    assert "model nam56r-tiny-reference" in text and "its model config matches nam56r-tiny-reference's" in text
    lines = text.splitlines()
    flags = shlex.split(lines[lines.index("command:") + 1])
    flags = flags[flags.index("nam56r.training.launcher.pretrain") + 1:]
    assert flags[flags.index("--num-layers") + 1] == "8" and "--swiglu" in flags
    assert not {"--fused-linear-cross-entropy", "--hybrid-layer-pattern", "--multi-latent-attention"} & set(flags)
    assert flags[flags.index("--train-data-path") + 1] == str(DataDir(tiny_data).train_prefix)


def test_a_reference_run_directory_reads_like_any_other(tmp_path):
    from nam56r.model.reference import FORMULA
    from nam56r.training.runs.compare import read_run
    from nam56r.training.runs.summarize import main as summarize_main

    write_train_run(tmp_path / "ref", range(1, 21), reference=True)
    summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["preset"] == "nam56r-tiny-reference" and summary["flop_formula"] == FORMULA
    recipe = json.loads((tmp_path / "ref" / "recipe.json").read_text())
    assert recipe["reference"] is True
    assert read_run(tmp_path / "ref" / "summary.json", "reference").dense_warmup_steps == 0
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert summarize_main([str(tmp_path / "ref")]) == 0
    assert "nam56r-tiny-reference" in out.getvalue()
