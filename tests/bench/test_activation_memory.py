"""nam56r_bench.activation_ledger / activation_memory: the saved-tensor ledger's bytes equal a hand count for modules
whose backward needs are known, storages count once, and the per-layer accounting on nam56r-tiny runs every layer
type and grows linearly with the sequence length."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from nam56r_bench.activation_ledger import saved_bytes


def test_a_linear_saves_its_input_and_its_weight_which_is_a_parameter() -> None:
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(10, 64, requires_grad=True)
    ledger = saved_bytes(lambda: linear(x), linear, [x])
    assert ledger.bytes(("input",)) == 10 * 64 * 4
    assert ledger.bytes(("parameter",)) == 64 * 32 * 4
    assert ledger.bytes(("activation",)) == 0


def test_a_chain_counts_each_intermediate_once_with_its_dtype_size() -> None:
    """y = gelu(x W1^T) W2^T in bf16: the GELU's input (saved by the GELU) and its output (saved by the second linear);
    x (saved by the first) is the input."""
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(16, 48, bias=False).bfloat16(), torch.nn.Linear(48, 16, bias=False).bfloat16()
    model = torch.nn.Sequential(fc1, torch.nn.GELU(), fc2)
    x = torch.randn(7, 16, dtype=torch.bfloat16, requires_grad=True)
    ledger = saved_bytes(lambda: model(x), model, [x])
    assert ledger.bytes(("activation",)) == 2 * (7 * 48 * 2)
    assert ledger.bytes(("input",)) == 7 * 16 * 2
    assert {s.module for s in ledger.storages.values() if s.kind == "activation"} == {"1", "2"}


def test_views_and_repeated_saves_of_one_storage_count_once() -> None:
    x = torch.randn(8, 8, requires_grad=True)
    base = x * 2  # one storage, saved through two views by two multiplications
    ledger = saved_bytes(lambda: (base[:4] * base[4:]).sum() + (base * base).sum(), None, [x])
    [storage] = [s for s in ledger.storages.values() if s.kind == "activation"]
    assert storage.nbytes == 8 * 8 * 4 and storage.saves >= 3
    assert ledger.bytes() == 8 * 8 * 4


def test_rms_norm_stand_in_saves_what_the_cuda_kernel_saves() -> None:
    """torch's RMSNorm under the stand-ins: its bf16 input and an fp32 rstd per row, nothing else."""
    from nam56r_bench.activation_stand_ins import gpu_kernel_stand_ins

    norm = torch.nn.RMSNorm(256, eps=1e-5).bfloat16()
    x = torch.randn(12, 256, dtype=torch.bfloat16, requires_grad=True)
    with gpu_kernel_stand_ins():
        ledger = saved_bytes(lambda: norm(x), norm, [x])
        out = norm(x)
    assert ledger.bytes(("input",)) == 12 * 256 * 2
    assert ledger.bytes(("activation",)) == 12 * 4
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (256,), norm.weight, 1e-5))


def test_the_layer_count_of_the_full_model_is_its_pattern(megatron_built) -> None:
    from nam56r_bench.activation_memory import layer_counts

    from nam56r.model.presets import get_preset

    counts = layer_counts(get_preset("nam56r"))  # IndexCache off in the preset: every DSA layer has its indexer
    assert counts["mamba3 M"] == 17 and counts["moe E"] == 22 and counts["mla *"] == 4 + 2
    assert counts["dsa D (indexer)"] + counts["dsa D (shared top-k)"] == 9 and counts["mtp mlp -"] == 2
    assert sum(counts[k] for k in ("mamba3 M", "moe E", "dsa D (indexer)", "dsa D (shared top-k)")) + 4 == 52


@pytest.fixture(scope="module")
def tiny_rows(megatron_built, tmp_path_factory) -> dict:
    """The tool's command on nam56r-tiny at three lengths (two runs: 256/512 and 256/768), each a fresh process (it
    runs the Triton kernels under the interpreter, which must be switched on before triton is imported)."""
    out = tmp_path_factory.mktemp("am")
    rows = {}
    for second in (512, 768):
        path = out / f"{second}.json"
        command = [sys.executable, "-m", "nam56r_bench.activation_memory", "--recipe", "tiny-1gpu", "--preset", "nam56r-tiny",
                   "--lengths", "256", str(second), "--json", str(path)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows[second] = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
    return rows


def test_every_layer_type_of_tiny_is_measured_and_saves_something(tiny_rows) -> None:
    names = set(tiny_rows[512])
    assert names == {"mamba3 M", "mla *", "mtp mlp -", "moe E", "dsa D (indexer)", "dsa D (shared top-k)", "ngram embedding"}
    for name, row in tiny_rows[512].items():
        assert row["bytes_at"]["512"] > row["bytes_at"]["256"] > 0, name


def test_saved_bytes_are_linear_in_the_sequence_length(tiny_rows) -> None:
    """The per-token slope from 256->512 predicts the bytes at 768 within 1 % (the stand-ins keep no [s, s] tensor)."""
    for name, row in tiny_rows[512].items():
        predicted = row["bytes_at"]["512"] + row["per_token"] * 256
        measured = tiny_rows[768][name]["bytes_at"]["768"]
        assert abs(predicted - measured) <= 0.01 * measured, (name, predicted, measured)


def test_the_indexer_layer_saves_more_than_a_shared_one_by_its_indexer(tiny_rows) -> None:
    full, shared = tiny_rows[512]["dsa D (indexer)"], tiny_rows[512]["dsa D (shared top-k)"]
    assert full["per_token"] > shared["per_token"]
    assert any("indexer" in m or m.endswith("core_attention") for m in full["by_module"])
