"""The indexer recall probe of a run (`--indexer-recall-interval N`): every N steps, and at step 1, the
recall@k of one DSA layer's indexer against dense attention (`nam56r.model.dsa_recall` defines it) on the
first micro-batch of the step, logged by Megatron as the loss report 'indexer recall'.

Which layer: the first DSA layer of the model chunk that computes its own top-k (IndexCache's first Full
layer). Which step: Megatron's (1-based, `nam56r.training.launcher.pretrain.StepContext`), so a resumed run probes
the same steps as an uninterrupted one.

How it reaches the logs: the forward step hands the loss function a `RecallReport` for every training
micro-batch; the loss function adds [sum of row recalls, rows] to its report under 'indexer recall',
zeros on micro-batches that did not measure. Megatron sums each report key over the micro-batches and
the data-parallel ranks and divides (train_step), so a probe step logs the mean recall over the rows
measured on every rank, and any other step logs 0/0 = NaN: not measured. TensorBoard gets that value
at every step (`nam56r.training.runs.summary` keeps the finite ones as summary.json's 'indexer_recall'
series); Megatron's log line prints a key only when it is >= 0, so at --log-interval 1 the line of a
probe step shows the recall and the others do not show the key (a longer interval averages over steps:
NaN, not printed).

Limits, each refused when the probe is on (`RecallSchedule.problems`): pipeline, tensor and context
parallel 1 (the loss is on the last stage, the probed layer on the first; the layer's heads and rows on
one rank), no CUDA graphs (a replayed graph runs no hooks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nam56r.training.settings import setting

if TYPE_CHECKING:  # the recipe reads RecallSchedule without torch or Megatron
    import torch

    from nam56r.model.dsa_recall import RecallHook

RECALL_KEY = "indexer recall"


@dataclass(frozen=True)
class RecallSchedule:
    """Probe at step 1 and every `interval` steps; 0 turns the probe off."""

    interval: int = setting(
        0, cli="--indexer-recall-interval", key="indexer_recall_interval", metavar="N",
        help="log 'indexer recall' at step 1 and every N steps: on the first micro-batch of the step, the first DSA layer "
             "computing its own top-k, the share of dense attention's top-k keys (k: the recipe's top-k, also during the "
             "dense warm-up) that the indexer's top-k holds, averaged over query rows (nam56r.training.recall_probe); in "
             "TensorBoard and summary.json's 'indexer_recall' series. 0: off")

    def probes(self, step: int) -> bool:
        return self.interval > 0 and (step == 1 or step % self.interval == 0)

    def problems(self, *, pp: int = 1, tp: int = 1, cp: int = 1, cuda_graphs: bool = False) -> list[str]:
        """What keeps this schedule from running in a run of this shape; empty when nothing does."""
        n = self.interval
        if n < 0:
            return [f"indexer_recall_interval must be >= 0 (0: no recall probe), got {n} (set it with --indexer-recall-interval)"]
        if n == 0:
            return []
        off = "pass --indexer-recall-interval 0 or"
        found = [f"the indexer recall probe needs {name} parallel 1, got {size}: {why}; {off} run at {name} parallel 1"
                 for name, size, why in (
                     ("pipeline", pp, "the loss that reports it is on the last stage, the probed DSA layer on the first"),
                     ("tensor", tp, "it measures a layer whose heads are all on one rank"),
                     ("context", cp, "it measures a layer whose query rows are all on one rank"))
                 if size > 1]
        if cuda_graphs:
            found.append(f"the indexer recall probe is a forward hook, which a replayed CUDA graph does not run; {off} --cuda-graphs off")
        return found


@dataclass
class RecallReport:
    """One training micro-batch's part of 'indexer recall': the hook armed for it, or none."""

    hook: RecallHook | None = None

    def loss_report(self, device: torch.device) -> torch.Tensor:
        """[sum of row recalls, rows], as Megatron sums a report over micro-batches; zeros when this micro-batch
        did not measure. Raises if the armed layer never ran (its hook would otherwise fire in a later one)."""
        import torch

        if self.hook is None:
            return torch.zeros(2, device=device)
        sample = self.hook.sample
        if sample is None:
            self.hook.cancel()
            raise RuntimeError(
                f"the indexer recall probe was armed on DSA layer {self.hook.layer.layer_number}, which did not run in this "
                "micro-batch's forward"
            )
        return torch.tensor([sample.recall_sum, float(sample.rows)], device=device)


def probed_layer(model: torch.nn.Module):
    """The first DSA layer of `model` (a chunk, through any wrapper) that computes its own top-k."""
    from nam56r.model.dsa_index_cache import IndexCacheDSAttention
    from nam56r.model.dsa_warmup import dsa_layers

    for layer in dsa_layers(model):
        plan = layer.plan if isinstance(layer, IndexCacheDSAttention) else None
        shared = plan is not None and plan.source_of(layer.layer_number) != layer.layer_number
        if not shared and not layer.skip_topk and layer.indexer is not None:
            return layer
    raise RuntimeError("the indexer recall probe found no DSA layer computing its own top-k in this model chunk")


@dataclass
class IndexerRecallProbe:
    """Arms the probed layer on the first training micro-batch of each probe step; `log` gets one line at the first."""

    schedule: RecallSchedule
    log: Callable[[str], None] = print
    _layers: dict[int, object] = field(default_factory=dict)  # id(model chunk) -> its probed layer
    _last_step: int | None = None

    def begin_micro_batch(self, model: torch.nn.Module, step: int) -> RecallReport:
        """Called by the forward step before a training micro-batch's forward, with Megatron's step."""
        from nam56r.model.dsa_recall import RecallHook

        if not self.schedule.probes(step) or step == self._last_step:
            return RecallReport()
        self._last_step = step
        if (layer := self._layers.get(id(model))) is None:
            layer = self._layers[id(model)] = probed_layer(model)
            self.log(f"indexer recall: DSA layer {layer.layer_number}, top-k {layer.config.dsa_indexer_topk}, on the first "
                     f"micro-batch of step 1 and every {self.schedule.interval} steps (logged as {RECALL_KEY!r})")
        return RecallReport(RecallHook(layer))
