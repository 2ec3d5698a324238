"""The air-gapped path: `cache fill` gathers, through pip and the user's (here: local) index, everything an
`--offline` build needs for a named interpreter and platform; the offline build uses only that cache,
verified against its manifest. pip's configuration is switched off in every test (offline_testlib.only_index)."""

from __future__ import annotations

import json
import subprocess
import venv
from pathlib import Path

import pytest
from nam56r_patchlane.cachemanifest import MANIFEST_NAME
from nam56r_patchlane.checkout_state import built_checkout, checkout_state
from nam56r_patchlane.noxsupport import install_source, recorded_build_options, session_build_options
from nam56r_patchlane.wheeltarget import expand_platform
from offline_testlib import (
    OTHER,
    RUNNING,
    LocalIndex,
    cached_wheels,
    cli,
    fill,
    make_index,
    make_root,
    make_sdist_needing,
    only_index,
    run_python,
)
from patchlane_testlib import sha256_of

LINUX = ["--platform", "manylinux_2_28_x86_64"]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> LocalIndex:
    return make_index(tmp_path_factory.mktemp("index") / "simple")


@pytest.fixture
def root(tmp_path: Path, index: LocalIndex) -> Path:
    return make_root(tmp_path / "repo", index.upstream_wheel)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def manifest_of(cache: Path) -> dict:
    return json.loads((cache / MANIFEST_NAME).read_text())


def test_fill_fetches_an_sdist_whose_setup_py_imports_what_the_filling_python_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mamba-ssm's setup.py imports torch, megatron-core's pybind11: the cache must not need them to fetch the sdist.
    links = tmp_path / "links"
    links.mkdir()
    sdist = make_sdist_needing(links, "nam56r_absent_build_dependency")
    root = make_root(tmp_path / "repo", sdist, install="editable")
    only_index(monkeypatch, links)

    result = fill(root, tmp_path / "cache", "--artifacts-only")

    assert result.code == 0, result.text
    assert f"fakeup: {tmp_path / 'cache' / sdist.name} (pypi, sha256 verified)" in result.out
    assert sha256_of(tmp_path / "cache" / sdist.name) == sha256_of(sdist)


def test_fill_resolves_for_another_python_and_platform_and_leaves_the_gpu_torch_out(
    root: Path, cache: Path, index: LocalIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_index(monkeypatch, index.directory)

    result = fill(root, cache, "--python-version", OTHER, *LINUX, "--profile", "gpu")

    assert result.code == 0, result.text
    # onlyother: the marker is evaluated for the target python, not the one running pip; nativepkg: tagged
    # manylinux_2_17 only, found through the older tags of manylinux_2_28; torch and heavydep (only torch needs it) left out.
    assert cached_wheels(cache) == {"alpha", "beta", "nativepkg", "onlyother", "gamma", "buildpkg", "toolpkg", "noxlike"}
    assert "left out 2: heavydep torch" in result.out
    native = next((cache / "wheels").glob("nativepkg-*.whl")).name
    assert native.endswith(f"cp{OTHER.replace('.', '')}-manylinux_2_17_x86_64.whl")
    manifest = manifest_of(cache)
    assert manifest["target"] == {"python_version": OTHER, "platforms": expand_platform("manylinux_2_28_x86_64"),
                                  "profile": "gpu", "exclude": ["torch"]}
    kinds = {f["name"]: f["kind"] for f in manifest["files"]}
    assert kinds == {"fakeup": "artifact", "buildpkg": "build", "alpha": "runtime", "beta": "runtime", "nativepkg": "runtime",
                     "onlyother": "runtime", "gamma": "runtime", "toolpkg": "sessions", "noxlike": "nox"}
    for entry in manifest["files"]:
        assert sha256_of(cache / entry["path"]) == entry["sha256"]
        assert (cache / entry["path"]).stat().st_size == entry["size"]
    assert "total" in result.out and "MiB" in result.out


def test_second_fill_reaches_no_index_and_downloads_only_what_is_missing(
    root: Path, cache: Path, index: LocalIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_index(monkeypatch, index.directory)
    assert fill(root, cache, "--profile", "cpu").code == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in (cache / "wheels").iterdir()}

    only_index(monkeypatch, None)  # no index, no find-links: a second fill must not need them
    again = fill(root, cache, "--profile", "cpu")

    assert again.code == 0, again.text
    assert "no resolution" in again.out
    assert {p.name: p.stat().st_mtime_ns for p in (cache / "wheels").iterdir()} == stamps

    broken = next((cache / "wheels").glob("beta-*.whl"))
    broken.write_bytes(b"truncated")
    only_index(monkeypatch, index.directory)
    repaired = fill(root, cache, "--profile", "cpu")

    assert repaired.code == 0, repaired.text
    assert "1 wheel(s) missing or changed" in repaired.out
    assert sha256_of(broken) == next(f["sha256"] for f in manifest_of(cache)["files"] if f["name"] == "beta")


def test_fill_after_the_lock_changed_removes_what_is_no_longer_needed(
    root: Path, cache: Path, index: LocalIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_index(monkeypatch, index.directory)
    assert fill(root, cache, "--profile", "cpu").code == 0
    lock = root / "third_party" / "upstreams.toml"
    lock.write_text(lock.read_text().replace('runtime = ["alpha"]', "runtime = []").replace(', "alpha", "gamma"]', ', "gamma"]'))

    result = fill(root, cache, "--profile", "cpu")

    assert result.code == 0, result.text
    assert "removed wheels/alpha-1.0-py3-none-any.whl: no longer needed" in result.out
    assert cached_wheels(cache) == {"buildpkg", "torch", "heavydep", "gamma", "toolpkg", "noxlike"}


def test_offline_build_into_a_new_env_installs_from_the_cache_only(
    root: Path, cache: Path, index: LocalIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_index(monkeypatch, index.directory)
    assert fill(root, cache, "--profile", "cpu").code == 0
    only_index(monkeypatch, None)
    env = tmp_path / "newenv"

    result = cli(root, "--cache", str(cache), "--offline", "build", "--env", str(env), "--profile", "cpu")

    assert result.code == 0, result.text
    assert f"offline cache {cache}: " in result.out and "match nam56r-cache.json" in result.out
    imported = run_python(env / "bin" / "python", "import alpha, beta, gamma, torch, fakeup, buildpkg; print(torch.VERSION, beta.VERSION)")
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.split() == ["9.0", "2.0"]
    # What noxfile.py replays for the other sessions: this cache, offline, this profile.
    assert recorded_build_options(env) == ["--cache", str(cache.resolve()), "--offline", "--profile", "cpu"]
    assert built_checkout(env) == checkout_state(root)  # the root is no git checkout here: no commit, and why
    assert install_source(recorded_build_options(env)).pip_args() == ["--no-index", "--find-links", str(cache.resolve() / "wheels")]
    assert session_build_options(env, [])[0] == recorded_build_options(env)
    with pytest.raises(ValueError, match="--base-python"):
        session_build_options(env, ["--python", "/usr/bin/python3"])


def test_offline_build_refuses_a_tampered_wheel_before_installing_anything(
    root: Path, cache: Path, index: LocalIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_index(monkeypatch, index.directory)
    assert fill(root, cache, "--profile", "cpu").code == 0
    wheel = next((cache / "wheels").glob("alpha-*.whl"))
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0x01
    wheel.write_bytes(bytes(data))
    env = tmp_path / "newenv"

    result = cli(root, "--cache", str(cache), "--offline", "build", "--env", str(env), "--profile", "cpu")

    assert result.code == 1
    assert f"wheels/{wheel.name}: sha256 {sha256_of(wheel)}, the manifest says" in result.err
    assert run_python(env / "bin" / "python", "import alpha").returncode != 0


def test_offline_build_refuses_a_cache_filled_for_another_python(
    root: Path, cache: Path, index: LocalIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_index(monkeypatch, index.directory)
    assert fill(root, cache, "--python-version", OTHER, *LINUX, "--profile", "cpu").code == 0

    result = cli(root, "--cache", str(cache), "--offline", "build", "--env", str(tmp_path / "newenv"), "--profile", "cpu")

    assert result.code == 1
    assert f"was filled for python {OTHER}; the environment runs python {RUNNING}." in result.err


def test_env_layered_over_a_base_python_uses_its_torch_and_leaves_it_untouched(
    root: Path, cache: Path, index: LocalIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU node: an interpreter whose environment has its own torch; the gpu cache carries none.
    base = tmp_path / "base"
    venv.EnvBuilder(with_pip=True, symlinks=True).create(base)
    only_index(monkeypatch, index.directory)
    subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "--quiet", "torch==9.0"], check=True)
    assert fill(root, cache, "--profile", "gpu").code == 0
    assert "torch" not in cached_wheels(cache)
    only_index(monkeypatch, None)

    plain = cli(root, "--cache", str(cache), "--offline", "build", "--env", str(tmp_path / "plain"), "--profile", "gpu")
    assert plain.code == 1
    assert "leaves torch out" in plain.err and "--base-python" in plain.err

    env = tmp_path / "layered"
    result = cli(root, "--cache", str(cache), "--offline", "build", "--env", str(env), "--profile", "gpu",
                 "--base-python", str(base / "bin" / "python"))

    assert result.code == 0, result.text
    assert "torch 9.0 already present: kept" in result.out
    where = run_python(env / "bin" / "python", "import torch, alpha, gamma; print(torch.__file__); print(alpha.__file__)")
    assert where.returncode == 0, where.stderr
    torch_file, alpha_file = where.stdout.split()
    assert torch_file.startswith(str(base)) and alpha_file.startswith(str(env))
    assert run_python(base / "bin" / "python", "import alpha").returncode != 0  # nothing installed into the base
    again = cli(root, "--cache", str(cache), "--offline", "build", "--env", str(env), "--profile", "gpu")
    assert again.code == 0 and "no-op" in again.out and f"over {base / 'bin' / 'python'}'s packages" in again.out
    other = cli(root, "--cache", str(cache), "--offline", "build", "--env", str(env), "--base-python", "/usr/bin/env")
    assert other.code == 1 and "move it aside" in other.err


def test_split_parts_fit_the_limit_and_reassemble_into_a_verified_cache(
    root: Path, cache: Path, index: LocalIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_index(monkeypatch, index.directory)
    assert fill(root, cache, "--profile", "cpu").code == 0
    limit_mib = 0.15  # beta and torch are 100 KiB each: at least two parts

    result = cli(root, "cache", "split", str(cache), "--max-mib", str(limit_mib))

    assert result.code == 0, result.text
    parts = sorted((cache / ".parts").iterdir())
    assert len(parts) >= 2
    for part in parts:
        assert sum(f.stat().st_size for f in part.rglob("*") if f.is_file()) <= limit_mib * (1 << 20)
    node = tmp_path / "node-cache"
    node.mkdir()
    for part in parts[1:]:  # one part has not arrived yet
        subprocess.run(["cp", "-a", f"{part}/.", f"{node}/"], check=True)
    missing = cli(root, "cache", "verify", str(node))
    assert missing.code == 1 and "missing" in missing.err
    subprocess.run(["cp", "-a", f"{parts[0]}/.", f"{node}/"], check=True)
    verified = cli(root, "cache", "verify", str(node), "--python-version", RUNNING)
    assert verified.code == 0, verified.text
    assert sorted(p.name for p in (node / "wheels").iterdir()) == sorted(p.name for p in (cache / "wheels").iterdir())


def test_manylinux_platform_brings_the_older_tags_newest_first() -> None:
    tags = expand_platform("manylinux_2_28_x86_64")

    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert tags.index("manylinux_2_17_x86_64") < tags.index("manylinux2014_x86_64") < tags.index("manylinux_2_12_x86_64")
    assert "manylinux2010_aarch64" not in expand_platform("manylinux_2_28_aarch64")
    assert expand_platform("musllinux_1_2_x86_64") == ["musllinux_1_2_x86_64"]
