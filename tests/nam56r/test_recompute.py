"""Activation recompute per block family: the recipe switches, their lowering through Megatron's own parser
and config, the switches on the real layers Megatron builds, what is refused, and the Mamba-3 wrapper's
numerics (forward and backward equal with and without recompute, and recomputed for real)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nam56r.training.data.layout import DataDir, DataPaths
from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate, recompute_mismatches, transformer_config_from_args
from nam56r.training.recipe import RECIPES, RecipeError, get_recipe
from nam56r.training.recipe_checks import recompute_problems
from nam56r.training.recipe_settings import Recompute

DATA = DataPaths(DataDir(Path("/data")).train_prefix, None, DataDir(Path("/data")).tokenizer_dir)
RUN = RunPaths(Path("/runs/r"), None, None)


def _validated(recipe, extra: tuple[str, ...] = ()):
    argv = megatron_flags(recipe, recipe.model_config(), DATA, RUN, "local") + list(extra)
    with contextlib.redirect_stdout(io.StringIO()):
        margs = megatron_validate(argv, recipe.world_size)
        return argv, margs, transformer_config_from_args(margs)


def test_the_launcher_spelling_parses_to_families():
    assert Recompute.parse("none") == Recompute()
    assert Recompute.parse("all") == Recompute(mamba=True, moe=True, attention=True)
    assert Recompute.parse("moe, mamba") == Recompute(mamba=True, moe=True)
    assert str(Recompute(mamba=True, attention=True)) == "mamba,attention" and str(Recompute()) == "none"
    for bad in ("", "mlp", "mamba,none"):
        with pytest.raises(ValueError, match="give none, all, or families"):
            Recompute.parse(bad)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_recompute_nothing_by_default(megatron_built, name):
    """Today's behaviour is kept: no recompute flag, Megatron's config recomputes nothing, the mixers keep activations."""
    recipe = get_recipe(name)
    assert recipe.recompute == Recompute() and not recipe.model_config().mamba.recompute
    if recipe.kernels.precision == "fp8-tensorwise":
        return  # Megatron's validation of FP8 needs TransformerEngine
    argv, margs, cfg = _validated(recipe)
    assert not any(flag.startswith("--recompute") for flag in argv)
    assert cfg.recompute_granularity is None and margs.recompute_granularity is None


@pytest.mark.parametrize(
    ("switches", "granularity", "modules"),
    [
        ("mamba", None, None),
        ("moe", "selective", ["moe"]),
        ("attention", "selective", ["core_attn", "mla_up_proj"]),
        ("all", "selective", ["core_attn", "mla_up_proj", "moe"]),
    ],
)
def test_each_switch_lowers_to_what_megatron_accepts(megatron_built, switches, granularity, modules):
    recipe = get_recipe("proxy-1gpu", recompute=Recompute.parse(switches))
    argv, margs, cfg = _validated(recipe)
    assert cfg.recompute_granularity == granularity and margs.recompute_granularity == granularity
    if modules is not None:
        assert cfg.recompute_modules == modules
    assert cfg.recompute_method is None and cfg.recompute_num_layers is None
    assert recipe.model_config().mamba.recompute is recipe.recompute.mamba  # Megatron has no Mamba switch: the model config carries it
    assert recompute_mismatches(recipe, cfg) == []


def test_a_full_recompute_beside_the_switches_is_refused_and_alone_passes(megatron_built):
    full = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    recipe = get_recipe("tiny-1gpu", recompute=Recompute(mamba=True))
    _, _, cfg = _validated(recipe, full)
    assert cfg.recompute_granularity == "full"
    assert recompute_mismatches(recipe, cfg) == [
        "--recompute-granularity full checkpoints whole layers of every family; it cannot be mixed with --recompute mamba: "
        "pass one or the other"
    ]
    plain = get_recipe("tiny-1gpu")
    assert recompute_mismatches(plain, _validated(plain, full)[2]) == []  # Megatron's own full recompute, switches off


def test_extra_flags_that_replace_the_switches_modules_are_refused(megatron_built):
    recipe = get_recipe("tiny-1gpu", recompute=Recompute(moe=True, attention=True))
    _, _, cfg = _validated(recipe, ("--recompute-modules", "core_attn"))
    (problem,) = recompute_mismatches(recipe, cfg)
    assert problem.startswith("--recompute moe,attention lowers to selective recompute of mla_up_proj, moe, which the extra flags")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"recompute": Recompute(attention=True), "precision": "fp8-tensorwise", "backend": "te"}, "assert FP8 off"),
        ({"recompute": Recompute(attention=True), "index_cache": True, "pp": 2, "gpus_per_node": 2, "global_batch": 16},
         "would read the top-k of a later micro-batch"),
        ({"recompute": Recompute(mamba=True), "cuda_graphs": True, "backend": "te", "pp": 2, "gpus_per_node": 2, "global_batch": 16},
         "recompute mamba with CUDA graphs"),
    ],
)
def test_recipe_refuses_recompute_that_cannot_work(overrides, fragment):
    with pytest.raises(RecipeError, match=fragment):
        get_recipe("proxy-1gpu", **overrides)


def test_a_family_the_model_lacks_is_refused():
    recipe = get_recipe("tiny-1gpu")
    no_mamba = replace(recipe.model_config(), name="no-mamba", pattern_unit="*EE", pattern_tail="")
    switched = replace(recipe, recompute=Recompute(mamba=True, moe=True))
    assert recompute_problems(switched, no_mamba) == [
        f"recompute mamba: model no-mamba has no mamba layers ({no_mamba.pattern}); drop it from --recompute"
    ]


def _build_from_flags(recipe, device: str = "meta"):
    """The model as `pretrain`'s provider builds it: Megatron's config from the lowered flags, our model config
    through the JSON file the launcher writes."""
    from nam56r.model.config import ModelConfig
    from nam56r.model.model import build_model

    _, _, cfg = _validated(recipe)
    model_config = ModelConfig.from_dict(json.loads(json.dumps(recipe.model_config().to_dict())))
    return build_model(model_config, "local", device=device, megatron_cfg=cfg).model


@pytest.mark.parametrize("switches", ["none", "mamba", "moe", "attention", "all"])
def test_the_switches_reach_the_real_layers(megatron_built, switches):
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    from nam56r.model.pattern import LayerKind, layout_of

    recompute = Recompute.parse(switches)
    model = _build_from_flags(get_recipe("tiny-1gpu", recompute=recompute))
    mixers = [m.mixer for m in model.modules() if isinstance(m, MambaLayer)]
    moes = [m for m in model.modules() if isinstance(m, MoELayer)]
    attentions = [m for m in model.modules() if isinstance(m, MultiLatentAttention | AbsorbedMLASelfAttention)]  # MTP heads' too
    counts = layout_of(model.model_config).counts()
    assert (len(mixers), len(moes)) == (counts[LayerKind.MAMBA3], counts[LayerKind.MOE])
    assert len(attentions) == counts[LayerKind.MLA] + counts[LayerKind.DSA] + counts[LayerKind.MTP_ATTENTION]
    assert all(m.recompute is recompute.mamba for m in mixers)
    assert all(m.moe_layer_recompute is recompute.moe for m in moes)
    assert all(a.checkpoint_core_attention is recompute.attention and a.recompute_up_proj is recompute.attention for a in attentions)


class _Block(torch.nn.Module):
    """A small real module with saved activations and random numbers in its forward (dropout)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down, self.calls = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width), 0

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        return self.down(torch.nn.functional.dropout(torch.nn.functional.gelu(self.up(x)), p=0.3)) * scale


def _saved_tensor_count(fn) -> int:
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return count


def test_checkpointed_gives_the_same_outputs_and_gradients_and_recomputes(megatron_built):
    from nam56r.model.recompute import checkpointed

    torch.manual_seed(0)
    block, x0 = _Block(), torch.randn(5, 3, 16)

    def run(wrapped: bool):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.manual_seed(1)  # the same dropout mask on both sides; the recompute must reproduce it too
        out = checkpointed(block, x, scale=2.0) if wrapped else block(x, scale=2.0)
        out.square().sum().backward()
        return out.detach(), x.grad, [p.grad for p in block.parameters()]

    calls = block.calls
    plain = run(False)
    assert block.calls == calls + 1
    wrapped = run(True)
    assert block.calls == calls + 3  # the forward, then its recompute in the backward
    torch.testing.assert_close(wrapped[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(wrapped[1], plain[1], rtol=0, atol=0)
    for got, want in zip(wrapped[2], plain[2], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    x = x0.clone().requires_grad_()
    kept_plain = _saved_tensor_count(lambda: block(x))
    kept_wrapped = _saved_tensor_count(lambda: checkpointed(block, x))
    assert kept_wrapped < kept_plain, (kept_wrapped, kept_plain)  # what the switch is for


def test_checkpointed_recomputes_under_megatrons_rng_tracker_state_of_the_forward(megatron_built):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from nam56r.model.recompute import checkpointed

    tracker = get_cuda_rng_tracker()
    saved_states, saved_init = tracker.get_states(), tracker.is_initialized()
    seen = []

    def record(x):
        seen.append(tracker.get_states()["model-parallel-rng"].clone())
        return x.square()  # saves its input: the backward needs the recompute

    try:
        tracker.set_states({"model-parallel-rng": torch.tensor([1], dtype=torch.uint8)})
        out = checkpointed(record, torch.ones(3, requires_grad=True))
        tracker.set_states({"model-parallel-rng": torch.tensor([2], dtype=torch.uint8)})  # as a later layer's fork leaves it
        out.sum().backward()
        assert [s.item() for s in seen] == [1, 1]  # the recompute saw the forward's state
        assert tracker.get_states()["model-parallel-rng"].item() == 2  # and the backward's was put back
    finally:
        tracker.set_states(saved_states)
        tracker._is_initialized = saved_init


class _Mamba3StandIn(torch.nn.Module):
    """CPU stand-in with Mamba3's call (`[b, s, h]`, cu_seqlens): the real one runs TileLang/Triton kernels on a GPU."""

    def __init__(self, block: _Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, u: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        assert cu_seqlens is None
        return self.block(u)


def test_the_mamba3_mixer_runs_its_mixer_checkpointed_only_while_training(megatron_built):
    from nam56r.model.mamba3_mixer import Mamba3Mixer
    from nam56r.model.model import megatron_config, single_process_groups
    from nam56r.model.presets import get_preset

    tiny = get_preset("nam56r-tiny")
    mixers = {
        on: Mamba3Mixer(megatron_config(tiny), tiny.hidden_size, 3, single_process_groups(), mamba=replace(tiny.mamba, recompute=on))
        for on in (False, True)
    }
    torch.manual_seed(0)
    block, x0 = _Block(tiny.hidden_size), torch.randn(6, 2, tiny.hidden_size)  # [s, b, h]
    grads = {}
    for on, mixer in mixers.items():
        assert mixer.recompute is on
        mixer.mamba3 = _Mamba3StandIn(block)
        mixer.train()
        block.zero_grad(set_to_none=True)
        x, calls = x0.clone().requires_grad_(), block.calls
        torch.manual_seed(1)
        out, bias = mixer(x)
        out.sum().backward()
        assert bias is None and out.shape == x.shape
        assert block.calls - calls == (2 if on else 1)
        grads[on] = (out.detach(), x.grad, [p.grad.clone() for p in block.parameters()])
    torch.testing.assert_close(grads[True][:2], grads[False][:2], rtol=0, atol=0)
    torch.testing.assert_close(grads[True][2], grads[False][2], rtol=0, atol=0)
    mixer = mixers[True]
    for mode in ("eval", "no_grad"):
        calls = block.calls
        mixer.eval() if mode == "eval" else mixer.train()
        with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
            mixer(x0)
        assert block.calls - calls == 1, mode  # nothing to recompute outside a training backward
