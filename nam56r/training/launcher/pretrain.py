"""The process `torchrun` starts on each GPU: Megatron's `pretrain` with NAM56R's model provider,
forward step and dataset provider.

Launched by `nam56r.training.launcher` (never by hand: the launcher writes the model config file this reads
and prints the exact command). Each rank waits at the launcher's gate (`nam56r.training.launcher.launch_gate`) after
its imports and before Megatron parses a flag. The model is built from that `ModelConfig`; the flags' own view of
the architecture must agree with it on every fact of `nam56r.model.megatron_fields`' table
(`architecture_mismatches`) or the run stops before building anything. Every forward step first puts the
DSA layers in the phase of Megatron's current step (`nam56r.training.phases`, `--nam56r-dense-warmup-steps`),
and at probe steps arms the indexer recall probe on its first micro-batch (`nam56r.training.recall_probe`,
`--nam56r-indexer-recall-interval`).

A `--reference` run's model config file holds the reference GPT's config (`nam56r.model.reference`): its ranks build
Megatron's GPTModel with `reference_model_provider`, checked against `nam56r.model.reference_model`'s table, and
its forward steps have no DSA phases and no recall probe; data, loss and everything else are the same.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from nam56r.model.config import ModelConfig
from nam56r.model.megatron_fields import architecture_mismatches
from nam56r.model.reference import ReferenceConfig, model_from_dict
from nam56r.training.launcher.flags import add_nam56r_args, transformer_config_from_args
from nam56r.training.launcher.launch_gate import wait_for_launch
from nam56r.training.launcher.startup_marks import mark, process_started
from nam56r.training.phases import DsaPhases, PhaseSwitch
from nam56r.training.recall_probe import RECALL_KEY, IndexerRecallProbe, RecallReport, RecallSchedule
from nam56r.training.runs.faults import (
    RUN_STOPPED_EXIT,
    NonFiniteLoss,
    RunStopped,
    explain_save_failures,
    nonfinite_loss_message,
    planted_nonfinite,
)

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def load_model_config(path: str | Path) -> ModelConfig | ReferenceConfig:
    """The model the launcher wrote for the ranks: NAM56R's config, or with `--reference` the reference GPT's."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(
            f"model config {path} not found: start training with `python -m nam56r.training.launcher`, which writes it"
        ) from None
    return model_from_dict(data)


def _check_tokenizer_fits(vocab_size: int) -> None:
    from megatron.training import get_tokenizer

    if (tokens := get_tokenizer().vocab_size) > vocab_size:
        raise SystemExit(
            f"tokenizer has {tokens} tokens, the model's vocabulary {vocab_size}: "
            "train a tokenizer no larger than the model's vocab (`python -m nam56r.training.data build --vocab-size N`)"
        )


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, config=None, pg_collection=None):
    """Megatron's model-provider contract: the bare model on the current GPU (Megatron wraps it)."""
    from megatron.training import get_args, print_rank_0

    from nam56r.model.model import build_model
    from nam56r.training.launcher.preflight import run_preflight

    if vp_stage is not None:
        raise SystemExit("virtual pipeline stages are not supported by NAM56R's launcher")
    args = get_args()
    model_config = load_model_config(args.nam56r_model_config)
    megatron_cfg = transformer_config_from_args(args)
    mismatches = architecture_mismatches(model_config, args, megatron_cfg)
    if mismatches:
        raise SystemExit("Megatron's flags and the model config disagree:\n  " + "\n  ".join(mismatches))
    _check_tokenizer_fits(model_config.vocab_size)
    run_preflight(model_config).raise_if_failed()  # on every rank: each node's trees and GPU, whoever launched it
    built = build_model(
        model_config,
        args.nam56r_backend,
        device="cuda",
        pg_collection=pg_collection,
        megatron_cfg=megatron_cfg,
        pre_process=pre_process,
        post_process=post_process,
    )
    print_rank_0(f"NAM56R {model_config.name}: {built.layout.megatron_pattern} on the {built.backend} backend")
    return built.model


def reference_model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, config=None,
                             pg_collection=None):
    """The `--reference` run's provider (Megatron's contract, as `model_provider`): Megatron's GPTModel on its local
    layer spec (`nam56r.model.reference_model`), built from the reference config the launcher wrote."""
    from megatron.training import get_args, print_rank_0

    from nam56r.model.reference_model import build_reference_model, reference_mismatches
    from nam56r.training.launcher.preflight import run_preflight

    if vp_stage is not None:
        raise SystemExit("virtual pipeline stages are not supported by NAM56R's launcher")
    args = get_args()
    reference = load_model_config(args.nam56r_model_config)
    if not isinstance(reference, ReferenceConfig):
        raise SystemExit(f"{args.nam56r_model_config} holds NAM56R's config, not a reference's: the launcher writes it with --reference")
    megatron_cfg = transformer_config_from_args(args)
    if mismatches := reference_mismatches(reference, args, megatron_cfg):
        raise SystemExit("Megatron's flags and the reference config disagree:\n  " + "\n  ".join(mismatches))
    _check_tokenizer_fits(reference.vocab_size)
    run_preflight(reference).raise_if_failed()
    model = build_reference_model(reference, device="cuda", megatron_cfg=megatron_cfg, pg_collection=pg_collection,
                                  pre_process=pre_process, post_process=post_process)
    print_rank_0(f"reference GPT {reference.name}: {reference.num_layers} layers, hidden {reference.hidden_size}, "
                 f"FFN {reference.ffn_hidden_size} (Megatron's GPTModel, local layer spec)")
    return model


def batch_to(batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The GPTDataset sample keys the model needs, on `device`; a missing key names what is there."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise KeyError(f"batch lacks {missing}; it has {sorted(batch)}")
    return {k: batch[k].to(device, non_blocking=True) for k in BATCH_KEYS}


@dataclass(frozen=True)
class StepContext:
    """Where a forward step runs: Megatron's step number (1-based), the checkpoint directory, and the
    step with a planted non-finite loss (`--nam56r-nonfinite-loss-at-step`). Outside a Megatron run
    (no global args) nothing is known."""

    step: int | None = None
    save_dir: str | None = None
    plant_nonfinite_at: int | None = None

    @classmethod
    def current(cls) -> StepContext:
        from megatron.training.global_vars import _GLOBAL_ARGS as args

        if args is None:
            return cls()
        return cls(args.curr_iteration + 1 if hasattr(args, "curr_iteration") else None, args.save, args.nam56r_nonfinite_loss_at_step)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, context: StepContext = StepContext(),
              recall: RecallReport | None = None):
    """Megatron's per-token-loss contract: (sum of masked losses, token count, report). A non-finite
    loss stops the run (`nam56r.training.runs.faults`). With `recall` (a training micro-batch of a run with
    the recall probe on), the report also carries 'indexer recall'."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    if context.step is not None:
        loss = loss * planted_nonfinite(context.step, context.plant_nonfinite_at)
    num_tokens = mask.sum().detach().to(torch.int)
    if not torch.isfinite(loss.detach()).all():
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        raise NonFiniteLoss(nonfinite_loss_message(loss.item(), context.step, rank, context.save_dir))
    report = {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}
    if recall is not None:
        report[RECALL_KEY] = recall.loss_report(loss.device)
    return loss, num_tokens, report


def forward_step(data_iterator, model, *, phase_switch: PhaseSwitch | None = None, recall_probe: IndexerRecallProbe | None = None):
    """Megatron's forward-step contract. With `phase_switch`, the DSA layers are first put in the phase of
    Megatron's current step (read from its arguments, so a resumed run is in its checkpoint's phase). With
    `recall_probe`, every training micro-batch reports 'indexer recall' (measured on the first of a probe step)."""
    context = StepContext.current()
    if phase_switch is not None and context.step is not None:
        phase_switch.enter(model, context.step)
    recall = None
    if recall_probe is not None and context.step is not None and model.training:
        recall = recall_probe.begin_micro_batch(model, context.step)
    device = next(model.parameters()).device
    batch = batch_to(next(data_iterator), device)
    mark("first micro-batch: forward begins", once=True)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    mark("first micro-batch: forward returned (host; its kernels compiled or loaded)", once=True)
    return output, partial(loss_func, batch["loss_mask"], context=context, recall=recall)


def phase_switch_from_args(args, log=print) -> PhaseSwitch:
    """The DSA phase switch of a run from Megatron's parsed arguments; refuses a schedule that cannot run."""
    phases = DsaPhases(args.nam56r_dense_warmup_steps)
    if problems := phases.problems(args.train_iters or 0):
        raise SystemExit("--nam56r-dense-warmup-steps: " + "; ".join(problems))
    return PhaseSwitch(phases, seq_length=args.seq_length, log=log)


def recall_probe_from_args(args, log=print) -> IndexerRecallProbe | None:
    """The run's indexer recall probe from Megatron's parsed arguments (None when off); refuses what it cannot measure."""
    schedule = RecallSchedule(args.nam56r_indexer_recall_interval)
    problems = schedule.problems(pp=args.pipeline_model_parallel_size, tp=args.tensor_model_parallel_size,
                                 cp=args.context_parallel_size, cuda_graphs=getattr(args, "cuda_graph_impl", "none") != "none")
    if problems:
        raise SystemExit("--nam56r-indexer-recall-interval: " + "; ".join(problems))
    return IndexerRecallProbe(schedule, log=log) if schedule.interval else None


def gpt_dataset_config(args, tokenizer):
    """GPTDatasetConfig for the launcher's per-split prefixes: documents end in EOD, causal masks are
    made by the model (no mask tensor from the loader), no loss on EOD is masked."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=args.mmap_bin_files,
    )


def datasets_provider(train_val_test_num_samples):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    if args.mock_data:
        raise SystemExit("mock data is refused: NAM56R trains on real data (`python -m nam56r.training.data build`)")
    config = gpt_dataset_config(args, get_tokenizer())
    # TP is 1 (the recipe checks it), so every rank reads its own batches.
    return BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # Megatron's marker: every rank calls the provider


def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain, print_rank_0
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    # The imports above are most of a rank's start-up; the launcher's checks ran alongside them.
    if (started := process_started()) is not None:
        mark("rank 0 process started", at=started)
    mark("rank 0 imported torch, Megatron and NAM56R's modules")
    waited_s = wait_for_launch()
    mark("rank 0 passed the launch gate")
    args = parse_and_validate_args(extra_args_provider=add_nam56r_args)
    if waited_s is not None:
        print_rank_0(f"launch gate: opened by the launcher after this rank's imports (waited {waited_s:.1f} s)")
    if args.tokenizer_type == "NullTokenizer":
        raise SystemExit("the null tokenizer is refused: pass a real tokenizer (`--tokenizer DIR` to nam56r.training.launcher)")
    if isinstance(load_model_config(args.nam56r_model_config), ReferenceConfig):
        step, provider = forward_step, reference_model_provider  # no DSA layers to phase, no indexer to probe
    else:
        switch = phase_switch_from_args(args, log=print_rank_0)
        print_rank_0(f"DSA phases: {switch.phases.describe()}")
        step = partial(forward_step, phase_switch=switch, recall_probe=recall_probe_from_args(args, log=print_rank_0))
        provider = model_provider
    cfg = pretrain_cfg_container_from_args(args, None)
    try:
        with explain_save_failures(args.save):
            pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, step, model_provider=provider)
    except RunStopped as exc:
        traceback.print_exc()  # the cause, for the record; the line below is what to read
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(RUN_STOPPED_EXIT)


if __name__ == "__main__":
    main()
