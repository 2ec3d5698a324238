"""GPU: building outside `pretrain` (the model-parallel RNG seeded once), the proxy preset's bf16
forward/backward, and a short training run on real text whose loss falls. The last two print their
figures (GPU, peak memory, step time) for the validation manifest."""

from __future__ import annotations

import sysconfig
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper): the Mamba-3 and DSA kernels run on CUDA only"),
]


def _bf16_model(preset: str, config=None):
    from megatron.core.transformer.module import Float16Module

    from nam56r.model.model import build_model
    from nam56r.model.presets import get_preset
    from nam56r.model.specs import resolve_backend

    # bf16 parameters, as Megatron's --bf16 sets params_dtype: the layers cast their inputs to it.
    config = config or get_preset(preset)
    built = build_model(config, resolve_backend("auto"), device="cuda", params_dtype=torch.bfloat16, seed=0)
    model = built.model
    assert model.config.bf16 and model.config.params_dtype == torch.bfloat16
    return Float16Module(model.config, model), built


def test_a_build_outside_pretrain_seeds_the_model_parallel_rng_once(megatron_built) -> None:
    """No `pretrain` seeded Megatron's CUDA RNG tracker here: the first build seeds it from its
    `seed`, and a later one keeps that state."""
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME, get_cuda_rng_tracker

    from nam56r.model.model import build_model
    from nam56r.model.presets import get_preset
    from nam56r.model.specs import resolve_backend

    tracker, config, backend = get_cuda_rng_tracker(), get_preset("nam56r-tiny"), resolve_backend("auto")
    tracker.reset()
    first = build_model(config, backend, device="cuda", seed=5).model
    seeds = set(tracker.seeds_)
    assert _MODEL_PARALLEL_RNG_TRACKER_NAME in tracker.get_states() and 5 in seeds
    build_model(config, backend, device="cuda", seed=6)
    assert tracker.seeds_ == seeds  # the state the first build seeded is kept
    assert all(torch.isfinite(p).all() for p in first.parameters())


def _lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.size(1), device=inputs.device).expand_as(inputs)
    per_token = model(inputs, positions, None, labels=labels)
    return per_token.float().mean()


def test_proxy_forward_backward_bf16(megatron_built) -> None:
    """The proxy as the proxy-1gpu recipe trains it (IndexCache, DSA indexer path and MoE dispatch from the recipe).
    Every trainable parameter gets a gradient: Megatron's --overlap-grad-reduce issues a bucket's reduce-scatter
    only once each parameter in it has reported one, and asserts that at the next step's start."""
    from nam56r.model.specs import resolve_backend
    from nam56r.training.recipe import get_recipe

    recipe = get_recipe("proxy-1gpu")
    model, built = _bf16_model("nam56r-proxy", recipe.model_config(resolve_backend(recipe.kernels.backend)))
    assert built.index_cache_plan is not None and built.index_cache_plan.shared_layers
    seq = built.model.model_config.seq_length
    tokens = torch.randint(0, built.model.vocab_size, (1, seq + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = _lm_loss(model, tokens)
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    no_grad = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not no_grad, f"{len(no_grad)} trainable parameters got no gradient: {no_grad[:8]}"
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"PROXY_FWD_BWD_OK gpu={torch.cuda.get_device_name()} loss={loss.item():.4f} peak_gib={peak:.2f} step_s={min(times[1:]):.3f}")


def _text_tokens() -> torch.Tensor:
    """Bytes of the Python standard library's own source: real text, present on every host."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:40])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def test_tiny_training_run_loss_falls(megatron_built) -> None:
    model, built = _bf16_model("nam56r-tiny")
    stream = _text_tokens().cuda()
    seq, batch = built.model.model_config.seq_length, 8
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator(device="cpu").manual_seed(0)
    losses = []
    for _ in range(300):
        starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=generator)
        tokens = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])
        optimizer.zero_grad(set_to_none=True)
        loss = _lm_loss(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    # A model that learned only byte frequencies stops at the stream's unigram entropy; below it the
    # prediction uses context, which flows through every mixer (Mamba-3, MLA/DSA) and the MoE.
    counts = torch.bincount(stream, minlength=256).double()
    freq = counts[counts > 0] / counts.sum()
    unigram = -(freq * freq.log()).sum().item()
    print(f"TINY_LOSS_FALLS first20={first:.3f} last20={last:.3f} unigram_entropy={unigram:.3f}")
    assert all(v == v for v in losses), "a loss was NaN"
    assert last < first and last < unigram, (
        f"the last 20 steps' mean loss {last:.3f} is not below the first 20's ({first:.3f}) and the unigram entropy ({unigram:.3f})"
    )
