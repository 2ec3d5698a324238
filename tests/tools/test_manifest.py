"""`manifest add/list`: append-only validation records in patches/manifest.toml, stamped with the host."""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import platform
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from nam56r_patchlane.errors import PatchlaneError
from nam56r_patchlane.manifest import HostStamp, Record, TrainRecord, append_record, merge_records, parse_host_line, record_from_table
from nam56r_patchlane.patchfile import read_patch
from patchlane_testlib import Lane

WHAT = "patches/fakeup/0001-core-scale.patch"
HOST_KEYS = {"gpu", "capability", "driver", "python", "torch", "triton", "cuda"}


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stamp as a CPU host even where a GPU is present."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def diff_sha256(lane: Lane, name: str) -> str:
    return hashlib.sha256(read_patch(lane.patches / name).diff.encode()).hexdigest()


def add(lane: Lane, python: str, *extra: str) -> None:
    result = lane.run("manifest", "add", "--what", WHAT, "-u", "fakeup", "--command", "pytest tests/x -q", *extra, "--python", python)
    assert result.code == 0, result.text
    assert "appended to" in result.out and "host: gpu=cpu" in result.out


def records(lane: Lane) -> list[dict]:
    return tomllib.loads((lane.root / "patches" / "manifest.toml").read_text())["record"]


def test_manifest_add_appends_a_valid_stamped_record_and_keeps_earlier_ones(lane: Lane, bare_python: str) -> None:
    manifest = lane.root / "patches" / "manifest.toml"
    add(lane, bare_python, "--exit-code", "0", "--sentinel", "LOSS_OK", "--sentinel", "NO_NAN", "--figures", "peak 1.5 GiB")
    first_text = manifest.read_text()
    (first,) = records(lane)

    assert first_text.startswith("# Validation manifest")
    assert first["what"] == WHAT
    assert first["upstream"] == "fakeup"
    assert first["upstream_commit"] == lane.fake.pinned
    assert first["patch_sha256"] == diff_sha256(lane, "0001-core-scale.patch")
    assert first["command"] == "pytest tests/x -q"
    assert first["exit_code"] == 0
    assert first["sentinels"] == ["LOSS_OK", "NO_NAN"]
    assert first["figures"] == "peak 1.5 GiB"
    assert first["date"].endswith("Z")
    assert first["host"] == {"gpu": "cpu", "capability": "", "driver": first["host"]["driver"],
                             "python": platform.python_version(), "torch": "", "triton": "", "cuda": ""}

    # A header-only edit (the patch got filed upstream) keeps the checksum of what was validated.
    patch = lane.patches / "0001-core-scale.patch"
    before = patch.read_text()
    patch.write_text(before.replace("Upstream-Status: not-for-upstream: a test fixture", "Upstream-Status: filed https://example.invalid/pr/1"))
    assert patch.read_text() != before
    add(lane, bare_python, "--exit-code", "3", "--sentinel", 'quote " and \\ backslash')
    text = manifest.read_text()
    both = records(lane)

    assert text.startswith(first_text)  # append-only: the first record's bytes are unchanged
    assert len(both) == 2
    assert both[0] == first
    assert both[1]["exit_code"] == 3 and both[1]["sentinels"] == ['quote " and \\ backslash']
    assert both[1]["patch_sha256"] == first["patch_sha256"]

    listed = lane.run("manifest", "list")
    assert listed.code == 0
    rows = [line for line in listed.out.splitlines() if WHAT in line]
    assert len(rows) == 2 and " cpu " in rows[0] and "LOSS_OK NO_NAN" in rows[0]
    assert lane.run("manifest").out == listed.out  # `manifest` alone lists as well


def test_manifest_stamps_the_target_interpreters_torch(lane: Lane) -> None:
    add(lane, sys.executable, "--exit-code", "0")

    (record,) = records(lane)
    assert set(record["host"]) == HOST_KEYS
    assert record["host"]["gpu"] == "cpu"
    assert record["host"]["torch"] == importlib.metadata.version("torch")


def test_manifest_list_without_records(lane: Lane) -> None:
    result = lane.run("manifest")

    assert result.code == 0
    assert "(no records)" in result.out


def test_manifest_add_accepts_global_options_after_the_command(lane: Lane) -> None:
    result = Lane.main([
        "manifest", "add", "--what", WHAT, "-u", "fakeup", "--command", "true", "--exit-code", "0",
        "--host-line", "host: gpu=cpu driver=- python=3.11.7 torch=- triton=- cuda=-", "--root", str(lane.root),
    ])

    assert result.code == 0, result.text
    assert len(records(lane)) == 1


def test_manifest_add_with_a_remote_host_line_records_that_host(lane: Lane) -> None:
    line = "host: gpu=NVIDIA H100 80GB HBM3 (sm 9.0) driver=570.86.15 python=3.11.7 torch=2.13.0+cu128 triton=3.6.0 cuda=12.8"

    result = lane.run("manifest", "add", "--what", WHAT, "-u", "fakeup", "--command", "repro.py", "--exit-code", "0",
                      "--host-line", line)

    assert result.code == 0, result.text
    (record,) = records(lane)
    assert record["host"] == {
        "gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "driver": "570.86.15", "python": "3.11.7",
        "torch": "2.13.0+cu128", "triton": "3.6.0", "cuda": "12.8",
    }
    assert "gpu=NVIDIA H100 80GB HBM3 (sm 9.0)" in result.out


def test_manifest_add_for_an_unknown_upstream_names_the_known_ones(lane: Lane) -> None:
    result = lane.run("manifest", "add", "--what", WHAT, "-u", "nope", "--command", "true", "--exit-code", "0")

    assert result.code == 1
    assert "unknown upstream 'nope'" in result.err and "fakeup" in result.err
    assert not (lane.root / "patches" / "manifest.toml").exists()


def test_merge_appends_only_the_records_this_manifest_lacks(lane: Lane, tmp_path) -> None:
    import shutil

    args = ("manifest", "add", "--what", "pack:02-x", "-u", "fakeup", "--command", "c", "--exit-code", "0",
            "--host-line", "host: gpu=NVIDIA H100 80GB HBM3 (sm 9.0) driver=580 python=3.12.3 torch=2.11 triton=3.6.0 cuda=13.0")
    assert lane.run(*args, "--sentinel", "FIX_VALIDATED").code == 0
    remote = tmp_path / "remote.toml"
    shutil.copy(lane.root / "patches" / "manifest.toml", remote)
    remote_root = tmp_path / "remote-root"
    (remote_root / "patches").mkdir(parents=True)
    shutil.copy(remote, remote_root / "patches" / "manifest.toml")
    other = Lane(remote_root, lane.cache, lane.fake)
    (remote_root / "third_party").mkdir()
    shutil.copy(lane.root / "third_party" / "upstreams.toml", remote_root / "third_party" / "upstreams.toml")
    assert other.run(*args, "--sentinel", "BUG_REPRODUCED").code == 0

    first = lane.run("manifest", "merge", str(remote_root / "patches" / "manifest.toml"))
    again = lane.run("manifest", "merge", str(remote_root / "patches" / "manifest.toml"))

    assert first.code == 0 and "1 record(s)" in first.out
    assert again.code == 0 and "0 record(s)" in again.out
    listed = lane.run("manifest", "list").out
    assert "FIX_VALIDATED" in listed and "BUG_REPRODUCED" in listed


def train_record(**changes) -> TrainRecord:
    fields = dict(
        what="train:tiny-1gpu",
        host=parse_host_line("host: gpu=NVIDIA H100 80GB HBM3 (sm 9.0) driver=580 python=3.12.3 torch=2.11 triton=3.6.0 cuda=13.0"),
        commit="3f47172" + "0" * 33, dirty=False, command="torchrun --nproc-per-node 1 -m nam56r.training.pretrain --train-iters 20",
        exit_code=0, sentinels=(), date="2026-11-24T10:00:00Z", run_dir="runs/gpu-check/train/full", recipe="tiny-1gpu",
        preset="nam56r-tiny", world_size=1, seq_length=256, global_batch_size=16, first_step=1, last_step=20,
        loss_first=6.25, loss_final=4.5, tokens_per_s_per_gpu=41234.5, tflops_per_s_per_gpu=1.25, peak_memory_gib=3.5,
        time_to_first_step_s=95.0, figures="lm loss 6.25 -> 4.50",
    )
    return TrainRecord(**{**fields, **changes})


def test_a_train_record_round_trips_beside_validation_records(lane: Lane) -> None:
    add(lane, sys.executable, "--exit-code", "0")
    record = train_record()

    append_record(lane.root, record)

    validation, train = records(lane)
    assert validation["what"] == WHAT and "kind" not in validation
    assert train["kind"] == "train" and train["dirty"] is False and train["loss_final"] == 4.5 and train["last_step"] == 20
    assert record_from_table(train) == record
    listed = lane.run("manifest", "list")
    assert listed.code == 0 and "train:tiny-1gpu" in listed.out and "NVIDIA H100 80GB HBM3" in listed.out


def test_a_train_record_leaves_out_what_the_run_did_not_log_and_keeps_a_diverged_loss(lane: Lane, tmp_path) -> None:
    record = train_record(peak_memory_gib=None, time_to_first_step_s=None, loss_final=math.nan)

    append_record(lane.root, record)

    (raw,) = records(lane)
    assert "peak_memory_gib" not in raw and "time_to_first_step_s" not in raw
    assert math.isnan(raw["loss_final"])
    back = record_from_table(raw)
    assert back.peak_memory_gib is None and back.time_to_first_step_s is None and math.isnan(back.loss_final)
    other = tmp_path / "other"
    (other / "patches").mkdir(parents=True)
    assert merge_records(other, lane.root / "patches" / "manifest.toml") == 1
    assert merge_records(other, lane.root / "patches" / "manifest.toml") == 0  # nan != nan must not duplicate it
    (merged,) = tomllib.loads((other / "patches" / "manifest.toml").read_text())["record"]
    assert merged["kind"] == "train" and merged["what"] == "train:tiny-1gpu" and math.isnan(merged["loss_final"])


def test_an_append_to_a_manifest_that_is_not_valid_toml_writes_nothing(lane: Lane) -> None:
    manifest = lane.root / "patches" / "manifest.toml"
    append_record(lane.root, train_record())
    broken = manifest.read_text().replace("[record.host]", "[record.host", 1)  # a hand edit gone wrong
    manifest.write_text(broken)

    with pytest.raises(PatchlaneError, match="would make it invalid TOML"):
        append_record(lane.root, train_record())

    assert manifest.read_text() == broken


WRITER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tools!r})
from nam56r_patchlane.cli import main
root, go, who, count = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
while not go.exists():
    time.sleep(0.002)
for i in range(count):
    code = main(["--root", root, "manifest", "add", "--what", f"pack:{{who}}-{{i}}", "-u", "fakeup", "--command", "c",
                 "--exit-code", "0", "--host-line", "host: gpu=cpu driver=- python=3.11.7 torch=- triton=- cuda=-"])
    if code:
        sys.exit(code)
"""
READER = """
import sys, time, tomllib
from pathlib import Path
path, stop = Path(sys.argv[1]), Path(sys.argv[2])
reads = broken = 0
while not stop.exists():
    if path.exists():
        reads += 1
        try:
            tomllib.loads(path.read_text())["record"]
        except (tomllib.TOMLDecodeError, KeyError):
            broken += 1
print(reads, broken)
"""


def test_processes_appending_at_once_keep_every_record_and_a_valid_file(lane: Lane, tmp_path) -> None:
    """Real processes through the real CLI, released together; a reader beside them never sees a partial file."""
    tools = str(Path(__file__).resolve().parents[2] / "tools")
    writers, each = 8, 25
    manifest = lane.root / "patches" / "manifest.toml"
    go, stop = tmp_path / "go", tmp_path / "stop"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER.format(tools=tools), str(lane.root), str(go), f"w{n}", str(each)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for n in range(writers)]
    reader = subprocess.Popen([sys.executable, "-c", READER, str(manifest), str(stop)], stdout=subprocess.PIPE, text=True)
    time.sleep(2.0)  # every writer has imported the CLI and waits for `go`
    go.touch()
    errors = [p.communicate(timeout=300)[1] for p in procs]
    stop.touch()
    reads, broken = map(int, reader.communicate(timeout=60)[0].split())

    assert [p.returncode for p in procs] == [0] * writers, errors
    whats = sorted(r["what"] for r in records(lane))
    assert whats == sorted(f"pack:w{n}-{i}" for n in range(writers) for i in range(each))
    assert manifest.read_text().startswith("# Validation manifest")
    assert reads > 0 and broken == 0
    assert not list(manifest.parent.glob(".manifest.toml.*.tmp"))  # no temporary file left behind


def test_threads_of_one_process_append_one_at_a_time(tmp_path: Path) -> None:
    """gpu-check's parts run in threads of one process and each appends records: the manifest lock
    makes each thread wait for the other's read-modify-write, as it does between processes."""
    import threading

    host = HostStamp("cpu", "", "", "3.11", "", "", "")
    records = [Record(what=f"t{i}", upstream="u", upstream_commit="c", patch_sha256="", host=host, command="x", exit_code=0,
                      sentinels=(), date="2026-11-23T00:00:00Z") for i in range(120)]
    start = threading.Barrier(4)

    def worker(chunk: list[Record]) -> None:
        start.wait()
        for record in chunk:
            append_record(tmp_path, record)

    threads = [threading.Thread(target=worker, args=(records[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    written = tomllib.loads((tmp_path / "patches" / "manifest.toml").read_text())["record"]
    assert sorted(r["what"] for r in written) == sorted(r.what for r in records)
