"""The launch gate: ranks (real subprocesses) wait after their imports until the launcher opens it, and exit
having built nothing when it refuses or is gone; and the launcher starting real torchrun ranks on this CPU
machine, whose failed preflight (no GPU) stops them at the gate."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nam56r.training.launcher.launch_gate import GATE_ENV, GATE_STOPPED_EXIT, LAUNCHER_PID_ENV, GateStopped, LaunchGate, wait_for_launch
from nam56r.training.launcher.startup_marks import STARTUP_T0_ENV, read_marks

RANK = "from nam56r.training.launcher.launch_gate import wait_for_launch; print('waited', wait_for_launch(poll_s=0.02), flush=True)"


def _rank(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RANK], env={**_base_env(), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in (GATE_ENV, LAUNCHER_PID_ENV, STARTUP_T0_ENV)}


def test_without_a_gate_a_rank_does_not_wait() -> None:
    assert wait_for_launch({}) is None


def test_a_rank_waits_until_the_gate_opens(tmp_path: Path) -> None:
    gate = LaunchGate.fresh(tmp_path / "run" / "launch.gate")
    rank = _rank(gate.env())
    time.sleep(1.0)
    assert rank.poll() is None  # still waiting
    gate.open()
    out, err = rank.communicate(timeout=60)
    assert rank.returncode == 0, err
    assert float(out.split()[-1]) >= 0.5


def test_a_refused_gate_stops_the_rank_with_the_reason(tmp_path: Path) -> None:
    gate = LaunchGate.fresh(tmp_path / "launch.gate")
    rank = _rank(gate.env())
    gate.refuse("TrainError: preflight failed")
    out, err = rank.communicate(timeout=60)
    assert rank.returncode == GATE_STOPPED_EXIT and "waited" not in out
    assert "the launcher stopped this run before Megatron started: TrainError: preflight failed" in err


def test_a_rank_whose_launcher_is_gone_stops(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rank = _rank({GATE_ENV: str(tmp_path / "launch.gate"), LAUNCHER_PID_ENV: str(gone.pid)})
    out, err = rank.communicate(timeout=60)
    assert rank.returncode == GATE_STOPPED_EXIT and f"the launcher (pid {gone.pid}) exited without opening the gate" in err


def test_a_verdict_written_before_the_launcher_exits_counts(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "launch.gate").write_text("go\n")
    assert wait_for_launch({GATE_ENV: str(tmp_path / "launch.gate"), LAUNCHER_PID_ENV: str(gone.pid)}) is not None


def test_an_unreadable_verdict_stops_the_rank(tmp_path: Path) -> None:
    (tmp_path / "launch.gate").write_text("maybe\n")
    with pytest.raises(GateStopped, match="holds 'maybe'"):
        wait_for_launch({GATE_ENV: str(tmp_path / "launch.gate")})


def test_a_fresh_gate_is_closed_even_over_an_earlier_launch(tmp_path: Path) -> None:
    (tmp_path / "launch.gate").write_text("go\n")
    gate = LaunchGate.fresh(tmp_path / "launch.gate")
    assert not gate.path.exists()


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, megatron_built) -> Path:
    from nam56r.training.data.build import CorpusConfig, build, torch_include_dir

    data = tmp_path_factory.mktemp("gate-data") / "cpp"
    build(data, 512, CorpusConfig(sources=(torch_include_dir(),), max_docs=20))
    return data


def _launch(data: Path, run_dir: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nam56r.training.launcher", "--recipe", "tiny-1gpu", "--data", str(data),
                           "--run-dir", str(run_dir), *options], env=_base_env(), capture_output=True, text=True, timeout=600)


def test_the_launcher_starts_real_ranks_and_its_failed_preflight_stops_them_at_the_gate(tmp_path: Path, small_data: Path) -> None:
    """No GPU here, so the preflight fails; by then torchrun has started the pretrain rank, which imported
    Megatron and waits at the gate. The launcher refuses it: the rank exits before Megatron parses a flag, the
    launcher exits 2 naming the preflight, and no run files are written."""
    run_dir = tmp_path / "run"
    proc = _launch(small_data, run_dir)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "error: preflight failed" in proc.stderr
    assert "the launcher stopped this run before Megatron started: TrainError: preflight failed" in output
    assert "using world size" not in output  # Megatron never parsed its arguments
    assert (run_dir / "launch-node0.gate").read_text().startswith("stop\n")
    assert not (run_dir / "model_config.json").exists()
    # The startup marks, launcher's and rank 0's, on the launcher's clock: torchrun starts before the checks.
    marks = read_marks(proc.stdout.splitlines())
    imported = "rank 0 imported torch, Megatron and NAM56R's modules"
    launcher = ("launcher: torchrun started", "launcher: kernel shapes checked", "launcher: data checked")
    for what in (*launcher, "rank 0 process started", imported):
        assert what in marks, (what, marks)
    assert marks["launcher: torchrun started"] <= marks["rank 0 process started"] <= marks[imported]
    assert marks["launcher: torchrun started"] < marks["launcher: kernel shapes checked"] < marks["launcher: data checked"]
    assert "launcher: launch gate opened" not in marks and "rank 0 passed the launch gate" not in marks


def test_a_kernel_shape_the_recipe_refuses_stops_the_ranks_at_the_gate(tmp_path: Path, small_data: Path) -> None:
    """The recipe's kernel shapes are checked while the ranks start: a refused one stops them at the gate, and
    the launcher reports the recipe's problem (exit 2), as a dry run reports it before anything starts."""
    proc = _launch(small_data, tmp_path / "run", "--seq", "520")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "error: recipe 'tiny-1gpu'" in proc.stderr and "top-k 520 is not a multiple of 64" in proc.stderr
    assert "the launcher stopped this run before Megatron started: RecipeError" in output
    dry = _launch(small_data, tmp_path / "dry", "--seq", "520", "--dry-run")
    assert dry.returncode == 2 and "top-k 520 is not a multiple of 64" in dry.stderr and "command:" not in dry.stdout


def test_a_recipe_checked_without_kernels_imports_no_upstream_and_leaves_the_kernel_shapes_to_kernel_problems() -> None:
    """What a real launch checks before starting torchrun imports neither Megatron nor TileLang; the kernel
    shapes (here the dense warm-up's top-k, the sequence length 520, not a multiple of the sparse MLA's 64) are
    then reported by `kernel_problems`, and `check()` with kernels refuses them as before."""
    code = (
        "import sys\n"
        "from nam56r.training.recipe import RecipeError, get_recipe\n"
        "recipe = get_recipe('tiny-1gpu', seq_length=520, kernels=False)\n"
        "print('imported', sorted(m for m in ('megatron', 'tilelang', 'mamba_ssm') if m in sys.modules))\n"
        "print('problems', len(recipe.kernel_problems()))\n"
        "try:\n    get_recipe('tiny-1gpu', seq_length=520)\n"
        "except RecipeError as exc:\n    print('refused', 'not a multiple of 64' in str(exc))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_base_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "imported []" and lines[1].startswith("problems ") and int(lines[1].split()[1]) >= 1
    assert lines[2] == "refused True"


def test_each_node_gates_its_own_ranks_in_a_shared_run_dir(tmp_path: Path) -> None:
    """Node 1's launcher starting (a fresh gate) neither removes nor answers node 0's verdict."""
    from nam56r.training.runs.layout import RunDir

    layout = RunDir(tmp_path)
    node0 = LaunchGate.fresh(layout.launch_gate(0))
    node0.open()
    node1 = LaunchGate.fresh(layout.launch_gate(1))
    assert node0.path != node1.path and node0.path.read_text() == "go\n" and not node1.path.exists()
    assert wait_for_launch(node0.env()) is not None
