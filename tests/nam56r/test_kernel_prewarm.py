"""nam56r.training.launcher.kernel_prewarm: the Mamba-3 MIMO factory calls are recorded from mamba's real entry points
(`mamba_mimo_forward`, `mamba_mimo_bwd_combined`) and replayed at other batches through the real @tilelang.jit
factories, whose TIR elaboration runs on CPU. The compile itself (TVM lowering, nvcc) and the recording through a
real Mamba-3 layer need a GPU; the GPU check is the prewarmed microbatch bench (first steps without compiles)."""

from __future__ import annotations

import importlib

import pytest
from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo_bwd, mamba3_mimo_fwd
from tilelang.jit import JITImpl

from nam56r.training.launcher import kernel_prewarm
from nam56r.training.launcher.kernel_prewarm import MIMO_FACTORIES, FactoryCall, PrewarmError, parse_sizes, recording
from tests.mamba.test_0004_mimo_jit_cache import CHUNK, CudaAllocationsOnCpu, N, R, backward, forward
from tests.mamba.test_0004_mimo_jit_cache import triton_epilogue as triton_epilogue  # noqa: F401 (fixture)

B, S, H, G = 2, 4 * CHUNK, 8, 2


@pytest.fixture
def recorded(triton_epilogue) -> list[FactoryCall]:  # noqa: F811
    calls: list[FactoryCall] = []
    with recording(calls), CudaAllocationsOnCpu():
        forward(mamba3_mimo_fwd.mamba_mimo_forward, B, S, H, G)
        backward(mamba3_mimo_bwd.mamba_mimo_bwd_combined, B, S, H, G)
    return calls


def test_recording_keeps_each_factory_call_of_the_real_entry_points_and_restores_the_factories(recorded: list[FactoryCall]) -> None:
    assert [call.name for call in recorded] == ["mamba_mimo_fwd", "mamba_mimo_bwd_fwd", "mamba_mimo_bwd_bwd"]
    for call in recorded:
        assert call.batch == B
        assert dict(call.arguments)["S"] == S and dict(call.arguments)["H"] == H
    for module, name in MIMO_FACTORIES:
        assert isinstance(getattr(importlib.import_module(module), name), JITImpl), f"{name} was not restored"


def test_a_call_at_another_batch_changes_only_B_and_the_real_factory_elaborates_it(recorded: list[FactoryCall]) -> None:
    for call in recorded:
        moved = call.at_batch(5)
        assert [k for k, v in moved.arguments if v != dict(call.arguments)[k]] == [kernel_prewarm.BATCH_ARGUMENT]
        shapes = {b.name: [int(d) for d in b.shape] for b in call.factory().get_tir(**dict(moved.arguments)).buffer_map.values()}
        assert shapes["Q"] == [5, S, R, G, N], call.name
    with pytest.raises(PrewarmError, match="at least 1"):
        recorded[0].at_batch(0)


def test_recording_refuses_a_factory_whose_batch_is_not_an_argument() -> None:
    """Megatron's sparse-MLA factory takes its batch as a TileLang dynamic shape: nothing to prewarm per batch."""
    module = "megatron.core.transformer.experimental_attention_variant.ops.tilelang_sparse_mla_fwd"
    calls: list[FactoryCall] = []
    with recording(calls, factories=[(module, "sparse_mla_fwd")]), pytest.raises(PrewarmError, match="no 'B' parameter"):
        importlib.import_module(module).sparse_mla_fwd(64, 512, 64, 256)
    assert calls == []


def test_a_failed_compile_names_the_kernel_and_batch() -> None:
    call = FactoryCall("json", "loads", (("B", 1), ("s", "{not json")))
    with pytest.raises(PrewarmError, match=r"compiling loads B=3 failed: .*TypeError"):
        kernel_prewarm.compile_at_batches([call], [3], jobs=1)


def test_recording_through_a_mamba3_layer_needs_a_gpu() -> None:
    import torch

    from nam56r.training.recipe import get_recipe

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the GPU check records through the real layer")
    with pytest.raises(PrewarmError, match="needs a CUDA GPU"):
        kernel_prewarm.record_mimo_calls(get_recipe("proxy-1gpu", kernels=False).model_config())


def test_micro_batch_sizes_are_numbers_and_inclusive_ranges() -> None:
    assert parse_sizes("1-4,8") == (1, 2, 3, 4, 8)
    assert parse_sizes("3, 2-3") == (3, 2)
    assert kernel_prewarm.format_sizes((1, 2, 3, 4)) == "1-4"
    assert kernel_prewarm.format_sizes((2, 4, 8)) == "2,4,8"
    for bad in ("0-3", "4-2", "a", ""):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_the_command_line_explains_itself_and_refuses_bad_sizes(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_help:
        kernel_prewarm.main(["--help"])
    assert exit_help.value.code == 0
    assert "--mbs SIZES" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_bad:
        kernel_prewarm.main(["--mbs", "0-2"])
    assert exit_bad.value.code == 2
    assert "go up from 1" in capsys.readouterr().err
