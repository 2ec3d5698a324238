"""Artifacts are accepted only with the lock's sha256; offline never reaches an index."""

from __future__ import annotations

from nam56r_patchlane.checkout_lock import CHECKOUT_LOCK_RELATIVE_PATH
from patchlane_testlib import SDIST, Lane, sha256_of


def test_tampered_artifact_is_refused_and_nothing_is_materialized(lane: Lane) -> None:
    artifact = lane.cache / SDIST
    expected = sha256_of(artifact)
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0x01
    artifact.write_bytes(bytes(data))
    actual = sha256_of(artifact)
    assert actual != expected

    result = lane.build()

    assert result.code != 0
    assert "refusing" in result.err
    assert actual in result.err and expected in result.err
    assert str(artifact) in result.err
    assert not lane.tree.exists()
    lock_file = CHECKOUT_LOCK_RELATIVE_PATH.name  # the build's lock, empty once released
    assert sorted(p.name for p in (lane.root / "third_party").iterdir() if p.name != lock_file) == ["upstreams.toml"]
    assert artifact.is_file()  # the cache is not silently "repaired"


def test_tampered_artifact_is_refused_by_check_too(lane: Lane) -> None:
    artifact = lane.cache / SDIST
    artifact.write_bytes(artifact.read_bytes() + b"\0")

    result = lane.run("check")

    assert result.code != 0
    assert "refusing" in result.err and sha256_of(artifact) in result.err
    assert not lane.tree.exists()


def test_offline_build_without_the_artifact_says_how_to_fill_the_cache(lane: Lane) -> None:
    (lane.cache / SDIST).unlink()

    result = lane.build()

    assert result.code != 0
    assert f"{SDIST} is not in the offline cache" in result.err
    assert "cache fill" in result.err
    assert not lane.tree.exists()


def test_cache_fill_verifies_what_the_directory_already_holds(lane: Lane, tmp_path) -> None:
    target = tmp_path / "carry"
    target.mkdir()
    (target / SDIST).write_bytes((lane.cache / SDIST).read_bytes())

    result = lane.run("cache", "fill", str(target), "--artifacts-only", offline=False)

    assert result.code == 0, result.text
    assert f"fakeup: {target / SDIST} (cache, sha256 verified)" in result.out

    (target / SDIST).write_bytes(b"not the release")
    refused = lane.run("cache", "fill", str(target), "--artifacts-only", offline=False)

    assert refused.code == 1
    assert "refusing" in refused.err and sha256_of(target / SDIST) in refused.err
