"""TransformerEngine and Apex on an air-gapped node: `cache fill --profile gpu-te` carries the lock's pinned TE files
and Apex's archive (checked against the lock), `cache split` cuts what is larger than a part, and `build --with-te
--offline` installs them, compiling the extensions once per build key and keeping the wheels for the next node.
Stand-ins: te_testlib.py; pip sees only the local index (offline_testlib.only_index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest
from nam56r_patchlane.cachemanifest import MANIFEST_NAME
from nam56r_patchlane.errors import PatchlaneError
from nam56r_patchlane.lock import load_lock
from nam56r_patchlane.noxsupport import recorded_build_options
from nam56r_patchlane.te_compile import _run_logged
from offline_testlib import cli, fill, make_index, make_root, make_wheel, only_index, run_python
from patchlane_testlib import sha256_of
from te_testlib import CUDA_TORCH, ApexRepo, TeIndex, add_te, make_apex_repo, make_cuda_home, make_cuda_torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TeIndex, ApexRepo, Path]:
    base = tmp_path_factory.mktemp("te-stage")
    index = make_index(base / "index")
    te = add_te(index.directory)
    apex = make_apex_repo(base / "apex")
    return index.directory, te, apex, index.upstream_wheel


def te_root(tmp_path: Path, stage, runtime: tuple[str, ...] = ("tedep",), tree: str | None = None,
            apex_url: str = "https://example.invalid/apex.git") -> Path:
    _, te, apex, upstream_wheel = stage
    root = make_root(tmp_path / "repo", upstream_wheel)
    lock = root / "third_party" / "upstreams.toml"
    lock.write_text(lock.read_text() + te.lock_entries(runtime) + apex.lock_entries(tree, apex_url))
    return root


def fill_te(root: Path, cache: Path, stage) -> None:
    result = fill(root, cache, "--profile", "gpu-te", "--no-upstream-tests", "--apex-from", str(stage[2].path))
    assert result.code == 0, result.text


def test_the_lock_pins_te_files_by_sha256_and_apex_by_commit_and_tree(tmp_path: Path, stage) -> None:
    real = load_lock(REPO).te
    assert real is not None
    assert [f.filename for f in real.te.wheels] and real.te.sdist.filename.endswith(f"-{real.te.version}.tar.gz")
    assert all(len(f.sha256) == 64 for f in real.te.files) and len(real.apex.commit) == 40 and len(real.apex.tree) == 40

    root = te_root(tmp_path, stage)
    lock_path = root / "third_party" / "upstreams.toml"
    text = lock_path.read_text()
    parsed = load_lock(root).te
    assert parsed is not None and parsed.apex.commit == stage[2].commit
    for broken, message in (
        (text.split("\n[apex]")[0], "[apex] is missing"),
        (text.replace('filename = "fakete-1.0-py3-none-any.whl"', 'filename = "fakete-1.0.tar.gz"'), "exactly one sdist"),
        (text.replace(f'tree = "{stage[2].tree}"', 'tree = "HEAD"'), "tree 'HEAD' is not a 40-hex git object id"),
        (text.replace('version = "1.0"\nruntime', 'version = "1.1"\nruntime'), "are not files of version 1.1"),
    ):
        lock_path.write_text(broken)
        with pytest.raises(PatchlaneError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_lock(root)


def test_gpu_te_fill_carries_the_pinned_files_and_apex_and_split_cuts_what_exceeds_a_part(
    tmp_path: Path, stage, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, cache = te_root(tmp_path, stage), tmp_path / "cache"
    only_index(monkeypatch, stage[0])

    fill_te(root, cache, stage)

    manifest = json.loads((cache / MANIFEST_NAME).read_text())
    assert manifest["target"]["profile"] == "gpu-te" and manifest["target"]["exclude"] == ["torch"]
    te_files = {f["path"]: f for f in manifest["files"] if f["kind"] == "te"}
    assert set(te_files) == {f"te/{p.name}" for p in stage[1].files} | {f"te/apex-{stage[2].commit[:12]}.tar.gz"}
    for pinned in stage[1].files:
        assert te_files[f"te/{pinned.name}"]["sha256"] == sha256_of(pinned) == sha256_of(cache / "te" / pinned.name)
    assert "te-runtime" in manifest["requirements"]
    assert {f["name"]: f["kind"] for f in manifest["files"]}["tedep"] == "te-runtime"
    assert not (cache / "wheels" / "fakete_core-1.0-py3-none-any.whl").exists()  # pinned files live in te/, not wheels/

    limit_mib = 0.15  # the core wheel (300 KiB) is larger than a part
    split = cli(root, "cache", "split", str(cache), "--max-mib", str(limit_mib))
    assert split.code == 0, split.text
    assert "te/fakete_core-1.0-py3-none-any.whl (0.3 MiB) travels as" in split.out
    parts = sorted((cache / ".parts").iterdir())
    for part in parts:
        assert sum(f.stat().st_size for f in part.rglob("*") if f.is_file()) <= limit_mib * (1 << 20)
    holding = [p for p in parts if list((p / "te").glob("fakete_core-*.piece-*"))]
    node = tmp_path / "node"
    node.mkdir()
    for part in parts:
        if part != holding[-1]:
            subprocess.run(["cp", "-a", f"{part}/.", f"{node}/"], check=True)
    short = cli(root, "cache", "verify", str(node))
    assert short.code == 1 and "te/fakete_core-1.0-py3-none-any.whl: missing piece(s)" in short.err
    subprocess.run(["cp", "-a", f"{holding[-1]}/.", f"{node}/"], check=True)
    joined = cli(root, "cache", "verify", str(node))
    assert joined.code == 0, joined.text
    assert "joined te/fakete_core-1.0-py3-none-any.whl from its" in joined.out
    assert sha256_of(node / "te" / "fakete_core-1.0-py3-none-any.whl") == sha256_of(stage[1].files[1])
    assert not list((node / "te").glob("*.piece-*"))


def test_fill_refuses_an_apex_source_whose_tree_is_not_the_pinned_one(tmp_path: Path, stage, monkeypatch: pytest.MonkeyPatch) -> None:
    root = te_root(tmp_path, stage, tree="0" * 40)
    only_index(monkeypatch, stage[0])

    result = fill(root, tmp_path / "cache", "--profile", "gpu-te", "--no-upstream-tests", "--apex-from", str(stage[2].path))

    assert result.code == 1
    assert f"makes tree {stage[2].tree} without its submodules, the lock pins {'0' * 40}" in result.err


def test_fill_refuses_when_te_requires_what_the_cache_does_not_carry(tmp_path: Path, stage, monkeypatch: pytest.MonkeyPatch) -> None:
    root = te_root(tmp_path, stage, runtime=())
    only_index(monkeypatch, stage[0])

    result = fill(root, tmp_path / "cache", "--profile", "gpu-te", "--no-upstream-tests", "--apex-from", str(stage[2].path))

    assert result.code == 1
    assert "fakete_torch-1.0.tar.gz requires tedep, which the cache does not carry" in result.err
    assert not (tmp_path / "cache" / MANIFEST_NAME).exists()


def _node(tmp_path: Path, stage, monkeypatch: pytest.MonkeyPatch, torch_wheel: Path | None = None) -> tuple[Path, Path, Path]:
    """(root, an offline gpu-te cache, a base interpreter with the node's CUDA torch); pip reaches no index after."""
    root, cache = te_root(tmp_path, stage), tmp_path / "cache"
    only_index(monkeypatch, stage[0])
    fill_te(root, cache, stage)
    base = tmp_path / "base"
    venv.EnvBuilder(with_pip=True, symlinks=True).create(base)
    wheel = torch_wheel or make_cuda_torch(tmp_path / "node-wheels")
    subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], check=True)
    only_index(monkeypatch, None)
    monkeypatch.setenv("CUDA_HOME", str(make_cuda_home(tmp_path / "cuda")))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    return root, cache, base / "bin" / "python"


def build(root: Path, cache: Path, env: Path, base: Path, *more: str):
    return cli(root, "--cache", str(cache), "--offline", "build", "--env", str(env), "--profile", "gpu", "--base-python", str(base), *more)


def test_offline_build_with_te_compiles_once_and_the_next_node_installs_the_kept_wheels(
    tmp_path: Path, stage, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, cache, base = _node(tmp_path, stage, monkeypatch)
    env = tmp_path / "env"
    plain = build(root, cache, env, base)
    assert plain.code == 0, plain.text
    assert "compiling" not in plain.out and "transformer-engine" not in plain.out
    assert run_python(env / "bin" / "python", "import fakete_torch").returncode != 0
    assert recorded_build_options(env)[-1] == "gpu"

    first = build(root, cache, env, base, "--with-te")

    assert first.code == 0, first.text
    assert "compiling fakete_torch 1.0 for python cp" in first.out and "compiling apex" in first.out
    built = run_python(env / "bin" / "python", "import json, fakete, fakete_core, tedep, fakete_torch, apex;"
                       " print(json.dumps([fakete_torch.BUILT_WITH, apex.BUILT_WITH]))")
    assert built.returncode == 0, built.stderr
    te_built, apex_built = json.loads(built.stdout)
    assert te_built == {"torch": CUDA_TORCH, "arch": "9.0", "env": {"NVTE_PYTORCH_FORCE_BUILD": "TRUE"}}
    assert apex_built["env"] == {"APEX_CPP_EXT": "1"}
    (key_dir,) = (cache / "te-built").iterdir()
    assert key_dir.name.startswith(f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{CUDA_TORCH}-cuda13.0-sm90-")
    key = json.loads((key_dir / "key.json").read_text())
    assert set(key["wheels"]) == {"te", "apex"} and key["key"]["arch"] == "9.0"
    assert (key_dir / "te-build.log").is_file()
    assert recorded_build_options(env)[-1] == "--with-te"
    table = first.out.split("upstream", 1)[1]
    assert "transformer-engine" in table and "apex" in table

    again = build(root, cache, env, base, "--with-te")
    assert again.code == 0, again.text
    assert "already installed as the lock says" in again.out and "no-op:" in again.out

    other = build(root, cache, tmp_path / "other-node-env", base, "--with-te")
    assert other.code == 0, other.text
    assert "compiling" not in other.out
    assert other.out.count("no compile") >= 2
    assert run_python(tmp_path / "other-node-env" / "bin" / "python", "import fakete_torch, apex").returncode == 0


def test_offline_build_with_te_names_what_it_lacks_and_installs_nothing(tmp_path: Path, stage, monkeypatch: pytest.MonkeyPatch) -> None:
    root, cache, base = _node(tmp_path, stage, monkeypatch)
    sdist = cache / "te" / "fakete_torch-1.0.tar.gz"
    kept = sdist.read_bytes()
    sdist.unlink()

    missing = build(root, cache, tmp_path / "env", base, "--with-te")

    assert missing.code == 1
    assert "te/fakete_torch-1.0.tar.gz: missing" in missing.err
    assert run_python(tmp_path / "env" / "bin" / "python", "import fakete").returncode != 0
    sdist.write_bytes(kept)

    manifest = json.loads((cache / MANIFEST_NAME).read_text())
    manifest["target"]["profile"] = "gpu"
    (cache / MANIFEST_NAME).write_text(json.dumps(manifest))
    plain_cache = build(root, cache, tmp_path / "env", base, "--with-te")
    assert plain_cache.code == 1 and "was filled for profile gpu, which carries no TransformerEngine" in plain_cache.err
    assert "--profile gpu-te" in plain_cache.err

    cpu = cli(root, "--cache", str(cache), "--offline", "build", "--env", str(tmp_path / "cpu"), "--profile", "cpu", "--with-te")
    assert cpu.code == 1 and "--with-te needs the gpu profile" in cpu.err

    manifest["target"]["profile"] = "gpu-te"
    (cache / MANIFEST_NAME).write_text(json.dumps(manifest))
    (tmp_path / "cuda" / "include" / "cudnn.h").unlink()
    no_cudnn = build(root, cache, tmp_path / "env", base, "--with-te")
    assert no_cudnn.code == 1 and "no cudnn.h" in no_cudnn.err and "CUDNN_PATH" in no_cudnn.err
    assert not (cache / "te-built").exists()


def test_with_te_through_an_index_fetches_the_pinned_files_and_apex_from_git(
    tmp_path: Path, stage, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = te_root(tmp_path, stage, apex_url=str(stage[2].path))
    base = tmp_path / "base"
    venv.EnvBuilder(with_pip=True, symlinks=True).create(base)
    only_index(monkeypatch, stage[0])
    subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
                    str(make_cuda_torch(tmp_path / "node-wheels"))], check=True)
    monkeypatch.setenv("CUDA_HOME", str(make_cuda_home(tmp_path / "cuda")))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    artifacts = tmp_path / "artifacts"

    result = cli(root, "--cache", str(artifacts), "build", "--env", str(tmp_path / "env"), "--profile", "gpu",
                 "--base-python", str(base / "bin" / "python"), "--with-te")

    assert result.code == 0, result.text
    assert {p.name for p in (artifacts / "te").iterdir()} == {p.name for p in stage[1].files} | {f"apex-{stage[2].commit[:12]}.tar.gz"}
    assert run_python(tmp_path / "env" / "bin" / "python", "import fakete_torch, apex, tedep").returncode == 0
    assert recorded_build_options(tmp_path / "env") == []  # an online build: the sessions replay nothing


def test_with_te_refuses_a_cpu_torch(tmp_path: Path, stage, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cpu-wheels").mkdir()
    cpu_torch = make_wheel(tmp_path / "cpu-wheels", "torch", "9.0", init="__version__ = '9.0'\n")  # no torch.version.cuda
    root, cache, base = _node(tmp_path, stage, monkeypatch, torch_wheel=cpu_torch)

    result = build(root, cache, tmp_path / "env", base, "--with-te")

    assert result.code == 1
    assert "is a CPU build" in result.err and "CUDA torch" in result.err
    assert not (cache / "te-built").exists()


def test_a_long_compile_says_every_heartbeat_how_far_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nam56r_patchlane.te_compile.HEARTBEAT_S", 0.05)
    beats: list[str] = []
    script = "import time\nfor i in range(4):\n    print(f'[{i + 1}/4] compiling', flush=True)\n    time.sleep(0.1)\n"
    start = time.monotonic()

    code, last = _run_logged([sys.executable, "-c", script], dict(os.environ), tmp_path / "build.log", beats.append)

    assert code == 0 and last == "[4/4] compiling"
    assert len(beats) >= 3 and any(beat.startswith("[") and "/4] compiling" in beat for beat in beats)
    assert (tmp_path / "build.log").read_text().count("compiling") == 4
    assert time.monotonic() - start < 10
