"""The launcher's command line (`python -m nam56r.training.train --help`): recipe, overrides, data and outputs,
several nodes; Megatron flags of your own after `--`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

from nam56r.model.config import (
    DSA_INDEXER_PATHS,
    EXPERT_ACTIVATION_PATHS,
    MOE_DISPATCH_PATHS,
    MOE_ROUTING_PATHS,
    RESIDUAL_NORM_PATHS,
    ROUTER_GATING_PATHS,
)
from nam56r.model.presets import PRESETS
from nam56r.training.kernel_cache import ON_MISMATCH
from nam56r.training.recipe import RECIPES, LinearCE, Recompute


def parse_args(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's options, the Megatron flags after `--`); `description` heads `--help` (the launcher's docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m nam56r.training.train", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="proxy-1gpu", choices=sorted(RECIPES), help="named run shape (default proxy-1gpu)")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the checks, the preflight and the exact command; start nothing")
    parser.add_argument("--verbose", action="store_true",
                        help="show every upstream warning, including the known ones filtered by default")
    shape = parser.add_argument_group("overrides of the recipe")
    shape.add_argument("--model", choices=sorted(PRESETS), help="model preset (e.g. nam56r on a recipe whose default is the proxy)")
    shape.add_argument("--mbs", type=int, dest="micro_batch", help="micro-batch size per GPU")
    shape.add_argument("--gbs", type=int, dest="global_batch", help="global batch size (sequences per step)")
    shape.add_argument("--steps", type=int, help="training steps")
    shape.add_argument("--seq", type=int, dest="seq_length", help="sequence length")
    shape.add_argument("--ep", type=int, help="expert-parallel size")
    shape.add_argument("--pp", type=int, help="pipeline-parallel size")
    shape.add_argument("--nodes", type=int, help="number of nodes")
    shape.add_argument("--gpus-per-node", type=int, help="GPUs per node")
    shape.add_argument("--lr", type=float, help="peak learning rate")
    shape.add_argument("--warmup", type=int, dest="warmup_steps", help="learning-rate warm-up steps (below --steps)")
    shape.add_argument(
        "--dense-warmup-steps", type=int, metavar="N",
        help="DSA phases: steps 1..N attend every causal key while the indexer learns Megatron's dense KL, later steps "
             "attend the indexer's top-k (0: sparse from the first step; below --steps). Megatron's step number decides "
             "the phase, so a resumed run continues in its own (default: the recipe's, see --list)",
    )
    shape.add_argument(
        "--indexer-recall-interval", type=int, metavar="N",
        help="log 'indexer recall' at step 1 and every N steps: on the first micro-batch of the step, the first DSA layer "
             "computing its own top-k, the share of dense attention's top-k keys (k: the recipe's top-k, also during the "
             "dense warm-up) that the indexer's top-k holds, averaged over query rows (nam56r.training.recall_probe); in "
             "TensorBoard and summary.json's 'indexer_recall' series. 0: off (default: the recipe's, 0)",
    )
    shape.add_argument("--save-interval", type=int, help="steps between checkpoints")
    shape.add_argument("--backend", choices=("auto", "te", "local"), help="layer backend (auto: TE when installed)")
    shape.add_argument("--index-cache", choices=("on", "off"),
                       help="IndexCache for the DSA layers: Shared layers reuse the nearest Full layer's top-k (on in every recipe)")
    shape.add_argument("--dsa-indexer", choices=DSA_INDEXER_PATHS,
                       help="how DSA layers select their top-k and train the indexer: the fused Triton top-k with the sparse loss on the "
                            "selected keys computed by Megatron's TileLang loss kernels (fused-tilelang-loss, the recipes' "
                            "default) or in torch (fused), or Megatron's TileLang indexer and loss (megatron); "
                            "nam56r.model.dsa_fused_indexer")
    shape.add_argument("--moe-dispatch", choices=MOE_DISPATCH_PATHS,
                       help="how MoE layers dispatch tokens to their experts: at expert parallel 1, one pass per token without "
                            "sorts, atomics or host syncs (fused-permute, the one-GPU recipes' default; "
                            "nam56r.model.moe_dispatch), or Megatron's all-to-all dispatcher (megatron, the EP > 1 recipes')")
    shape.add_argument("--expert-activation", choices=EXPERT_ACTIVATION_PATHS,
                       help="the MoE experts' GELU and router-prob scale on the local backend: one Triton pass each way "
                            "(fused, the default there; nam56r_kernels.expert_activation) or Megatron's eager ops (eager, "
                            "and the te backend's, whose grouped experts run TE's own activation)")
    shape.add_argument("--residual-norm", choices=RESIDUAL_NORM_PATHS,
                       help="the transformer layers' input norms (RMSNorm) on the local backend: one Triton pass each way whose "
                            "backward also sums the residual's gradient (fused, the default there; nam56r.model.residual_norm) or "
                            "torch's RMSNorm with autograd adding the residual's gradient (torch, and the te backend's, which runs "
                            "TE's norm)")
    shape.add_argument("--router-gating", choices=ROUTER_GATING_PATHS,
                       help="the MoE router's fp32 logits: from its bf16 input and weight with Triton kernels each way, no fp32 "
                            "copies (fused, every recipe's default; nam56r_kernels.router_gating), or Megatron's local GEMM on "
                            "fp32 copies (megatron); both sum in fp32")
    shape.add_argument("--moe-routing", choices=MOE_ROUTING_PATHS,
                       help="the MoE router's sigmoid scores, top-k, probs, seq aux loss and expert load: Triton kernels, two "
                            "launches forward and one backward (fused, every recipe's default; nam56r_kernels.moe_routing), or "
                            "Megatron's TopKRouter.routing in torch ops (megatron); the same selection, values to fp32 rounding")
    shape.add_argument("--overlap-dp-comm", choices=("on", "off"),
                       help="overlap the distributed optimizer's gradient reduce-scatter with the backward (Megatron's "
                            "--overlap-grad-reduce); needs data parallel > 1. Its parameter all-gather stays after the "
                            "optimizer step: Megatron's --overlap-param-gather is refused (default: off in every recipe)")
    shape.add_argument("--moe-shared-expert-overlap", choices=("on", "off"),
                       help="run the MoE shared expert on a side stream beside Megatron's all-to-all dispatch and combine "
                            "(Megatron's --moe-shared-expert-overlap); needs --moe-dispatch megatron, the EP > 1 recipes' "
                            "(default: off in every recipe)")
    shape.add_argument("--reshardable-ckpt", choices=("on", "off"),
                       help="write the distributed optimizer's checkpoint state per parameter (Megatron's "
                            "--dist-ckpt-optim-fully-reshardable), so a checkpoint resumes at another expert-parallel size; "
                            "each save gathers the optimizer state on data-parallel rank 0. Off, a checkpoint resumes only "
                            "at its own expert-parallel size (default: off in every recipe)")
    shape.add_argument("--cuda-graphs", choices=("on", "off"), help="CUDA graphs (refused at pp=1)")
    shape.add_argument("--linear-ce", choices=get_args(LinearCE),
                       help="LM head and MTP heads: our chunked linear cross-entropy through Megatron patch 0016 (chunked, "
                            "the recipes' default; nam56r.model.linear_cross_entropy), Liger's fused linear cross-entropy "
                            "through patches 0007/0008 (liger), or upstream's logits + cross-entropy (logits)")
    shape.add_argument("--recompute", type=_recompute, metavar="none|all|FAMILY[,FAMILY...]",
                       help="activation recompute per block family (default none): mamba (our checkpointed Mamba-3 mixer), "
                            "moe (Megatron's selective 'moe': the whole MoE layer), attention (Megatron's selective "
                            "'core_attn' and 'mla_up_proj' on the MLA, DSA and MTP attention); e.g. --recompute mamba,moe. "
                            "Megatron's full recompute (after --) is refused together with these")
    io_group = parser.add_argument_group("data, checkpoints, outputs")
    io_group.add_argument(
        "--data", type=Path, help="a data directory with data.json (nam56r.training.data build/convert) or a train prefix (.bin/.idx)"
    )
    io_group.add_argument("--valid-data", type=Path, help="validation prefix, when --data is a prefix")
    io_group.add_argument("--tokenizer", type=Path, help="HuggingFace tokenizer directory, when --data is a prefix")
    io_group.add_argument("--save", type=Path, help="checkpoint directory (default RUN_DIR/checkpoints)")
    io_group.add_argument("--load", type=Path,
                          help="resume from this checkpoint directory; checked before the ranks start: a checkpoint saved at "
                               "another expert-parallel size is refused where its optimizer state cannot load "
                               "(nam56r.training.resume_layout)")
    io_group.add_argument("--no-save", action="store_true", help="write no checkpoint (throughput runs); refused with --save")
    io_group.add_argument("--run-dir", type=Path, help="logs, events, summary and plot (default runs/<recipe>-<time>)")
    io_group.add_argument("--kernel-cache", type=Path, metavar="DIR",
                          help="a portable compiled-kernel cache (`nox -s prewarm`): its Triton and TileLang kernels load "
                               "instead of compiling, and new ones are added; an empty or new DIR is filled by this run. A DIR "
                               "filled on another stack (GPU architecture, driver, CUDA, python, torch, triton, tilelang) is "
                               "refused, naming the difference (nam56r.training.kernel_cache)")
    io_group.add_argument("--kernel-cache-mismatch", choices=ON_MISMATCH, default="refuse",
                          help="a --kernel-cache of another stack: refuse the launch (default), or ignore the cache, saying so, "
                               "and compile into the compilers' default caches")
    multi = parser.add_argument_group("several nodes")
    multi.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0 (run the same command on every node)")
    multi.add_argument("--node-rank", type=int, default=0, help="this node's rank, with --rdzv-endpoint")
    multi.add_argument("--slurm-script", type=Path, help="write an sbatch script for the run instead of launching")
    parser.add_argument("megatron_extra", nargs="*", help="extra Megatron flags after `--` (mock data and the null tokenizer are refused)")
    args = parser.parse_args(argv)
    return args, list(args.megatron_extra)


def _recompute(text: str) -> Recompute:
    try:
        return Recompute.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
