"""nam56r_bench.mimo_bwd_sweep (the kernels suite's `mamba-mimo-bwd` group): what can be checked without a GPU.

The calls it sweeps are mamba's own: recorded here through the real `mamba_mimo_bwd_combined` on CPU (TIR elaboration
runs on CPU; the compile and the Triton kernels around it are replaced as in tests/mamba/test_0004_mimo_jit_cache.py),
and the kernel arguments the worker builds are checked, buffer by buffer, against the tensors that entry point hands
the kernels. The timing and the comparison themselves need the GPU (`nox -s bench -- kernels --kernel-cases
mamba-mimo-bwd`)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo_bwd
from mamba_ssm.ops.triton.mamba3 import mamba3_mimo_utils
from nam56r_bench import mimo_bwd_sweep as sweep
from nam56r_bench import mimo_bwd_worker as worker
from nam56r_bench.harness import BASELINE_PREFIXES, BenchError, Context, ratios
from nam56r_bench.kernel_shapes import FULL_SWEEP, QUICK_SWEEP, kernel_shapes

from nam56r.model.presets import get_preset
from nam56r.training.launcher.kernel_prewarm import FactoryCall, recording
from tests.bench.mimo_bwd_stub_worker import MEASURED, stub_worker
from tests.mamba.test_0004_mimo_jit_cache import CudaAllocationsOnCpu
from tests.mamba.test_0004_mimo_jit_cache import compiler as compiler  # noqa: F401 (fixture)
from tests.mamba.test_0004_mimo_jit_cache import triton_epilogue as triton_epilogue  # noqa: F401 (fixture)

SMALL = worker.Dims(B=2, S=64, H=8, G=2, N=16, P=8, R=4, chunk_size=16, rotary_dim_divisor=4, dtype="bfloat16")
FACTORIES = {worker.BWD_FWD: mamba3_mimo_bwd.mamba_mimo_bwd_fwd, worker.BWD_BWD: mamba3_mimo_bwd.mamba_mimo_bwd_bwd}


def decays_of_the_right_shapes(adt: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, ...]:
    """compute_dacs_segsum_triton's outputs (a GPU kernel): shapes and dtype only."""
    b, h, s = adt.shape
    return torch.zeros_like(adt), torch.zeros_like(adt), torch.zeros(b, h, s // chunk_size, chunk_size, chunk_size)


@pytest.fixture
def inputs(monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(mamba3_mimo_utils, "compute_dacs_segsum_triton", decays_of_the_right_shapes)
    return worker.backward_inputs(SMALL, "cpu")[0]


def mambas_backward(inputs: dict[str, torch.Tensor]) -> tuple:
    with CudaAllocationsOnCpu():
        return mamba3_mimo_bwd.mamba_mimo_bwd_combined(**inputs, chunk_size=SMALL.chunk_size,
                                                       rotary_dim_divisor=SMALL.rotary_dim_divisor, dtype=torch.bfloat16)


@pytest.fixture
def current(inputs, triton_epilogue) -> dict[str, FactoryCall]:  # noqa: F811
    calls: list[FactoryCall] = []
    with recording(calls, factories=[(mamba3_mimo_bwd.__name__, name) for name in FACTORIES]):
        mambas_backward(inputs)
    return {call.name: call for call in calls}


def test_the_sweep_takes_mambas_own_calls_and_their_shapes(current: dict[str, FactoryCall]) -> None:
    assert sorted(current) == sorted(sweep.SWEPT_FACTORIES)
    for name, call in current.items():
        assert worker.dims_of(call) == SMALL
        # the launch configuration mamba_mimo_bwd_combined passes (bf_/bb_threads, num_stages): the reference rows
        assert sweep._config(call) == {"threads": 128 if name == worker.BWD_FWD else 256, "num_stages": 0, "chunk_size": 16}
    with pytest.raises(worker.SweepError, match="hasZ=False"):
        worker.dims_of(FactoryCall("m", "f", tuple({**dict(current[worker.BWD_FWD].arguments), "hasZ": False}.items())))


def test_every_candidate_changes_only_its_settings_of_its_own_kernels(current: dict[str, FactoryCall]) -> None:
    planned = sweep.plan(current)
    assert [p.candidate for p in planned] == list(sweep.CANDIDATES) and all(p.skipped is None for p in planned)
    assert len({(c.target, c.label()) for c in sweep.CANDIDATES}) == len(sweep.CANDIDATES)
    for p in planned:
        targets = sweep.SWEPT_FACTORIES if p.candidate.target == worker.BACKWARD else (p.candidate.target,)
        assert sorted(p.calls) == sorted(targets)
        for name, call in p.calls.items():
            changed = {k: v for k, v in call.arguments if v != dict(current[name].arguments)[k]}
            assert changed == dict(p.candidate.settings), (p.candidate, name)
    # only the backward-wide candidate changes the blocking; the kernel ones keep mamba's chunk size
    assert {p.candidate.target for p in planned if "chunk_size" in dict(p.candidate.settings)} == {worker.BACKWARD}


def test_the_current_configuration_and_an_untaken_chunk_size_are_kept_with_the_reason(current) -> None:
    again = sweep.Candidate(worker.BWD_BWD, (("threads", 256),), "mamba's own")
    too_big = sweep.Candidate(worker.BACKWARD, (("chunk_size", 32),), "R x 32 = 128 > 64")
    planned = sweep.plan(current, [again, too_big])
    assert planned[0].skipped == "this is the current configuration"
    assert "chunk_size 32 is outside" in planned[1].skipped


def test_the_settings_are_parameters_of_the_real_factories_and_an_unknown_one_is_refused() -> None:
    for candidate in sweep.CANDIDATES:
        for name in sweep.SWEPT_FACTORIES if candidate.target == worker.BACKWARD else (candidate.target,):
            assert {k for k, _ in candidate.settings} <= set(FACTORIES[name].signature.parameters), (candidate, name)
    call = FactoryCall(mamba3_mimo_bwd.__name__, worker.BWD_BWD, (("B", 4), ("num_threads", 256)))
    with pytest.raises(worker.SweepError, match="takes no threads .*it takes B, num_threads.*update CANDIDATES"):
        sweep.with_settings(call, (("threads", 128),))


def test_the_worker_passes_each_kernel_the_tensors_mambas_backward_passes(inputs, compiler, triton_epilogue) -> None:  # noqa: F811
    mambas_backward(inputs)
    launched = {}
    for name in sweep.SWEPT_FACTORIES:
        (kernel,) = compiler.named(f"{name}_kernel")
        (launched[name],) = kernel.launches
        available = {worker.WRAPPER_TO_BUFFER[k]: v for k, v in inputs.items()}
        if name == worker.BWD_BWD:
            names = [b for b, _, _ in worker.kernel_buffers(compiler.named(f"{worker.BWD_FWD}_kernel")[0])]
            available |= {b: launched[worker.BWD_FWD][names.index(b)] for b in worker.PASSED_ON}
        args, outputs = worker.kernel_arguments(kernel, name, available, "cpu")
        for (buffer, _, _), ours, mambas in zip(worker.kernel_buffers(kernel), args, launched[name], strict=True):
            if buffer in worker.OUTPUTS[name]:
                assert (ours.shape, ours.dtype) == (mambas.shape, mambas.dtype), buffer
                assert bool(ours.isnan().all()), f"{buffer} is not NaN-filled: an unwritten element would not show"
            else:
                assert ours is mambas, f"{name}: {buffer} is not the tensor mamba passes"
        assert sorted(outputs) == sorted(worker.OUTPUTS[name])


def test_a_kernel_whose_buffers_changed_is_refused_by_name(inputs, compiler, triton_epilogue) -> None:  # noqa: F811
    mambas_backward(inputs)
    (kernel,) = compiler.named(f"{worker.BWD_FWD}_kernel")
    available = {worker.WRAPPER_TO_BUFFER[k]: v for k, v in inputs.items()}
    with pytest.raises(worker.SweepError, match="takes DOUT, which the sweep neither builds"):
        worker.kernel_arguments(kernel, worker.BWD_FWD, {k: v for k, v in available.items() if k != "DOUT"}, "cpu")
    available["TRAP"] = available["TRAP"].float()
    with pytest.raises(worker.SweepError, match=r"TRAP is \(2, 8, 64\) bfloat16, the sweep built .*float32"):
        worker.kernel_arguments(kernel, worker.BWD_FWD, available, "cpu")


def test_the_blocking_candidate_elaborates_at_nam56rs_shapes() -> None:
    """At NAM56R's shapes (the preset's, micro-batch 4) chunk_size 8 is one mamba takes, and the real factories build
    its TIR (the compile is the GPU's)."""
    model = get_preset("nam56r")
    m = model.mamba
    (candidate,) = [c for c in sweep.CANDIDATES if c.target == worker.BACKWARD]
    for name, factory in FACTORIES.items():
        bound = factory.signature.bind(B=4, S=model.seq_length, H=m.num_heads(model.hidden_size), G=m.ngroups, N=m.d_state,
                                       P=m.head_dim, R=m.mimo_rank, hasZ=True, hasD=True, reduceO=True,
                                       chunk_size=m.chunk_size, rotary_dim_divisor=int(2 / m.rope_fraction), dtype="bfloat16")
        bound.apply_defaults()
        call = FactoryCall(mamba3_mimo_bwd.__name__, name, tuple(bound.arguments.items()))
        (planned,) = sweep.plan({n: call for n in sweep.SWEPT_FACTORIES}, [candidate])
        assert planned.skipped is None
        tir = factory.get_tir(**dict(planned.calls[name].arguments))
        shapes = {b.name: [int(d) for d in b.shape] for b in tir.buffer_map.values()}
        assert shapes["SEGSUM"] == [4, 128, 4096 // 8, 8, 8] and shapes["Q"] == [4, 4096, 4, 8, 128], name


def test_the_case_group_is_registered_and_refuses_without_a_gpu(tmp_path: Path) -> None:
    from nam56r_bench import cli, kernel_suite

    assert kernel_suite.CASE_GROUPS["mamba-mimo-bwd"] is sweep.mimo_bwd_cases
    assert (FULL_SWEEP.mimo_bwd_batches, QUICK_SWEEP.mimo_bwd_batches) == ((4, 8), (4,))
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the sweep runs there")
    ctx = Context(out_dir=tmp_path, quick=True, kernel_cases=("mamba-mimo-bwd",))
    with pytest.raises(BenchError, match="needs a CUDA GPU"):
        sweep.mimo_bwd_cases(ctx, kernel_shapes(), QUICK_SWEEP)
    with pytest.raises(BenchError, match="needs a CUDA GPU"):
        kernel_suite.run(ctx)
    assert cli.main(["kernels", "--kernel-cases", "mamba-mimo-bwd", "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())


def planned(*behaviours: str) -> list[sweep.Planned]:
    candidate = sweep.Candidate(worker.BWD_BWD, (("threads", 128),), "test")
    return [sweep.Planned(i, replace(candidate, settings=(("threads", i),)), {"behaviour": b}) for i, b in enumerate(behaviours)]


def test_a_candidate_that_fails_hangs_or_crashes_costs_only_its_own_row() -> None:
    work = planned("ok", "hang", "raise", "crash", "ok")
    reference, results = sweep.measure_batch({}, work, True, worker=stub_worker, candidate_timeout=4)
    assert reference.get(worker.BWD_BWD) == {"time_ms": 4.0}, (reference, results)
    assert results[0] == results[4] == MEASURED
    assert "no result within 4 s (a hang?)" in results[1]["error"]
    assert results[2] == {"error": "RuntimeError: launch failed"}
    assert "exit code 3" in results[3]["error"]


@pytest.mark.parametrize(("reference", "message"), [("fatal", "the reference broke"), ("crash", "the reference run failed: .*exit code 5")])
def test_a_reference_that_cannot_run_leaves_every_candidate_unmeasured_with_the_cause(reference: str, message: str) -> None:
    ref, results = sweep.measure_batch({"reference": reference}, planned("ok", "ok"), True, worker=stub_worker)
    assert ref.keys() == {"error"}
    assert sorted(results) == [0, 1] and all(r["error"].startswith("not measured") for r in results.values())
    assert re.search(message, results[0]["error"])


def test_every_planned_candidate_gets_a_row_and_the_reference_is_the_ratios_baseline(current, monkeypatch) -> None:
    work = sweep.plan(current)
    broken = work[1].calls[worker.BWD_FWD]
    compiled = {c: (None, "CompileError: out of shared memory") if c == broken else (40.0, None)
                for c in [*current.values(), *(c for p in work for c in p.calls.values())]}
    fake = {p.index: {**MEASURED, "reference_ms": 2.0} for p in work if p.index != 1}
    monkeypatch.setattr(sweep, "measure_batch", lambda cur, runnable, quick: (
        {worker.BWD_FWD: {"time_ms": 2.0}, worker.BWD_BWD: {"time_ms": 4.0}}, {p.index: fake[p.index] for p in runnable}))
    rows = sweep.batch_rows(2, current, work, compiled, quick=True)
    references = [r for r in rows if r.variant.startswith(BASELINE_PREFIXES)]
    assert [r.variant for r in references] == ["upstream config (threads=128, num_stages=0, chunk_size=16)",
                                               "upstream config (threads=256, num_stages=0, chunk_size=16)",
                                               "upstream config (chunk_size=16)"]
    assert len(rows) == len(references) + len(work)
    (failed,) = [r for r in rows if "error" in r.extra]
    assert failed.variant == work[1].candidate.label() and "failed to compile: CompileError: out of shared memory" in failed.extra["error"]
    assert {(r["case"], r["against"]) for r in ratios(rows)} == {(r.case, r.variant) for r in references}


def test_a_failed_compile_is_kept_with_its_error_and_the_others_still_compile() -> None:
    good, bad = FactoryCall("json", "loads", (("s", "1"),)), FactoryCall("json", "loads", (("s", "{not json"),))
    results = sweep.compile_calls([good, bad, good], jobs=2)
    assert results[good][1] is None and results[good][0] >= 0
    assert results[bad][0] is None and results[bad][1].startswith("JSONDecodeError")

