"""Fixtures of the patch-lane tests; the fake upstream and the Lane driver are in patchlane_testlib."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from patchlane_testlib import SDIST, FakeUpstream, Lane, make_fake_upstream, make_lane


@pytest.fixture(scope="session", autouse=True)
def isolated_git(tmp_path_factory: pytest.TempPathFactory):
    """No user or system git configuration; an identity for the fixture repositories' own commits."""
    home = tmp_path_factory.mktemp("git-home")
    config = home / "gitconfig"
    config.write_text("[user]\n\tname = test\n\temail = test@example.invalid\n[init]\n\tdefaultBranch = main\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GIT_CONFIG_GLOBAL", str(config))
        mp.setenv("GIT_CONFIG_NOSYSTEM", "1")
        yield


@pytest.fixture(scope="session")
def fake_upstream(tmp_path_factory: pytest.TempPathFactory, isolated_git) -> FakeUpstream:
    """The fake upstream (tags v1, v2, v3), its v1 sdist and the canonical three-patch series."""
    return make_fake_upstream(tmp_path_factory.mktemp("fakeup-origin"))


def _cache_with_sdist(directory: Path, fake: FakeUpstream) -> Path:
    directory.mkdir()
    shutil.copy(fake.sdist, directory / SDIST)
    return directory


@pytest.fixture
def cache(tmp_path: Path, fake_upstream: FakeUpstream) -> Path:
    """An offline artifact cache holding a copy of the fake sdist."""
    return _cache_with_sdist(tmp_path / "cache", fake_upstream)


@pytest.fixture
def lane(tmp_path: Path, cache: Path, fake_upstream: FakeUpstream) -> Lane:
    """A repository root with the lock and the three-patch series; nothing materialized yet."""
    return make_lane(tmp_path / "repo", cache, fake_upstream)


@pytest.fixture(scope="session")
def built_template(tmp_path_factory: pytest.TempPathFactory, fake_upstream: FakeUpstream) -> Path:
    """One offline build per session; `built` copies its root (a build takes the better part of a second)."""
    base = tmp_path_factory.mktemp("built-template")
    template = make_lane(base / "repo", _cache_with_sdist(base / "cache", fake_upstream), fake_upstream)
    result = template.build()
    assert result.code == 0, result.text
    return template.root


@pytest.fixture
def built(tmp_path: Path, cache: Path, fake_upstream: FakeUpstream, built_template: Path) -> Lane:
    """A root as an offline build leaves it: materialized from the cache, 3/3 applied, clean."""
    root = tmp_path / "repo"
    shutil.copytree(built_template, root, symlinks=True)
    return Lane(root, cache, fake_upstream)


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter with nothing installed (no torch): a bare CPU host for the manifest's host stamp."""
    env = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    python = str(env / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0, sys.executable
    return python
