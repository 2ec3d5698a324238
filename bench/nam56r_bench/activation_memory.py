"""Where a NAM56R micro-batch's saved activations go: bytes autograd keeps for backward, per layer type, on a CPU.

    python -m nam56r_bench.activation_memory                       # the full model as h200x2-ep2 trains it, table
    python -m nam56r_bench.activation_memory --json out.json --top 12
    python -m nam56r_bench.activation_memory --preset nam56r-tiny --lengths 64 128

It builds one layer of each type from the model's own specs at the preset's widths (Mamba-3 'M', full MLA,
DSA with and without its indexer (IndexCache's Full and Shared layers), MoE 'E', the MTP heads' dense MLP '-',
the n-gram embedding), casts it as Float16Module does, runs its training forward on a [seq, 1, hidden] bf16 input at
two sequence lengths under a `SavedTensorLedger` (nam56r_bench.activation_ledger), and splits each layer's bytes
into a slope (bytes per token, times the target length: what each further sequence of a micro-batch adds) and an
intercept (bytes saved once per micro-batch, such as weight copies). Kernels that only run on a GPU are replaced by stand-ins
whose autograd Functions save what the GPU ones save (nam56r_bench.activation_stand_ins); the Triton kernels run
under Triton's interpreter, so the process sets TRITON_INTERPRET=1 before anything imports triton.

The heads outside the layers (the LM head's and MTP heads' chunked linear CE, the MTP wrapper's norms and eh_proj
input, the token embedding's ids) are counted from their sources' `save_for_backward` calls: `HEAD_BYTES_PER_TOKEN`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 1024**3


@dataclass(frozen=True)
class LayerCount:
    """One layer type's saved bytes at the measured lengths, and per sequence of `target` tokens."""

    name: str
    count: int  # layers of this type in one forward (main decoder and MTP heads)
    bytes_at: dict[int, int]  # sequence length -> saved bytes (activations and saved inputs) of one sequence
    target: int
    recompute_keeps: int = 0  # bytes at `target` that the family's recompute still keeps (its layer/mixer input)
    top: list[dict[str, Any]] = field(default_factory=list)  # largest saved storages at the longest length
    by_module: dict[str, int] = field(default_factory=dict)

    @property
    def per_token(self) -> float:
        (s0, b0), (s1, b1) = sorted(self.bytes_at.items())[:1] + sorted(self.bytes_at.items())[-1:]
        return (b1 - b0) / (s1 - s0)

    @property
    def per_sequence(self) -> float:
        """Bytes one more sequence of `target` tokens adds: the slope, what a larger micro-batch pays."""
        return self.per_token * self.target

    @property
    def per_microbatch(self) -> float:
        """The intercept: saved bytes that do not grow with the tokens (weight copies saved once per micro-batch)."""
        s0, b0 = min(self.bytes_at.items())
        return b0 - self.per_token * s0

    @property
    def total(self) -> float:
        return self.count * self.per_sequence


def model_config(recipe: str, preset: str) -> Any:
    """The ModelConfig `recipe` trains with `preset` as its model, on the local backend (the measured runs')."""
    from nam56r.training.recipe import get_recipe

    return get_recipe(recipe, kernels=False, model=preset).model_config("local")


def _bf16(layer: Any, mcfg: Any) -> Any:
    from megatron.core.transformer.module import Float16Module

    return Float16Module(mcfg, layer).module.train()


def build_layers(config: Any) -> dict[str, tuple[Any, Callable[[Any, Any], Any]]]:
    """name -> (bf16 layer, call(layer, x)) for one layer of each type, built from the model's specs on CPU."""
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from nam56r.model.model import build_moe_layer, cuda_buffers_on, megatron_config, single_process_groups
    from nam56r.model.pattern import LayerKind, layout_of
    from nam56r.model.specs import hybrid_stack_spec

    layout, pg = layout_of(config), single_process_groups()
    mcfg = megatron_config(config, params_dtype=torch.bfloat16)  # training's params_dtype under --bf16
    spec = hybrid_stack_spec(config, "local").submodules

    def plain(layer: Any, x: Any) -> Any:
        return layer(x, attention_mask=None)

    layers: dict[str, tuple[Any, Callable[[Any, Any], Any]]] = {}
    for name, kind, sub in (("mamba3 M", LayerKind.MAMBA3, spec.mamba_layer), ("mla *", LayerKind.MLA, spec.mla_layer),
                            ("mtp mlp -", None, spec.mlp_layer)):
        number = layout.layer_numbers(kind)[0] if kind else config.num_layers
        torch.manual_seed(0)
        extra = {} if kind == LayerKind.MAMBA3 else {"add_layer_offset": False}  # as HybridStack builds each
        with cuda_buffers_on("cpu"):
            layer = build_module(sub, config=mcfg, layer_number=number, pg_collection=pg, **extra)
        layers[name] = (_bf16(layer, mcfg), plain)
    layers["moe E"] = (_bf16(build_moe_layer(config, "local", device="cpu", params_dtype=torch.bfloat16), mcfg), plain)
    layers.update(_dsa_layers(config))
    if config.ngram.enabled:
        layers["ngram embedding"] = _ngram(config, mcfg)
    return layers


def _dsa_layers(config: Any) -> dict[str, tuple[Any, Callable[[Any, Any], Any]]]:
    """An IndexCache Full DSA layer (its indexer runs) and a Shared one (reads the Full layer's top-k), run in one pass."""
    import torch

    from nam56r.model.model import build_dsa_layers

    built = build_dsa_layers(config, "local", device="cpu", params_dtype=torch.bfloat16)
    numbers = sorted(built.layers)
    full = numbers[0]
    shared = next((n for n in numbers if built.index_cache_plan and built.index_cache_plan.source_of(n) == full and n != full), None)
    mcfg = built.layers[full].config
    # What a GPU build sets after construction (the fused TileLang paths, declines raised).
    mcfg.dsa_kernel_backend, mcfg.dsa_strict_fused_paths = config.dsa.kernel_backend, config.dsa.kernel_backend != "none"
    full_layer = _bf16(built.layers[full], mcfg)
    out: dict[str, tuple[Any, Callable[[Any, Any], Any]]] = {}

    def run_full(layer: Any, x: Any) -> Any:
        if built.topk_cache is not None:
            built.topk_cache.begin_forward()
        return layer(x, attention_mask=None)

    out["dsa D (indexer)"] = (full_layer, run_full)
    if shared is not None:
        def run_shared(layer: Any, x: Any) -> Any:
            with torch.no_grad():  # the Full layer fills the cache; only the Shared layer's graph is counted
                run_full(full_layer, x.detach())
            return layer(x, attention_mask=None)

        out["dsa D (shared top-k)"] = (_bf16(built.layers[shared], mcfg), run_shared)
    return out


def _ngram(config: Any, mcfg: Any) -> tuple[Any, Callable[[Any, Any], Any]]:
    import torch

    from nam56r.model.embedding import NgramHashEmbedding

    module = NgramHashEmbedding(config.ngram, config.hidden_size, params_dtype=torch.bfloat16, init_std=config.init_std)

    def call(layer: Any, x: Any) -> Any:
        ids = torch.randint(0, config.vocab_size, (x.shape[1], x.shape[0]))
        return layer(ids).transpose(0, 1).to(x.dtype) + x

    return module.train(), call


def measure(layer: Any, call: Callable[[Any, Any], Any], hidden: int, seq: int) -> Any:
    """The ledger of one training forward of `layer` on a bf16 [seq, 1, hidden] input that requires grad."""
    import torch

    from nam56r.model.model import cuda_buffers_on
    from nam56r_bench.activation_ledger import SavedTensorLedger
    from nam56r_bench.activation_stand_ins import gpu_kernel_stand_ins

    torch.manual_seed(1)
    x = torch.randn(seq, 1, hidden, dtype=torch.bfloat16).requires_grad_()
    with gpu_kernel_stand_ins(), cuda_buffers_on("cpu"), SavedTensorLedger(layer, [x]) as ledger:
        out = call(layer, x)
    del out
    return ledger


def _recompute_keeps(name: str, ledger: Any) -> int:
    """What the family's recompute keeps of the layer: MoE and Mamba-3 checkpoints keep the layer's (the MoE layer's
    input, the mixer's) input; attention's selective recompute is not modelled here (0)."""
    if name.startswith("moe"):
        return ledger.bytes(("input",))
    if name.startswith("mamba3"):
        return sum(s.nbytes for s in ledger.storages.values() if s.module == "mixer.mamba3.in_proj" and s.kind == "activation")
    return 0


def layer_counts(config: Any) -> dict[str, int]:
    """How many of each measured layer one forward runs (IndexCache Full/Shared split; MTP heads' MLA and MLP)."""
    from nam56r.model.model import index_cache_plan
    from nam56r.model.pattern import LayerKind, layout_of

    layout = layout_of(config)
    counts = layout.counts()
    dsa = counts.get(LayerKind.DSA, 0)
    plan = index_cache_plan(config, layout)
    full = sum(plan.is_full(n) for n in layout.layer_numbers(LayerKind.DSA)) if plan else dsa
    return {
        "mamba3 M": counts.get(LayerKind.MAMBA3, 0),
        "mla *": counts.get(LayerKind.MLA, 0) + counts.get(LayerKind.MTP_ATTENTION, 0),
        "dsa D (indexer)": full,
        "dsa D (shared top-k)": dsa - full,
        "moe E": counts.get(LayerKind.MOE, 0),
        "mtp mlp -": counts.get(LayerKind.MLP, 0),
        "ngram embedding": 1 if config.ngram.enabled else 0,
    }


def head_bytes_per_token(config: Any) -> dict[str, int]:
    """Per-token saved bytes outside the layers, from the sources' save_for_backward (bf16, 2 bytes an element):
    torch RMSNorm saves its input and an fp32 rstd; the chunked linear CE (nam56r_kernels.linear_cross_entropy) its
    gradient w.r.t. the hidden states (bf16 [T, h]), fp32 token weights and a bool mask (its [V, h] weight gradient is
    per micro-batch, `HEAD_BYTES_PER_MICROBATCH`); each MTP depth's eh_proj its [T, 2h] concatenated input beside the
    enorm/hnorm inputs; the token embedding and each depth's rolled ids are int64."""
    h, depths = config.hidden_size, config.mtp.depths
    norm = 2 * h + 4
    ce = 2 * h + 4 + 1
    return {"LM head (final norm + chunked CE)": norm + ce + 8,
            "MTP wrappers (enorm, hnorm, eh_proj input, final norm, CE, ids)": depths * (3 * norm + 4 * h + ce + 8)}


def account(config: Any, lengths: tuple[int, int], target: int, top: int = 10,
            only: tuple[str, ...] = ()) -> tuple[list[LayerCount], dict[str, int]]:
    """Measure every layer type (or those named in `only`) and return the per-type counts and the heads' bytes per
    token."""
    counts = layer_counts(config)
    rows = []
    for name, (layer, call) in build_layers(config).items():
        if only and name not in only:
            continue
        ledgers = {seq: measure(layer, call, config.hidden_size, seq) for seq in lengths}
        last = ledgers[max(lengths)]
        keeps = _recompute_keeps(name, last) * target // max(lengths)
        rows.append(LayerCount(name=name, count=counts[name], bytes_at={s: lg.bytes() for s, lg in ledgers.items()},
                               target=target, recompute_keeps=keeps,
                               top=[_describe(s) for s in last.top(top)], by_module=last.by_module(depth=3)))
    return rows, head_bytes_per_token(config)


def _describe(storage: Any) -> dict[str, Any]:
    return {"module": storage.module, "shape": list(storage.shape), "dtype": str(storage.dtype).replace("torch.", ""),
            "bytes": storage.nbytes, "kind": storage.kind}


def table(rows: list[LayerCount], heads: dict[str, int], target: int) -> str:
    """Markdown: per layer type, per-token and per-sequence bytes, layer count and total; heads; the sum."""
    lines = [f"| layer type | layers | saved KiB/token | GiB per layer per {target}-token sequence | GiB per sequence, all layers | "
             "of which its recompute keeps (GiB) | per micro-batch, all layers (GiB) |", "|---|---|---|---|---|---|---|"]
    total = 0.0
    for r in rows:
        total += r.total
        lines.append(f"| {r.name} | {r.count} | {r.per_token / 1024:.1f} | {r.per_sequence / GIB:.3f} | {r.total / GIB:.2f} | "
                     f"{r.count * r.recompute_keeps / GIB:.2f} | {r.count * r.per_microbatch / GIB:.2f} |")
    for name, per_token in heads.items():
        total += per_token * target
        lines.append(f"| {name} | | {per_token / 1024:.1f} | | {per_token * target / GIB:.2f} | | |")
    lines.append(f"| **sum** | | | | **{total / GIB:.2f}** | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nam56r_bench.activation_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="h200x2-ep2", help="recipe whose kernel paths the layers take (default h200x2-ep2)")
    parser.add_argument("--preset", default="nam56r", help="model preset (default nam56r, the full model)")
    parser.add_argument("--lengths", type=int, nargs=2, default=(256, 512), metavar=("S0", "S1"),
                        help="the two sequence lengths measured (default 256 512; at least the DSA top-k)")
    parser.add_argument("--target", type=int, default=4096, help="sequence length the bytes are extrapolated to")
    parser.add_argument("--top", type=int, default=8, help="largest saved tensors listed per layer type")
    parser.add_argument("--only", action="append", default=[], help="measure only this layer type (repeatable)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "triton" in sys.modules and os.environ["TRITON_INTERPRET"] != "1":
        parser.error("run in a fresh process: Triton was imported without TRITON_INTERPRET=1")
    config = model_config(args.recipe, args.preset)
    rows, heads = account(config, tuple(args.lengths), args.target, args.top, tuple(args.only))
    print(table(rows, heads, args.target))
    for r in rows:
        print(f"\n{r.name}: largest saved storages at {max(r.bytes_at)} tokens")
        for t in r.top:
            print(f"  {t['bytes'] / 2**20:9.2f} MiB  {t['dtype']:8} {str(t['shape']):24} {t['kind']:10} {t['module']}")
    if args.json:
        data = {"recipe": args.recipe, "preset": args.preset, "target": args.target, "heads_bytes_per_token": heads,
                "rows": [asdict(r) | {"per_token": r.per_token, "per_sequence": r.per_sequence,
                                 "per_microbatch": r.per_microbatch, "total": r.total} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
