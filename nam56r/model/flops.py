"""Training FLOPs per token of NAM56R, by component, computed from its `ModelConfig`.

    python -m nam56r.model.flops --preset nam56r --seq 4096 --global-batch 64

Megatron's own `num_floating_point_operations` knows neither Mamba-3's MIMO scan, DSA's indexer
and sparse attention, IndexCache, nor the n-gram embedding, so its TFLOP/s/GPU figure does not
describe NAM56R. This module is the formula our throughput figures use (`nam56r.training.runs.summary`).

Counting rules (one token = one position of one sequence; "per token" is the sequence average):

* A weight GEMM costs 2 FLOPs per weight per token forward (multiply + add). Training runs it
  3 times (forward, input gradient, weight gradient): **6 x the weights a token multiplies**. The
  one exception is the DSA indexer: Megatron detaches its inputs (`x.detach()`, `qr.detach()` in
  `DSAttention.forward`), so its projections get a weight gradient but no input gradient: 4 x.
* Activation-activation work (attention scores and values, indexer scores, the SSM scan) is its
  forward GEMMs x 3 (the same forward + two backward GEMMs rule) unless said otherwise below. It
  is the "model FLOPs" convention: recomputation inside a kernel's backward is not counted.
* Causal attention averages **s/2 keys per query** (Megatron's convention: its formulas halve
  the s^2 term for the causal mask), so per-token causal work grows linearly with s.
* Not counted (they are not GEMMs, or are gathers): the token embedding and n-gram table lookups,
  norms, activations, softmax, rotary embeddings, the router's top-k, the losses themselves.
* MoE is dropless: each token runs exactly `moe.topk` routed experts.

Per component (h hidden, s sequence length, H heads; all per token, fwd+bwd):

* Mamba-3: 6 x (in_proj + out_proj weights), plus the chunked MIMO scan, see `mamba3_scan_forward`.
* MLA (full causal): 6 x projection weights, plus 3 x 2 x H x (qk + rope + v) x s/2 (both are
  Megatron's own MLA terms, less its norm "+1"s).
* DSA: 6 x projection weights (absorbed MLA uses the same weights once per token), plus the sparse
  attention over the selected keys in the latent space (scores over kv_lora + rope channels,
  values over kv_lora): 3 x 2 x H x (2 kv_lora + rope) x k_eff, k_eff = min(topk, s/2). For
  s >> topk that is topk, independent of s: the TileLang sparse-MLA kernel runs all topk slots of
  every query (early queries' slots are masked, -1, not skipped); the exact causal average,
  topk x (1 - (topk - 1) / (2 s)), would be 3% lower at s = 4096 with topk 256. Below s = 2 topk
  the indexer can select every causal key, and the causal count s/2 applies.
* DSA indexer, only in layers that compute the top-k (all DSA layers, or IndexCache's Full
  layers; Shared layers skip the indexer, its loss and its projections): 4 x its projection
  weights, plus the index scores 3 x 2 x H_I x (D_I + 1) x s/2 (q.k per index head, then the
  weighted sum over heads); with `indexer_loss_coeff == 0` it runs under no_grad: 2 x and 1 x.
* DSA indexer loss target: the KL target is the main attention's distribution; Megatron computes
  it from detached query/key (forward only, 1 x): 2 x H x (kv_lora + rope) x s/2 per query with
  Megatron's default dense loss (`dsa_indexer_use_sparse_loss=False`, which nam56r.model.model keeps),
  x k_eff instead of s/2 with the sparse loss.
* MoE: 6 x (router + shared expert + top-k routed experts' weights).
* MTP depths: 6 x (eh_proj + MLA projections + dense MLP + the shared output layer, once per
  depth), plus their MLA's causal attention.
* LM head 6 x h x vocab; the n-gram hash embedding's projection 6 x features x h.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from nam56r.model.config import Mamba3Config, ModelConfig
from nam56r.model.pattern import LayerKind, layout_of

# Written into run summaries; change it whenever the counting rules above change.
FORMULA = "nam56r.flops v1 (6 x active matmul weights, causal s/2, DSA k_eff=min(topk, s/2), model FLOPs)"

FWD_BWD = 3  # forward, input gradient, weight gradient: three GEMMs of the same size
MATMUL = 2 * FWD_BWD  # FLOPs per weight per token in training
MATMUL_NO_DGRAD = 2 + 2  # forward + weight gradient only (inputs detached)


@dataclass(frozen=True)
class ComponentFlops:
    """One table row: the training FLOPs per token of one component, summed over its layers."""

    name: str
    layers: int  # layers this row sums over (0: not a layer)
    params_row: str | None  # the nam56r.model.params row whose weights `matmul_params` counts
    matmul_params: int  # weight elements one token multiplies (active only), summed over uses
    flops_per_param: int  # 6 (fwd + dgrad + wgrad), 4 (no dgrad) or 2 (forward only)
    sequence: float  # activation-activation FLOPs per token (attention, indexer scores, scan)

    @property
    def matmul(self) -> int:
        return self.flops_per_param * self.matmul_params

    @property
    def total(self) -> float:
        return self.matmul + self.sequence


@dataclass(frozen=True)
class FlopBreakdown:
    """Training FLOPs per token of a config at one sequence length, by component."""

    preset: str
    seq_length: int
    components: tuple[ComponentFlops, ...]

    @property
    def total(self) -> float:
        return sum(c.total for c in self.components)

    @property
    def matmul(self) -> int:
        return sum(c.matmul for c in self.components)

    @property
    def sequence(self) -> float:
        return sum(c.sequence for c in self.components)

    def __getitem__(self, name: str) -> ComponentFlops:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(f"no component {name!r} in the breakdown of {self.preset}; components: {', '.join(self.names)}")

    def __contains__(self, name: object) -> bool:
        return any(c.name == name for c in self.components)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)

    def to_json(self) -> dict:
        return {
            "formula": FORMULA,
            "preset": self.preset,
            "seq_length": self.seq_length,
            "flops_per_token": self.total,
            "components": [
                {"name": c.name, "layers": c.layers, "matmul": c.matmul, "sequence": c.sequence, "total": c.total} for c in self.components
            ],
        }


def causal_keys_per_query(seq_length: int) -> float:
    """Average keys a query attends to under a causal mask, by Megatron's convention (s/2)."""
    return seq_length / 2


def sparse_keys_per_query(topk: int, seq_length: int) -> float:
    """Keys per query of DSA's sparse attention: topk once s >> topk, never more than causal."""
    return min(topk, causal_keys_per_query(seq_length))


def mamba3_matmul_params(m: Mamba3Config, hidden_size: int) -> int:
    """in_proj + out_proj weights of one mamba_ssm Mamba3 layer (its other parameters are
    per-head vectors used elementwise). in_proj's output is [z, x, B, C, dd_dt, dd_A, trap, angles]."""
    d_inner = m.expand * hidden_size
    rank = m.mimo_rank if m.mimo else 1
    rope_split = int(m.d_state * m.rope_fraction)
    rope_angles = (rope_split - rope_split % 2) // 2
    in_proj = hidden_size * (2 * d_inner + 2 * m.d_state * m.ngroups * rank + 3 * m.num_heads(hidden_size) + rope_angles)
    return in_proj + d_inner * hidden_size


def mamba3_scan_forward(m: Mamba3Config, hidden_size: int) -> int:
    """Forward FLOPs per token of one layer's chunked MIMO scan: the GEMMs of mamba_ssm's TileLang
    MIMO forward kernel (`ops/tilelang/mamba3/mamba3_mimo_fwd.py`), per chunk and head.

    A chunk of L = chunk_size steps and R = mimo_rank ranks is one block of C = L*R rows of
    queries Q (C, N = d_state), keys K (C, N) and values (C, P = head_dim); the state is (N, P).
    Per chunk and head the kernel runs five GEMMs:

        Q K^T (diagonal trapezoid term)   2 C^2 N
        Q S   (output from the carried state)   2 C N P
        Q K^T (rotated, intra-chunk)      2 C^2 N
        (masked Q K^T) V                  2 C^2 P
        K^T V (state update)              2 C N P

    Per token (divide by L) and per head: 4 L R^2 N + 2 L R^2 P + 4 R N P. The intra-chunk terms
    grow with L and R^2 but not with s, so the scan is linear in s like the projections. The
    kernel computes whole C x C blocks (the causal mask is applied afterwards), so the block is not
    halved. SISO (mimo=False) is counted as rank 1. The backward kernels re-run these five GEMMs
    and add ten more (14 C^2 N + 10 C^2 P + 16 C N P in all, about 4 x forward for NAM56R's
    sizes); `flops_per_token` counts 3 x forward, the model-FLOPs convention.
    """
    L, N, P = m.chunk_size, m.d_state, m.head_dim
    R = m.mimo_rank if m.mimo else 1
    return m.num_heads(hidden_size) * (4 * L * R * R * N + 2 * L * R * R * P + 4 * R * N * P)


def _mla_matmul_params(config: ModelConfig) -> int:
    """Projection weights of one MLA layer (also one DSA layer: absorbed MLA has the same weights)."""
    h, a = config.hidden_size, config.mla
    q = h * a.q_lora_rank + a.q_lora_rank * a.num_heads * (a.qk_head_dim + a.qk_rope_head_dim)
    kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * a.num_heads * (a.qk_head_dim + a.v_head_dim)
    return q + kv + a.num_heads * a.v_head_dim * h


def _mla_causal_forward(config: ModelConfig, seq_length: int) -> float:
    """QK^T and softmax(QK^T)V of one full MLA layer, per token, forward."""
    a = config.mla
    return 2 * a.num_heads * (a.qk_head_dim + a.qk_rope_head_dim + a.v_head_dim) * causal_keys_per_query(seq_length)


def _expert_params(config: ModelConfig, ffn: int) -> int:
    return 2 * config.hidden_size * ffn  # fc1 (h -> ffn) + fc2 (ffn -> h), non-gated


def indexer_layers(config: ModelConfig) -> tuple[int, int]:
    """(DSA layers that run the indexer, DSA layers): all of them, or IndexCache's Full layers."""
    from nam56r_kernels.index_cache import IndexCachePlan

    dsa_layers = layout_of(config).layer_numbers(LayerKind.DSA)
    if not config.index_cache.enabled:
        return len(dsa_layers), len(dsa_layers)
    return len(IndexCachePlan.build(dsa_layers, config.index_cache.share_group).full_layers), len(dsa_layers)


def flops_per_token(config: ModelConfig, seq_length: int) -> FlopBreakdown:
    """Training FLOPs per token of `config` at `seq_length`, by component (rules: module docstring)."""
    if not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length must be a positive integer, got {seq_length!r}")
    if config.moe.gated:
        raise ValueError(
            f"config {config.name!r} has moe.gated=True, but nam56r.model.model builds non-gated experts "
            "(gated_linear_unit=False); count FLOPs for the model that is built"
        )
    layout = layout_of(config)
    if unsupported := set(layout.mtp) - {LayerKind.MTP_ATTENTION, LayerKind.MLP}:
        raise ValueError(
            f"MTP pattern {config.mtp.pattern!r} has {sorted(unsupported)} layers; "
            "nam56r.model.flops counts MTP attention and dense MLP only"
        )
    kinds = (LayerKind.MAMBA3, LayerKind.MLA, LayerKind.DSA, LayerKind.MOE, LayerKind.MLP)
    n_mamba, n_mla, n_dsa, n_moe, n_mlp = (layout.main.count(kind) for kind in kinds)
    depths = config.mtp.depths
    n_mtp_attention = depths * layout.mtp.count(LayerKind.MTP_ATTENTION)
    n_mtp_mlp = depths * layout.mtp.count(LayerKind.MLP)
    n_indexers, _ = indexer_layers(config)
    h, s, a, dsa, moe = config.hidden_size, seq_length, config.mla, config.dsa, config.moe

    # Per layer and token: weights multiplied, and forward activation-activation FLOPs.
    mla_params = _mla_matmul_params(config)
    mla_causal = _mla_causal_forward(config, s)
    mamba_params, mamba_scan = mamba3_matmul_params(config.mamba, h), mamba3_scan_forward(config.mamba, h)
    dsa_sparse = 2 * a.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim) * sparse_keys_per_query(dsa.topk, s)
    indexer_params = a.q_lora_rank * dsa.indexer_heads * dsa.indexer_head_dim + h * dsa.indexer_head_dim + h * dsa.indexer_heads
    index_scores = 2 * dsa.indexer_heads * (dsa.indexer_head_dim + 1) * causal_keys_per_query(s)
    target_keys = sparse_keys_per_query(dsa.topk, s) if dsa.sparse_indexer_loss else causal_keys_per_query(s)
    loss_target = 2 * a.num_heads * (a.kv_lora_rank + a.qk_rope_head_dim) * target_keys
    indexer_trained = dsa.indexer_loss_coeff > 0  # else Megatron runs the indexer under no_grad
    n_loss_targets = n_indexers if indexer_trained else 0
    ngram = config.ngram
    ngram_features = len(ngram.orders) * ngram.heads * ngram.embed_dim if ngram.enabled else 0

    def row(name: str, layers: int, params_row: str | None, params: int, sequence: float = 0.0, per_param: int = MATMUL) -> ComponentFlops:
        return ComponentFlops(name, layers, params_row, params, per_param, sequence)

    rows = [
        row("mamba3", n_mamba, "mamba3", n_mamba * mamba_params, n_mamba * FWD_BWD * mamba_scan),
        row("mla attention", n_mla, "mla attention", n_mla * mla_params, n_mla * FWD_BWD * mla_causal),
        row("dsa attention", n_dsa, "dsa attention", n_dsa * mla_params, n_dsa * FWD_BWD * dsa_sparse),
        row(
            "dsa indexer",
            n_indexers,
            "dsa indexer",
            n_indexers * indexer_params,
            n_indexers * (FWD_BWD if indexer_trained else 1) * index_scores,
            MATMUL_NO_DGRAD if indexer_trained else 2,
        ),
        row("dsa indexer loss target", n_loss_targets, None, 0, n_loss_targets * loss_target),  # forward only: detached inputs
        row("moe router", n_moe, "moe router", n_moe * moe.num_experts * h),
        row("moe shared expert", n_moe, "moe shared expert", n_moe * _expert_params(config, moe.shared_expert_ffn)),
        row("moe routed experts", n_moe, "moe routed experts", n_moe * moe.topk * _expert_params(config, moe.expert_ffn)),
        row("dense mlp", n_mlp, "dense mlp", n_mlp * _expert_params(config, config.mtp.dense_ffn)),
        row(
            "mtp attention (mla)",
            n_mtp_attention,
            "mtp attention (mla)",
            n_mtp_attention * mla_params,
            n_mtp_attention * FWD_BWD * mla_causal,
        ),
        row("mtp dense mlp", n_mtp_mlp, "mtp dense mlp", n_mtp_mlp * _expert_params(config, config.mtp.dense_ffn)),
        row("mtp eh_proj", depths, "mtp projection + norms", depths * 2 * h * h),
        row("mtp lm heads", depths, "output layer", depths * h * config.vocab_size),  # the shared output layer, once per depth
        row("lm head", 0, "output layer", h * config.vocab_size),
        row("n-gram hash projection", 0, "n-gram hash embedding", ngram_features * h),
    ]
    kept = tuple(r for r in rows if r.total > 0)
    return FlopBreakdown(preset=config.name, seq_length=seq_length, components=kept)


def step_flops(config: ModelConfig, seq_length: int, global_batch_size: int) -> float:
    """Training FLOPs of one optimizer step: global_batch_size sequences of seq_length tokens."""
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    return flops_per_token(config, seq_length).total * seq_length * global_batch_size


def format_table(breakdown: FlopBreakdown, global_batch_size: int) -> str:
    total = breakdown.total
    width = max(len(n) for n in breakdown.names) + 2
    lines = [
        f"training FLOPs per token of preset {breakdown.preset} at seq {breakdown.seq_length} (fwd + bwd; {FORMULA})",
        "",
        f"{'component':<{width}}{'layers':>7}{'matmul':>10}{'sequence':>10}{'GFLOP/tok':>11}{'share':>8}",
    ]
    for c in breakdown.components:
        gflops = f"{c.matmul / 1e9:>10.3f}{c.sequence / 1e9:>10.3f}{c.total / 1e9:>11.3f}"
        lines.append(f"{c.name:<{width}}{c.layers or '':>7}{gflops}{c.total / total:>8.1%}")
    tokens = breakdown.seq_length * global_batch_size
    lines += [
        f"{'total':<{width}}{'':>7}{breakdown.matmul / 1e9:>10.3f}{breakdown.sequence / 1e9:>10.3f}{total / 1e9:>11.3f}{1:>8.1%}",
        "",
        "matmul: weight GEMMs (6 x weights a token multiplies; DSA indexer 4 x: inputs detached); sequence: attention,",
        "indexer scores, SSM scan (s-dependent or per-chunk work). Not counted: embedding gathers, norms, softmax, activations.",
        f"per step (global batch {global_batch_size} x seq {breakdown.seq_length} = {tokens:,} tokens): {total * tokens / 1e12:,.1f} TFLOP",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from nam56r.model.presets import add_preset_options, preset_from_options

    parser = argparse.ArgumentParser(
        prog="python -m nam56r.model.flops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_preset_options(parser, "model preset")
    parser.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    parser.add_argument("--global-batch", type=int, default=64, help="sequences per optimizer step, for the per-step total (default 64)")
    parser.add_argument("--json", type=Path, help="also write the breakdown as JSON to this file")
    args = parser.parse_args(argv)
    config = preset_from_options(args)
    seq = args.seq if args.seq is not None else config.seq_length
    try:
        breakdown = flops_per_token(config, seq)
        per_step = step_flops(config, seq, args.global_batch)
    except ValueError as error:
        parser.error(str(error))
    print(format_table(breakdown, args.global_batch))
    if args.json:
        record = {**breakdown.to_json(), "global_batch_size": args.global_batch, "step_flops": per_step}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
