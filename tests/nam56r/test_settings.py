"""Settings declared once: a switch declared in a group reaches the launcher's options, --help, the overrides, the
banner, the Megatron flags, the benchmark rows' settings and the README's table, with nothing else written for it."""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from nam56r.training import settings as st
from nam56r.training.launcher.train_args import OPTIONS_BEGIN, OPTIONS_END, markdown_options
from nam56r.training.recipe import Recipe, get_recipe
from nam56r.training.settings import setting

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Switches:
    fast_path: bool = setting(False, cli="--fast-path", megatron="--use-fast-path", recorded=True,
                              help="the fast path (Megatron's --use-fast-path)")
    width: int = setting(4, cli="--width", help="how wide")


@dataclass(frozen=True)
class Plan:
    name: str
    switches: Switches = field(default_factory=Switches)

    GROUP_TITLES = {"switches": "runtime switches"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plan")
    st.add_options(parser, Plan, overrides=True)
    return parser


def test_a_declared_switch_is_an_option_an_override_a_flag_a_recorded_setting_a_banner_entry_and_a_table_row() -> None:
    parser = _parser()
    args = parser.parse_args(["--fast-path", "on"])
    assert st.overrides_from(args, Plan) == {"fast_path": True}
    plan = st.with_overrides(Plan("p"), st.overrides_from(args, Plan))
    assert plan.switches == Switches(fast_path=True, width=4)
    assert st.switch_flags(plan) == ["--use-fast-path"] and st.switch_flags(Plan("p")) == []
    assert st.settings_in(asdict(plan), Plan) == {"fast_path": True}
    assert st.banner_lines(plan) == ["runtime switches: fast-path on, width 4"]
    table = "\n".join(st.option_table(parser))
    assert "| `--fast-path {on,off}` | the fast path (Megatron's --use-fast-path) | off |" in table
    assert "--fast-path {on,off}" in parser.format_help() and "runtime switches:" in parser.format_help()


def test_a_bad_value_is_a_usage_error_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--fast-path", "yes"])
    assert "invalid on_off value: 'yes'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--width", "wide"])
    assert "invalid int value: 'wide'" in capsys.readouterr().err


def test_two_settings_of_one_key_are_refused() -> None:
    @dataclass(frozen=True)
    class Twice:
        a: Switches = field(default_factory=Switches)
        b: Switches = field(default_factory=Switches)

    with pytest.raises(TypeError, match=r"setting keys declared twice: \['fast_path', 'width'\]"):
        st.leaves(Twice)


def test_an_unknown_override_is_named() -> None:
    with pytest.raises(KeyError, match=r"unknown settings \['depth'\]; known: fast_path, width"):
        st.with_overrides(Plan("p"), {"depth": 3})


def test_every_declared_megatron_switch_of_the_recipe_lowers_to_its_flag() -> None:
    """Each recipe switch with `megatron=` is on in a recipe that allows it, and its flag is in the lowering."""
    from nam56r.training.data.layout import DataDir, DataPaths
    from nam56r.training.launcher.flags import RunPaths, megatron_flags

    layout = DataDir(Path("/data"))
    data = DataPaths(layout.train_prefix, layout.valid_prefix, layout.tokenizer_dir)
    run = RunPaths(Path("/runs/r"), None, None)
    recipe = get_recipe("h200x2-ep2", kernels=False, overlap_dp_comm=True, moe_shared_expert_overlap=True).on_backend("local")
    switches = [leaf for leaf in st.leaves(Recipe) if leaf.declared.megatron]
    assert {leaf.key for leaf in switches} == {"overlap_dp_comm", "moe_shared_expert_overlap"}
    flags = megatron_flags(recipe, recipe.model_config("local"), data, run, "local")
    assert all(leaf.declared.megatron in flags for leaf in switches)
    off = get_recipe("h200x2-ep2", kernels=False).on_backend("local")
    assert not any(leaf.declared.megatron in megatron_flags(off, off.model_config("local"), data, run, "local") for leaf in switches)


def test_the_readme_holds_the_generated_option_table() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(re.escape(OPTIONS_BEGIN) + ".*?" + re.escape(OPTIONS_END), readme, re.S)
    assert block is not None, "README.md lost its option-table markers"
    assert block.group(0) == markdown_options(), "regenerate it: python -m nam56r.training.launcher.train_args --markdown"


def test_help_names_the_default_and_each_preset_that_sets_another() -> None:
    parser = argparse.ArgumentParser(prog="plan")
    st.add_options(parser, Plan, overrides=True, presets=[Plan("slow"), Plan("quick", Switches(fast_path=True, width=8))])
    rows = "\n".join(st.option_table(parser))
    assert "| `--fast-path {on,off}` | the fast path (Megatron's --use-fast-path) | off; quick on |" in rows
    assert "| `--width` | how wide | 4; quick 8 |" in rows
