"""Parameter counts of a preset, computed from the model Megatron actually builds (meta device).

    python -m nam56r.model.params --preset nam56r
    python -m nam56r.model.params --preset nam56r-h3584 --json counts.json

Prints one row per component (layer type, layers, parameters), then `total: N` and `active: N`.
"Active" is what one token touches in a training forward: everything except the routed experts it
is not sent to ((num_experts - topk) / num_experts of every MoE layer's routed experts). With IndexCache
on, only the Full DSA layers have an indexer (the Shared ones reuse a Full layer's top-k).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from nam56r.model.config import ModelConfig
from nam56r.model.pattern import LayerKind, LayerLayout

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.mtp_model_layer\.layers\.(\d+)\.(.*)$")
_KIND_LABEL = {
    LayerKind.MLA: "mla attention",
    LayerKind.DSA: "dsa attention",
    LayerKind.MOE: "moe",
    LayerKind.MAMBA3: "mamba3",
    LayerKind.MLP: "dense mlp",
    LayerKind.MTP_ATTENTION: "mtp attention (mla)",
}


@dataclass
class ParamCounts:
    preset: str
    rows: dict[str, int] = field(default_factory=dict)  # component -> parameters
    layers: dict[str, int] = field(default_factory=dict)  # component -> number of layers (0: not a layer)
    total: int = 0
    active: int = 0
    inactive: dict[str, int] = field(default_factory=dict)  # why a parameter is not active -> count

    def to_json(self) -> dict:
        return {
            "preset": self.preset, "rows": self.rows, "layers": self.layers,
            "total": self.total, "active": self.active, "inactive": self.inactive,
        }


def component_of(name: str, layout: LayerLayout) -> str:
    """The table row a parameter belongs to, from its name in NAM56RModel."""
    if match := _LAYER.match(name):
        kind, rest = layout.main[int(match.group(1))], match.group(2)
        label = _KIND_LABEL[kind]
        if kind == LayerKind.MOE:
            if ".experts." in f".{rest}":
                return "moe routed experts"
            if rest.startswith("mlp.shared_experts."):
                return "moe shared expert"
            if rest.startswith("mlp.router."):
                return "moe router"
            return "moe norm"
        if kind == LayerKind.DSA and ".core_attention.indexer." in f".{rest}":
            return "dsa indexer"
        return label
    if match := _MTP_LAYER.match(name):
        return _KIND_LABEL[layout.mtp[int(match.group(2))]] if layout.mtp[int(match.group(2))] != LayerKind.MLP else "mtp dense mlp"
    if name.startswith("mtp."):
        return "mtp projection + norms"
    if name.startswith("embedding."):
        return "token embedding"
    if name.startswith("ngram_embedding."):
        return "n-gram hash embedding"
    if name.startswith("decoder.final_norm."):
        return "final norm"
    if name.startswith("output_layer."):
        return "output layer"
    raise ValueError(f"parameter {name!r} belongs to no known NAM56R component; extend nam56r.model.params.component_of")


def _layer_key(name: str) -> tuple[str, ...] | None:
    """Which layer a parameter lives in: a main-decoder layer or an MTP depth (None: not a layer)."""
    if match := _MTP_LAYER.match(name):
        return ("mtp", match.group(1), match.group(2))
    if match := re.match(r"^mtp\.layers\.(\d+)\.", name):
        return ("mtp", match.group(1))
    if match := _LAYER.match(name):
        return ("decoder", match.group(1))
    return None


def count_parameters(config: ModelConfig, backend: str = "local") -> ParamCounts:
    """Build `config` on the meta device and count its parameters by component."""
    from nam56r.model.model import build_model

    built = build_model(config, backend, device="meta")
    layout = built.layout
    counts = ParamCounts(preset=config.name)
    rows: dict[str, int] = defaultdict(int)
    layers_of: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for name, param in built.model.named_parameters():
        component = component_of(name, layout)
        rows[component] += param.numel()
        if (layer := _layer_key(name)) is not None:
            layers_of[component].add(layer)
    counts.rows = dict(rows)
    counts.layers = {component: len(layers_of[component]) for component in rows}
    counts.total = sum(rows.values())
    idle_fraction = (config.moe.num_experts - config.moe.topk) / config.moe.num_experts
    idle_experts = round(rows.get("moe routed experts", 0) * idle_fraction)
    counts.inactive = {f"routed experts not chosen ({config.moe.num_experts - config.moe.topk}/{config.moe.num_experts})": idle_experts}
    counts.active = counts.total - sum(counts.inactive.values())
    return counts


def _fmt(n: int) -> str:
    return f"{n:,}"


def format_table(counts: ParamCounts) -> str:
    width = max(len(c) for c in counts.rows) + 2
    lines = [f"parameters of preset {counts.preset} (built by Megatron on the meta device)", ""]
    lines.append(f"{'layer type':<{width}}{'layers':>7}{'params':>17}{'share':>8}")
    for component, n in sorted(counts.rows.items(), key=lambda kv: -kv[1]):
        layers = counts.layers.get(component) or ""
        lines.append(f"{component:<{width}}{layers!s:>7}{_fmt(n):>17}{n / counts.total:>8.1%}")
    for why, n in counts.inactive.items():
        lines.append(f"inactive per token: {why}: {_fmt(n)}")
    return "\n".join(lines)


def compare_with_claims(counts: ParamCounts, claims: dict[str, int]) -> list[str]:
    """Lines comparing our count with a published claim, explaining gaps over 1%."""
    lines = []
    mtp = sum(n for c, n in counts.rows.items() if c.startswith("mtp"))
    for key, ours in (("total", counts.total), ("active", counts.active)):
        claim = claims[key]
        gap = (ours - claim) / claim
        without_mtp = ours - mtp
        lines.append(
            f"original claim {key}: {_fmt(claim)}; ours {_fmt(ours)} ({gap:+.2%}); "
            f"ours without the MTP heads {_fmt(without_mtp)} ({(without_mtp - claim) / claim:+.2%})"
        )
    idle_claim, idle_ours = claims["total"] - claims["active"], counts.total - counts.active
    lines.append(
        f"total - active (idle routed experts): claim {_fmt(idle_claim)}, ours {_fmt(idle_ours)} "
        f"({(idle_ours - idle_claim) / idle_claim:+.2%}); "
        f"MTP heads (in ours, apparently not in the claim): {_fmt(mtp)}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    from nam56r.model.presets import ORIGINAL_CLAIMS, add_preset_options, preset_from_options

    parser = argparse.ArgumentParser(
        prog="python -m nam56r.model.params", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_preset_options(parser, "model preset to count", "changes 'active'")
    parser.add_argument("--json", type=Path, help="also write the counts as JSON to this file")
    args = parser.parse_args(argv)
    config = preset_from_options(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's import-time notices about missing TE/Apex
        counts = count_parameters(config)
    print(format_table(counts))
    if args.preset in ORIGINAL_CLAIMS:
        print()
        print("\n".join(compare_with_claims(counts, ORIGINAL_CLAIMS[args.preset])))
    if args.json:
        args.json.write_text(json.dumps(counts.to_json(), indent=2) + "\n")
    print(f"total: {counts.total}")
    print(f"active: {counts.active}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
