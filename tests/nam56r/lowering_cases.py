"""Recipe x launcher-option cases whose lowering to Megatron flags is pinned in golden/lowering.json: each case is
a launcher command line; its outcome is the flags `megatron_flags` gives on the local and te backends, or the
recipe's refusal. `python tests/nam56r/lowering_cases.py` rewrites the file from the code as it is (run it only
when a lowering change is intended, and review the diff)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

GOLDEN = Path(__file__).with_name("golden") / "lowering.json"
RECIPE_NAMES = ("tiny-1gpu", "proxy-1gpu", "h200x2-ep2", "h200x8-bf16", "h200x8-fp8")
# One launcher option (or a few together) away from each recipe's own settings.
OPTION_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("--model", "nam56r-tiny"),
    ("--mbs", "2", "--gbs", "32"),
    ("--gbs", "24"),
    ("--steps", "500", "--warmup", "50"),
    ("--seq", "1024"),
    ("--ep", "2", "--moe-dispatch", "megatron"),
    ("--pp", "2"),
    ("--nodes", "2"),
    ("--gpus-per-node", "4"),
    ("--lr", "0.001"),
    ("--dense-warmup-steps", "0"),
    ("--indexer-recall-interval", "25"),
    ("--save-interval", "7"),
    ("--backend", "local"),
    ("--index-cache", "off"),
    ("--dsa-indexer", "megatron"),
    ("--dsa-indexer", "fused"),
    ("--moe-dispatch", "megatron"),
    ("--expert-activation", "eager"),
    ("--residual-norm", "torch"),
    ("--router-gating", "megatron"),
    ("--moe-routing", "megatron"),
    ("--overlap-dp-comm", "on"),
    ("--moe-shared-expert-overlap", "on", "--moe-dispatch", "megatron"),
    ("--reshardable-ckpt", "on"),
    ("--cuda-graphs", "on"),
    ("--linear-ce", "liger"),
    ("--linear-ce", "logits"),
    ("--recompute", "mamba,moe"),
    ("--recompute", "all"),
)


def case_ids() -> list[tuple[str, tuple[str, ...]]]:
    return [(name, options) for name in RECIPE_NAMES for options in OPTION_SETS]


def lower(name: str, options: tuple[str, ...]) -> dict:
    """The case's outcome: {"local": flags, "te": flags} or {"refused": [problems]}."""
    from nam56r.training.data.layout import DataDir, DataPaths
    from nam56r.training.launcher.flags import RunPaths, megatron_flags
    from nam56r.training.launcher.train import recipe_from
    from nam56r.training.launcher.train_args import parse_args
    from nam56r.training.recipe import RecipeError

    layout = DataDir(Path("/data"))
    data = DataPaths(layout.train_prefix, layout.valid_prefix, layout.tokenizer_dir)
    run = RunPaths(Path("/runs/r"), Path("/runs/r/checkpoints"), None)
    args, _ = parse_args(["--recipe", name, *options], "")
    try:
        recipe = recipe_from(args, kernels=False)
    except RecipeError as exc:
        return {"refused": exc.problems}
    outcome = {}
    for backend in ("local", "te"):
        try:
            resolved = recipe.on_backend(backend)
            outcome[backend] = megatron_flags(resolved, resolved.model_config(backend), data, run, backend)
        except RecipeError as exc:
            outcome[backend] = {"refused": exc.problems}
    return outcome


def compute() -> list[dict]:
    return [{"recipe": name, "options": list(options), "outcome": lower(name, options)} for name, options in case_ids()]


if __name__ == "__main__":
    GOLDEN.write_text("[\n" + ",\n".join(json.dumps(case) for case in compute()) + "\n]\n")
    print(f"wrote {GOLDEN} ({len(case_ids())} cases)", file=sys.stderr)
