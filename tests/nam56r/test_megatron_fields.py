"""The architecture table (`nam56r.model.megatron_fields`): every preset's facts against their reviewed
copy, and the flags the presets leave out through Megatron's own parser.

Both lowerings (Megatron's config for builds outside training, the training flags) come from the one
table, so no comparison of the two can see a row dropped or altered there (tests/nam56r/test_provider_build.py
holds them to each other). `megatron_architecture.json` is each preset's architecture as reviewed: a
change to it is a change to the model, made in the same commit as the table's or the preset's.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

from nam56r.model.megatron_fields import ARCH_FIELDS, architecture_flags, architecture_mismatches
from nam56r.model.presets import PRESETS, get_preset

REVIEWED = Path(__file__).with_name("megatron_architecture.json")
_NONE = "<none>"


def _typed(facts: dict, field: str):
    value = facts.get(field, _NONE)
    return value if value is _NONE else (type(value).__name__, value)


def test_every_preset_has_its_reviewed_architecture():
    reviewed = json.loads(REVIEWED.read_text())
    assert sorted(reviewed) == sorted(PRESETS), f"{REVIEWED.name} reviews {sorted(reviewed)}; the presets are {sorted(PRESETS)}"
    for name, facts in reviewed.items():
        table = {row.field: row.of(get_preset(name)) for row in ARCH_FIELDS}
        changes = [
            f"{field}: the table gives {_typed(table, field)}, reviewed {_typed(facts, field)}"
            for field in sorted(set(table) | set(facts))
            if _typed(table, field) != _typed(facts, field)
        ]
        assert not changes, f"{name}'s architecture changed; if that is meant, make {REVIEWED} say so:\n  " + "\n  ".join(changes)


def test_flags_left_out_give_megatrons_default_and_it_is_the_configs_value(megatron_built):
    """The presets pass every switch one way and a shared expert; the other way (the flag left out)
    must give the config's value too, through Megatron's parser and config."""
    from nam56r.training.data.layout import DataPaths
    from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate, transformer_config_from_args
    from nam56r.training.recipe import get_recipe

    tiny = get_preset("nam56r-tiny")
    other_way = replace(
        tiny,
        moe=replace(tiny.moe, shared_expert_ffn=0, expert_bias=False),
        dsa=replace(tiny.dsa, sparse_indexer_loss=False, rotate_activation=True),
        mtp=replace(tiny.mtp, depths=0),
    )
    left_out = set(architecture_flags(tiny)) - set(architecture_flags(other_way))
    assert {"--moe-shared-expert-intermediate-size", "--moe-router-enable-expert-bias", "--dsa-indexer-use-sparse-loss"} <= left_out
    assert "--no-dsa-indexer-rotate-activation" in left_out
    data, run = DataPaths(Path("/d/train"), None, Path("/d/tok")), RunPaths(Path("/r"), None, None)
    argv = megatron_flags(get_recipe("tiny-1gpu"), other_way, data, run, "local")
    with contextlib.redirect_stdout(io.StringIO()):
        args = megatron_validate(argv, 1)
        cfg = transformer_config_from_args(args)
    assert architecture_mismatches(other_way, args, cfg) == []
    assert (cfg.moe_shared_expert_intermediate_size, cfg.moe_router_enable_expert_bias, cfg.mtp_num_layers) == (None, False, None)
    assert (cfg.dsa_indexer_use_sparse_loss, cfg.dsa_indexer_rotate_activation) == (False, True)
