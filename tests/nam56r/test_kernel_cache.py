"""The portable kernel cache: its key refuses or ignores another stack's cache, never uses one silently; Triton's own
cache manager finds a moved cache's kernels once it is opened; the build stamps TileLang's library as every node does;
the launcher and gpu-check take the cache as documented."""

from __future__ import annotations

import calendar
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nam56r.training.launcher import kernel_cache as kc
from nam56r.training.launcher.kernel_cache_cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
KEY = kc.CacheKey(gpu="NVIDIA H200", capability="9.0", driver="580.159.04", cuda="13.0", python="3.12.3",
                  torch="2.11.0+cu130", triton="3.6.0", tilelang="0.1.8", tilelang_lib="libtilelang.so:9174664:1771246536000000000")


def test_a_new_directory_is_created_with_the_hosts_key_and_pointed_at_by_each_compiler(tmp_path: Path) -> None:
    use = kc.open_cache(tmp_path / "cache", KEY)
    assert use.state == "created"
    assert kc.read_manifest(tmp_path / "cache").key == KEY
    assert use.env == {"TRITON_CACHE_DIR": str(tmp_path / "cache" / "triton"),
                       "TILELANG_CACHE_DIR": str(tmp_path / "cache" / "tilelang"),
                       "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"), "TRITON_CACHE_AUTOTUNING": "1"}
    again = kc.open_cache(tmp_path / "cache", KEY)
    assert again.state == "warm" and again.env == use.env


@pytest.mark.parametrize("field", kc.CacheKey.COMPARED)
def test_a_cache_of_another_stack_is_refused_naming_the_difference(tmp_path: Path, field: str) -> None:
    kc.open_cache(tmp_path, KEY)
    other = dataclasses.replace(KEY, **{field: "other"})
    with pytest.raises(kc.KernelCacheError, match=re.escape(f"{field}: cache {getattr(KEY, field)!r}, this host 'other'")):
        kc.open_cache(tmp_path, other)


def test_ignoring_a_mismatch_gives_no_variables_and_says_so(tmp_path: Path) -> None:
    kc.open_cache(tmp_path, KEY)
    use = kc.open_cache(tmp_path, dataclasses.replace(KEY, capability="8.0"), "ignore")
    assert use.state == "ignored" and use.env == {}
    assert "capability: cache '9.0', this host '8.0'" in use.message and "ignored" in use.message


def test_another_gpu_of_the_same_architecture_uses_the_cache(tmp_path: Path) -> None:
    kc.open_cache(tmp_path, KEY)
    assert kc.open_cache(tmp_path, dataclasses.replace(KEY, gpu="NVIDIA H100 80GB HBM3")).state == "warm"


def test_a_new_directory_the_ranks_imports_already_touched_is_still_new(tmp_path: Path) -> None:
    # The launcher starts the ranks before it opens the cache; importing the compilers creates their directories.
    cache = tmp_path / "cache"
    subprocess.run([sys.executable, "-c", "import torch, triton, tilelang"], check=True, capture_output=True,
                   env={**os.environ, **kc.cache_env(cache)})
    assert cache.is_dir() and any(cache.iterdir())

    use = kc.open_cache(cache, KEY)

    assert use.state == "created" and kc.read_manifest(cache).key == KEY


def test_a_directory_holding_something_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(kc.KernelCacheError, match="neither empty nor a kernel cache"):
        kc.open_cache(tmp_path, KEY)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / kc.MANIFEST).exists()


def test_a_manifest_of_another_schema_is_refused(tmp_path: Path) -> None:
    (tmp_path / kc.MANIFEST).write_text(json.dumps({"schema": "something/9"}))
    with pytest.raises(kc.KernelCacheError, match="schema 'something/9'"):
        kc.open_cache(tmp_path, KEY)


def _triton_put(cache_dir: Path, key: str) -> None:
    """A compiled kernel as Triton's compiler stores it: its artifacts and a group file naming them."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    with knobs.cache.scope():
        knobs.cache.dir = str(cache_dir)
        manager = FileCacheManager(key)
        group = {name: manager.put(data, name) for name, data in
                 (("kern.json", json.dumps({"name": "kern"})), ("kern.cubin", b"\x7fELF"), ("kern.ptx", "// ptx"))}
        manager.put_group("kern.json", group)


def _triton_group(cache_dir: Path, key: str) -> dict:
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    with knobs.cache.scope():
        knobs.cache.dir = str(cache_dir)
        return FileCacheManager(key).get_group("kern.json") or {}


def test_a_moved_cache_serves_tritons_own_cache_manager_once_opened(tmp_path: Path) -> None:
    filled = tmp_path / "node-a" / "cache"
    kc.open_cache(filled, KEY)
    _triton_put(filled / "triton", "abc123")
    assert set(_triton_group(filled / "triton", "abc123")) == {"kern.json", "kern.cubin", "kern.ptx"}
    carried = tmp_path / "node-b" / "elsewhere"
    shutil.copytree(filled, carried)
    shutil.rmtree(filled)
    assert _triton_group(carried / "triton", "abc123") == {}  # Triton's group holds the old absolute paths
    use = kc.open_cache(carried, KEY)
    assert "1 Triton groups pointed at this path" in use.message
    group = _triton_group(carried / "triton", "abc123")
    assert set(group) == {"kern.json", "kern.cubin", "kern.ptx"}
    assert all(Path(p).parent == carried / "triton" / "abc123" for p in group.values())
    assert "pointed" not in kc.open_cache(carried, KEY).message  # nothing left to rewrite


def test_record_fill_takes_stock_of_each_compilers_kernels(tmp_path: Path) -> None:
    kc.open_cache(tmp_path, KEY)
    _triton_put(tmp_path / "triton", "abc123")
    entry = tmp_path / "tilelang" / "f00d"
    entry.mkdir(parents=True)
    (entry / "executable.so").write_bytes(b"\0" * 1000)
    (entry / "params.pkl").write_bytes(b"p")
    (entry / "device_kernel.cu").write_text('extern "C" __global__ void __launch_bounds__(256) mamba_mimo_fwd_kernel(half* x) {}\n')
    (tmp_path / "tilelang" / "tmp").mkdir()
    (tmp_path / "tilelang" / "tmp" / "half-written.so").write_bytes(b"\0" * 10**6)
    manifest = kc.record_fill(tmp_path, "train tiny-1gpu mbs 8 seq 512")
    kc.record_fill(tmp_path, "train tiny-1gpu mbs 8 seq 512")
    manifest = kc.read_manifest(tmp_path)
    assert manifest.filled_by == ("train tiny-1gpu mbs 8 seq 512",)
    assert manifest.contents["triton"].kernels == 1 and manifest.contents["triton"].names == ("kern",)
    assert manifest.contents["tilelang"].names == ("mamba_mimo_fwd_kernel",)
    assert manifest.contents["tilelang"].bytes == 1000 + 1 + len((entry / "device_kernel.cu").read_bytes())
    assert kc.weight_line(manifest).startswith("1 Triton kernels, 1 TileLang kernels; ")


def test_show_prints_the_key_and_weight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kc.open_cache(tmp_path, KEY)
    kc.record_fill(tmp_path, "gpu-check")
    assert cli_main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 (sm 9.0), driver 580.159.04" in out and "filled by: gpu-check" in out
    assert cli_main(["show", str(tmp_path / "none")]) == 2


def test_prewarm_runs_the_launcher_through_both_dsa_phases_into_the_cache(tmp_path: Path) -> None:
    from nam56r.training.launcher.kernel_cache_cli import prewarm_command

    command, label = prewarm_command("proxy-1gpu", tmp_path / "cache", tmp_path / "run", mbs=8, data=None)
    assert command[1:3] == ["-m", "nam56r.training.launcher"]
    joined = " ".join(command)
    assert "--mbs 8 --gbs 8" in joined and "--steps 2" in joined and "--dense-warmup-steps 1" in joined
    assert f"--kernel-cache {tmp_path / 'cache'}" in joined
    assert label == "train proxy-1gpu mbs 8 seq 4096"


def test_the_build_gives_tilelangs_library_the_wheels_timestamp() -> None:
    """TileLang keys its disk cache on libtilelang.so's mtime: the stamp must come from the pinned wheel, the same on
    every node, not from the time of the install."""
    from nam56r_patchlane.artifacts import default_cache_dir
    from nam56r_patchlane.lock import load_lock

    tilelang = next(u for u in load_lock(ROOT).upstreams if u.name == "tilelang")
    wheel = default_cache_dir() / tilelang.artifact().filename
    assert wheel.is_file(), f"{wheel} is missing: run `nox -s build`"
    with zipfile.ZipFile(wheel) as archive:
        entry = archive.getinfo("tilelang/lib/libtilelang.so")
    stamp = subprocess.run([sys.executable, "-c", "from tilelang.cache.kernel_cache import KernelCache as K;"
                            "print(K._get_tilelang_lib_stamp())"], capture_output=True, text=True, check=True).stdout.strip()
    assert stamp == f"libtilelang.so:{entry.file_size}:{calendar.timegm(entry.date_time + (0, 0, 0)) * 10**9}"


def test_the_launcher_plans_a_kernel_cache_in_a_dry_run_and_refuses_it_in_a_slurm_script(tmp_path: Path) -> None:
    from nam56r.training.launcher.kernel_cache import KernelCacheChoice

    kc.open_cache(tmp_path / "cache", KEY)
    planned = KernelCacheChoice.from_launcher(tmp_path / "cache", "refuse", planned_only=True)
    assert planned.env == {} and "filled for NVIDIA H200 (sm 9.0)" in planned.note
    launched = KernelCacheChoice.from_launcher(tmp_path / "cache", "refuse", planned_only=False)
    assert launched.check_at_launch and launched.env["TILELANG_CACHE_DIR"] == str(tmp_path / "cache" / "tilelang")
    proc = subprocess.run([sys.executable, "-m", "nam56r.training.launcher", "--recipe", "tiny-1gpu", "--kernel-cache",
                           str(tmp_path / "cache"), "--slurm-script", str(tmp_path / "job.sbatch")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "--kernel-cache is for runs this launcher starts" in proc.stderr
    assert not (tmp_path / "job.sbatch").exists()
