"""The indexer recall probe (nam56r.model.dsa_recall, nam56r.training.recall_probe) on NAM56R's real tiny DSA
layers on CPU: its recall against a brute-force one from the layer's own q, k, weights, query and key (Megatron's
index scores, the dense target of compute_dsa_indexer_loss, Python sets per row), 1.0 exactly when the indexer
ranks keys as attention does, the configured top-k during the dense warm-up, outputs and gradients unchanged,
the schedule through our forward and loss functions, and the refusals."""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import replace

import pytest
import torch

from nam56r.model.presets import get_preset

SEQ, TOPK = 48, 16


def recall_config(indexer: str = "megatron", index_cache: bool = True):
    """nam56r-tiny at 48 tokens and top-16: rows 16.. select among more keys than they keep."""
    base = get_preset("nam56r-tiny")
    return replace(base, seq_length=SEQ, dsa=replace(base.dsa, topk=TOPK, indexer=indexer),
                   index_cache=replace(base.index_cache, enabled=index_cache)).validate()


def brute_force_recall(attention, call: dict) -> tuple[float, int]:
    """(sum of row recalls, rows) from Megatron's own index scores (`_compute_index_scores`) and the dense target
    as `compute_dsa_indexer_loss` builds it (causal mask, softmax per head, summed over heads), row by row."""
    from megatron.core.transformer.experimental_attention_variant.dsa import _compute_index_scores

    with torch.no_grad():
        q, k, weights = attention.indexer.forward_before_topk(call["x"], call["qr"], None)
        scores = _compute_index_scores(q, weights, k, use_relu=attention.config.dsa_indexer_scoring_relu)  # [b, sq, sk]
        query, key = call["query"].float(), call["key"].float()
        key = key.expand(-1, -1, query.shape[2], -1)
        logits = torch.einsum("ibhd,jbhd->bhij", query, key) * attention.softmax_scale
        mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)
        target = torch.softmax(logits + mask, dim=-1).sum(dim=1)  # [b, sq, sk]
    topk, total, rows = attention.config.dsa_indexer_topk, 0.0, 0
    for b in range(scores.shape[0]):
        for i in range(SEQ):
            width = min(topk, i + 1)
            chosen = [set(t[b, i, : i + 1].topk(width).indices.tolist()) for t in (scores, target)]
            total += len(chosen[0] & chosen[1]) / width
            rows += 1
    return total, rows


def capture_calls(attention) -> list[dict]:
    """The arguments of each forward call of `attention`, by name (a pre-hook of the test's own)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    signature, calls = inspect.signature(DSAttention.forward), []

    def record(module, args, kwargs):
        bound = signature.bind(module, *args, **kwargs)
        bound.apply_defaults()
        calls.append({name: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for name, v in bound.arguments.items()})

    attention.register_forward_pre_hook(record, with_kwargs=True)
    return calls


def run_layers(built, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """The DSA layers one after another in training mode (a new IndexCache pass first), forward and backward:
    output, input gradient, parameter gradients (then cleared)."""
    from nam56r.model.model import cuda_buffers_on

    x = x.clone().requires_grad_()
    if built.topk_cache is not None:
        built.topk_cache.begin_forward()
    with cuda_buffers_on("cpu"):
        h = x
        for layer in built.layers.values():
            layer.train()
            out = layer(h, attention_mask=None)
            h = out[0] if isinstance(out, tuple) else out
        h.backward(grad_out)
    grads = {f"{n}.{name}": p.grad.clone() for n, layer in built.layers.items()
             for name, p in layer.named_parameters() if p.grad is not None}
    for layer in built.layers.values():
        layer.zero_grad(set_to_none=True)
    return {"output": h.detach(), "input grad": x.grad, "grads": grads}


@pytest.fixture(scope="module")
def layers(megatron_built):
    from nam56r.model.model import build_dsa_layers

    built = build_dsa_layers(recall_config(), "local")
    for layer in built.layers.values():  # peaked indexer scores, as in test_dsa_fused_indexer
        indexer = layer.self_attention.core_attention.indexer
        if indexer is None:  # an IndexCache Shared layer
            continue
        with torch.no_grad():
            for linear, scale in ((indexer.linear_wq_b, 8.0), (indexer.linear_wk, 8.0), (indexer.linear_weights_proj, 64.0)):
                linear.weight.mul_(scale)
    return built


def first_attention(built):
    return built.layers[min(built.layers)].self_attention.core_attention


def inputs(built, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = first_attention(built).config.hidden_size
    return torch.randn(SEQ, 2, hidden, generator=g), torch.randn(SEQ, 2, hidden, generator=g)


# ---- the measurement


def test_probe_recall_is_the_brute_force_one_on_the_layers_real_inputs(layers) -> None:
    from nam56r.model.dsa_recall import RecallHook

    attention = first_attention(layers)
    calls = capture_calls(attention)
    hook = RecallHook(attention)
    run_layers(layers, *inputs(layers))
    assert len(calls) == 1 and hook.sample is not None
    total, rows = brute_force_recall(attention, calls[0])
    assert hook.sample.rows == rows == 2 * SEQ and hook.sample.topk == TOPK
    assert hook.sample.recall_sum == pytest.approx(total, abs=1e-9)
    assert 0.2 < hook.sample.recall < 0.99, "a recall of 1 or 0 on random layers would test nothing"


def test_the_probe_fires_once_and_leaves_outputs_and_gradients_unchanged(layers) -> None:
    from nam56r.model.dsa_recall import RecallHook

    x, grad_out = inputs(layers, seed=1)
    plain = run_layers(layers, x, grad_out)
    hook = RecallHook(first_attention(layers))
    probed = run_layers(layers, x, grad_out)
    assert hook.sample is not None
    torch.testing.assert_close(probed["output"], plain["output"], rtol=0, atol=0)
    torch.testing.assert_close(probed["input grad"], plain["input grad"], rtol=0, atol=0)
    assert probed["grads"].keys() == plain["grads"].keys() and any("indexer" in name for name in plain["grads"])
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(probed["grads"][name], grad, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    first = hook.sample
    run_layers(layers, x, grad_out)
    assert hook.sample is first, "the hook fired again on a later forward"


def test_recall_uses_the_configured_topk_in_the_dense_warmup(layers) -> None:
    """Widened to every key (the warm-up), the layer attends densely, but recall stays at the recipe's top-k:
    the same value as in the sparse phase on the same inputs (the indexer's inputs do not depend on the phase)."""
    from nam56r.model.dsa_recall import RecallHook
    from nam56r.model.dsa_warmup import apply_dsa_phase

    attention, x, grad_out, samples = first_attention(layers), *inputs(layers, seed=2), {}
    try:
        for phase in ("dense-warmup", "sparse"):
            apply_dsa_phase(torch.nn.ModuleList(layers.layers.values()), phase, SEQ)
            hook = RecallHook(attention)
            run_layers(layers, x, grad_out)
            samples[phase] = hook.sample
    finally:
        apply_dsa_phase(torch.nn.ModuleList(layers.layers.values()), "sparse", SEQ)
    assert samples["dense-warmup"].topk == samples["sparse"].topk == TOPK
    assert samples["dense-warmup"].recall_sum == samples["sparse"].recall_sum < 2 * SEQ


def test_recall_is_one_exactly_when_the_indexer_ranks_keys_as_attention_does(megatron_built) -> None:
    """One indexer head scoring q . k without relu and one attention head on the same q and k: the softmax keeps
    the order, so recall is 1; keys scored in another order lose it. Row blocks of 5 rows cross the sequences' rows."""
    from nam56r.model.dsa_recall import indexer_recall

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(SEQ, 2, 1, 24, generator=g), torch.randn(SEQ, 2, 24, generator=g)
    weights = torch.ones(SEQ, 2, 1)
    kwargs = dict(topk=TOPK, softmax_scale=0.2, use_relu=False, block_elements=5 * SEQ)
    same = indexer_recall(q, k, weights, q, k.unsqueeze(2), **kwargs)
    assert same.rows == 2 * SEQ and same.recall == 1.0
    other = indexer_recall(q, -k, weights, q, k.unsqueeze(2), **kwargs)
    assert other.recall < 0.5
    rows_with_choice = 2 * (SEQ - TOPK)  # rows 0..15 keep every visible key in both sets
    assert other.recall_sum >= 2 * TOPK and other.recall_sum < 2 * TOPK + rows_with_choice


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"packed_seq_params": object()}, r"packed sequences"),
        ({"attn_mask_type": None}, r"attention mask type None"),
        ({"attention_mask": torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool)}, r"an explicit attention mask"),
        ({"key": torch.randn(SEQ - 8, 2, 1, 48)}, r"causal self-attention"),
    ],
)
def test_calls_the_probe_does_not_measure_are_refused(layers, overrides, message) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    from nam56r.model.dsa_recall import RecallUnsupported, layer_recall

    attention = first_attention(layers)
    call = dict(query=torch.randn(SEQ, 2, 4, 48), key=torch.randn(SEQ, 2, 1, 48), attention_mask=None, x=torch.randn(SEQ, 2, 64),
                qr=torch.randn(SEQ, 2, 32), attn_mask_type=AttnMaskType.causal, packed_seq_params=None)
    with pytest.raises(RecallUnsupported, match=r"indexer recall probe \(DSA layer 5\) does not support .*" + message):
        layer_recall(attention, {**call, **overrides})


FUSED_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r.model.dsa_recall import RecallHook
    from nam56r.model.model import build_dsa_layers
    from tests.nam56r.test_indexer_recall import brute_force_recall, capture_calls, first_attention, inputs, recall_config, run_layers

    torch.manual_seed(0)
    built = build_dsa_layers(recall_config("fused", index_cache=False), "local")
    attention = first_attention(built)
    assert attention.indexer_path == "fused"
    x, grad_out = inputs(built)
    plain = run_layers(built, x, grad_out)
    calls = capture_calls(attention)
    hook = RecallHook(attention)
    probed = run_layers(built, x, grad_out)
    torch.testing.assert_close(probed["output"], plain["output"], rtol=0, atol=0)
    torch.testing.assert_close(probed["input grad"], plain["input grad"], rtol=0, atol=0)
    total, rows = brute_force_recall(attention, calls[0])
    assert hook.sample.rows == rows and abs(hook.sample.recall_sum - total) < 1e-9, (hook.sample, total)
    print("fused recall ok", hook.sample.recall)
    """
)


def test_the_probe_measures_the_fused_indexer_path_too(run_interpreted, megatron_built) -> None:
    stdout = run_interpreted(FUSED_SCRIPT, timeout=900)
    assert "fused recall ok" in stdout, stdout
