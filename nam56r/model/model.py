"""NAM56R on Megatron's HybridModel: config translation, the model class and its builder.

`megatron_config(config)` is our `ModelConfig` as Megatron's `MLATransformerConfig` for builds
outside training, from the architecture table (`nam56r.model.megatron_fields`) the training flags
come from too; `build_model` builds the whole model (on the meta device for counting,
on a GPU for training) from the pattern translation (`nam56r.model.pattern`) and the specs
(`nam56r.model.specs`); `build_dsa_layers` builds its DSA layers alone, from the same spec (the DSA
layer tests and bench), and `build_moe_layer` one of its MoE layers, with our grouped experts or Megatron's
per-expert `SequentialMLP` (the MoE layer tests and bench).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_layer_counts
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import MLATransformerConfig
from nam56r_kernels.index_cache import IndexCachePlan, TopkCache

from nam56r.model.config import ModelConfig
from nam56r.model.dsa_index_cache import IndexCacheDSAttention, topk_cache_for
from nam56r.model.embedding import NgramHashEmbedding
from nam56r.model.local_layers import parameter_device
from nam56r.model.megatron_fields import transformer_config_fields
from nam56r.model.pattern import MEGATRON_SYMBOL, LayerKind, LayerLayout, layout_of
from nam56r.model.specs import Backend, MoEExperts, hybrid_stack_spec, moe_layer_spec


def megatron_config(config: ModelConfig, *, params_dtype: torch.dtype = torch.float32, meta: bool = False) -> MLATransformerConfig:
    """Megatron's config for `config`. `meta=True` allocates parameters without initializing them
    (for counting on the meta device)."""
    return MLATransformerConfig(**megatron_config_fields(config, params_dtype=params_dtype, meta=meta))


def megatron_config_fields(config: ModelConfig, *, params_dtype: torch.dtype = torch.float32, meta: bool = False) -> dict:
    """The MLATransformerConfig fields NAM56R sets: the architecture (`nam56r.model.megatron_fields`, which
    the training command's flags also come from) and how this build runs; every other field keeps Megatron's
    default. Training takes the second part from Megatron's arguments (parallelism, precision)."""
    return transformer_config_fields(config) | dict(
        params_dtype=params_dtype,
        bf16=config.precision in ("bf16", "fp8-tensorwise"),
        fp8="tensorwise" if config.precision == "fp8-tensorwise" else None,
        moe_grouped_gemm=False,
        # Parameters: allocated without initialization on the meta device when counting.
        use_cpu_initialization=True,
        perform_initialization=not meta,
    )


def local_backend_problems(megatron_cfg: MLATransformerConfig) -> list[str]:
    """Settings of `megatron_cfg` the local backend's modules refuse when built, each with what to
    pass instead; empty when it builds. Megatron asserts them one at a time, mid-build; this names
    them all before anything is built."""
    from megatron.core.tensor_parallel import layers

    problems = [
        f"{name}=True: {why}"
        for name, why in (
            # WrappedTorchNorm, the local backend's norm, asserts each of these off.
            ("persist_layer_norm", "asks for Apex's persistent LayerNorm kernel, which torch's norms lack; pass --no-persist-layer-norm"),
            ("layernorm_zero_centered_gamma", "torch's norms have no zero-centred gamma; leave it off"),
            ("sequence_parallel", "torch's norms do not support sequence parallelism (nor does NAM56R at TP=1); leave it off"),
            ("memory_efficient_layer_norm", "torch's norms have no memory-efficient variant; leave it off"),
        )
        if getattr(megatron_cfg, name)
    ]
    if megatron_cfg.gradient_accumulation_fusion and not layers._grad_accum_fusion_available:
        problems.append(
            "gradient_accumulation_fusion=True: Megatron's linears need APEX's fused_weight_gradient_mlp_cuda for it, "
            "which is not installed; pass --no-gradient-accumulation-fusion"
        )
    return problems


class NAM56RModel(HybridModel):
    """HybridModel plus the n-gram hash embedding at the entrance and the IndexCache pass boundary."""

    def __init__(self, *args, model_config: ModelConfig, topk_cache: TopkCache | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model_config = model_config
        self.topk_cache = topk_cache
        self.ngram_embedding = (
            NgramHashEmbedding(
                model_config.ngram,
                model_config.hidden_size,
                params_dtype=self.config.params_dtype,
                init_std=model_config.init_std if self.config.perform_initialization else None,
                device=parameter_device(self.config),
            )
            if model_config.ngram.enabled and self.pre_process
            else None
        )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, *args, **kwargs):
        if self.topk_cache is not None:
            self.topk_cache.begin_forward()
        if self.ngram_embedding is not None and kwargs.get("decoder_input") is None:
            token_embedding = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
            ngram = self.ngram_embedding(input_ids)  # [b, s, h]
            kwargs["decoder_input"] = token_embedding + ngram.transpose(0, 1).to(token_embedding.dtype)
        return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)


@dataclass(frozen=True)
class BuiltModel:
    model: NAM56RModel
    layout: LayerLayout
    backend: Backend
    index_cache_plan: IndexCachePlan | None


def index_cache_plan(config: ModelConfig, layout: LayerLayout) -> IndexCachePlan | None:
    if not config.index_cache.enabled:
        return None
    return IndexCachePlan.build(layout.layer_numbers(LayerKind.DSA), config.index_cache.share_group)


def check_translation(layout: LayerLayout) -> None:
    """Megatron's own parser must count exactly the layers our layout has (nothing remapped)."""
    megatron_counts = {symbol: n for symbol, n in get_hybrid_layer_counts(layout.megatron_pattern).items() if n}
    ours: dict[str, int] = {}
    for kind, n in layout.counts().items():
        ours[MEGATRON_SYMBOL[kind]] = ours.get(MEGATRON_SYMBOL[kind], 0) + n
    if megatron_counts != ours:
        raise RuntimeError(f"pattern {layout.megatron_pattern!r}: Megatron counts {megatron_counts}, NAM56R layout {ours}")


@contextmanager
def cuda_buffers_on(device: str):
    """Route Megatron's hard-coded `torch.cuda.current_device()` (MoE router buffers, MLA's rotary
    embedding) to `device` while building on "meta" or "cpu". Only for shape-level builds
    (parameter counting, CPU tests of tiny presets); GPU builds never enter it."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device(device)
    try:
        yield
    finally:
        torch.cuda.current_device = original


def single_process_groups(backend: str = "gloo") -> ProcessGroupCollection:
    """A one-rank world with Megatron's parallel state, for builds outside `pretrain`: gloo for meta and
    CPU builds, nccl for a model on the GPU (its MoE and loss collectives run on CUDA tensors, which
    gloo does not reduce in every form). An existing world is kept as it is."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        # An in-memory store: no port to collide with other processes.
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return ProcessGroupCollection.use_mpu_process_groups()


def seed_model_parallel_rng(seed: int, pg_collection: ProcessGroupCollection) -> bool:
    """Seed Megatron's CUDA RNG tracker with `model_parallel_cuda_manual_seed(seed)` where it holds
    no model-parallel state (a build outside `pretrain`, which seeds it from --seed first); a state
    already there is never replaced. True when it seeded."""
    from megatron.core.tensor_parallel.random import (
        _MODEL_PARALLEL_RNG_TRACKER_NAME,
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    if _MODEL_PARALLEL_RNG_TRACKER_NAME in get_cuda_rng_tracker().get_states():
        return False
    model_parallel_cuda_manual_seed(
        seed, tp_rank=pg_collection.tp.rank(), ep_rank=pg_collection.ep.rank(), etp_rank=pg_collection.expt_tp.rank()
    )
    return True


def build_model(
    config: ModelConfig,
    backend: Backend,
    *,
    device: str = "meta",
    params_dtype: torch.dtype = torch.float32,
    pg_collection: ProcessGroupCollection | None = None,
    megatron_cfg: MLATransformerConfig | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    seed: int = 0,
) -> BuiltModel:
    """Build NAM56R. device="meta": shapes only (parameter counting); "cuda": a trainable model on
    the current GPU; "cpu": real (small) tensors, for tests of tiny presets.

    `megatron_cfg`: the training path's config, derived by Megatron from the launcher's flags (its
    parallelism, precision and runtime fields); the caller has checked its architecture against
    `config` (`nam56r.model.megatron_fields.architecture_mismatches`). Its runtime fields are set here for
    the device (initialization, dispatcher, DSA kernels). `pre_process`/`post_process`: this
    pipeline stage holds the embedding / the output head. `seed`: seeds the model-parallel CUDA RNG
    of a "cuda" build only where nothing seeded it yet (`seed_model_parallel_rng`)."""
    layout = layout_of(config)
    check_translation(layout)
    plan = index_cache_plan(config, layout)
    cache = TopkCache() if plan is not None else None
    mcfg, pg_collection = _runtime_megatron_config(config, backend, device, params_dtype, megatron_cfg, pg_collection, seed)
    spec = hybrid_stack_spec(config, backend, index_cache_plan=plan, topk_cache=cache)
    build_context = nullcontext() if device == "cuda" else cuda_buffers_on(device)
    with build_context, torch.device("meta") if device == "meta" else nullcontext():
        model = NAM56RModel(
            model_config=config,
            topk_cache=cache,
            config=mcfg,
            hybrid_stack_spec=spec,
            vocab_size=config.vocab_size,
            max_sequence_length=config.seq_length,
            hybrid_layer_pattern=layout.megatron_pattern,
            position_embedding_type="rope",
            rotary_base=int(config.rope_base),
            share_embeddings_and_output_weights=False,
            pg_collection=pg_collection,
            pre_process=pre_process,
            post_process=post_process,
        )
    if (plan is not None) != (topk_cache_for(model) is not None):
        raise RuntimeError("IndexCache plan and the model's DSA layers disagree (a DSA layer was not built from our spec)")
    if plan is not None:
        _check_index_cache_sources(model, plan)
    if device == "cuda":
        # Megatron's get_model moves the model to the GPU after the provider returns; a direct caller gets
        # the same: modules that allocate without a device (torch norms) start on the CPU.
        model.cuda(torch.cuda.current_device())
    return BuiltModel(model=model, layout=layout, backend=backend, index_cache_plan=plan)


def _runtime_megatron_config(
    config: ModelConfig,
    backend: Backend,
    device: str,
    params_dtype: torch.dtype,
    megatron_cfg: MLATransformerConfig | None,
    pg_collection: ProcessGroupCollection | None,
    seed: int,
) -> tuple[MLATransformerConfig, ProcessGroupCollection]:
    """The Megatron config a build on `device` uses (`megatron_cfg`, or one made from `config`), with its
    runtime fields set for the device, and the process groups (a one-rank world where none is given)."""
    if device not in ("meta", "cpu", "cuda"):
        raise ValueError(f"device must be 'meta', 'cpu' or 'cuda', got {device!r}")
    mcfg = megatron_cfg if megatron_cfg is not None else megatron_config(config, params_dtype=params_dtype, meta=device == "meta")
    if backend == "local" and (problems := local_backend_problems(mcfg)):
        raise ValueError("the local backend cannot build this Megatron config:\n  " + "\n  ".join(problems))
    pg_collection = pg_collection or single_process_groups("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        seed_model_parallel_rng(seed, pg_collection)
        mcfg.use_cpu_initialization = False
        # Set after construction: Megatron validates the backend against a visible CUDA device.
        mcfg.dsa_kernel_backend = config.dsa.kernel_backend
        mcfg.dsa_strict_fused_paths = config.dsa.kernel_backend != "none"
    else:
        # Parameters in host memory (initialized by torch's CPU generator), or none at all on meta.
        mcfg.use_cpu_initialization = True
        if device == "meta":
            mcfg.perform_initialization = False
        # The all-to-all dispatcher opens a CUDA stream when built; dispatchers hold no parameters,
        # so shape-level builds use the all-gather one.
        mcfg.moe_token_dispatcher_type = "allgather"
    return mcfg, pg_collection


def _check_index_cache_sources(model: torch.nn.Module, plan: IndexCachePlan) -> None:
    """Each Shared DSA layer of this model chunk (a pipeline stage) reads its top-k from a Full layer of the same chunk."""
    here = {m.layer_number for m in model.modules() if isinstance(m, IndexCacheDSAttention)}
    missing = {n: plan.source_of(n) for n in sorted(here) if plan.source_of(n) not in here}
    if missing:
        pairs = ", ".join(f"layer {n} from layer {src}" for n, src in missing.items())
        raise ValueError(
            f"IndexCache across pipeline stages: this stage's Shared DSA layers would read the top-k of a Full layer on another "
            f"stage ({pairs}); build with IndexCache off (--index-cache off) or split the stages so each starts its DSA "
            "layers on a Full layer"
        )


@dataclass(frozen=True)
class BuiltDSALayers:
    layers: dict[int, torch.nn.Module]  # Megatron's layer number -> that DSA TransformerLayer
    index_cache_plan: IndexCachePlan | None
    topk_cache: TopkCache | None  # call its begin_forward() before each pass when IndexCache is on


def build_dsa_layers(
    config: ModelConfig, backend: Backend, *, device: str = "cpu", params_dtype: torch.dtype = torch.float32, seed: int = 0
) -> BuiltDSALayers:
    """NAM56R's DSA layers alone, numbered and (with IndexCache on) planned as in the whole model, from the
    same spec and runtime config as `build_model`: for the layer tests and the DSA layer bench. Each takes
    hidden states [s, b, hidden_size] with attention_mask=None (causal)."""
    from megatron.core.transformer.spec_utils import build_module

    layout = layout_of(config)
    plan = index_cache_plan(config, layout)
    cache = TopkCache() if plan is not None else None
    mcfg, pg_collection = _runtime_megatron_config(config, backend, device, params_dtype, None, None, seed)
    spec = hybrid_stack_spec(config, backend, index_cache_plan=plan, topk_cache=cache).submodules.dsa_layer
    layers = {}
    with nullcontext() if device == "cuda" else cuda_buffers_on(device), torch.device("meta") if device == "meta" else nullcontext():
        for number in layout.layer_numbers(LayerKind.DSA):
            layers[number] = build_module(spec, config=mcfg, layer_number=number, pg_collection=pg_collection, add_layer_offset=False)
    if device == "cuda":
        for layer in layers.values():
            layer.cuda(torch.cuda.current_device())
    return BuiltDSALayers(layers=layers, index_cache_plan=plan, topk_cache=cache)


def build_moe_layer(
    config: ModelConfig,
    backend: Backend,
    *,
    device: str = "cpu",
    params_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    experts: MoEExperts = "grouped",
) -> torch.nn.Module:
    """NAM56R's first MoE layer alone (pre-MLP norm, router, token dispatcher, routed experts, shared expert,
    residual), from the model's spec and runtime config as `build_model` builds it, numbered as in the model:
    for the MoE layer tests and bench. `experts="grouped"` is the model's (our `GroupedMLPExperts` on
    `local`); `"sequential"` is Megatron's `SequentialMLP` on the same linears, with the same parameter names
    (a `state_dict` moves between the two). The dispatcher is the runtime config's: Megatron's all-to-all on
    "cuda", all-gather on "cpu" (`_runtime_megatron_config`). The layer takes hidden states [s, b, hidden_size]
    and returns (output, None)."""
    from megatron.core.transformer.spec_utils import build_module

    number = layout_of(config).layer_numbers(LayerKind.MOE)[0]
    mcfg, pg_collection = _runtime_megatron_config(config, backend, device, params_dtype, None, None, seed)
    spec = moe_layer_spec(config, backend, experts)
    with nullcontext() if device == "cuda" else cuda_buffers_on(device), torch.device("meta") if device == "meta" else nullcontext():
        layer = build_module(spec, config=mcfg, layer_number=number, pg_collection=pg_collection, add_layer_offset=False)
    if device == "cuda":
        layer.cuda(torch.cuda.current_device())
    return layer
