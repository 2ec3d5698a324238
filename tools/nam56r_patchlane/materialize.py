"""Pinned upstream -> git tree with the release committed as the `upstream` base.

Sources, in order: the git submodule when it is checked out at the pinned commit; otherwise the
pinned PyPI artifact from the cache or the index (checksum-verified), unpacked and committed.
Nothing here deletes a directory that holds anything but a previous materialization of the same
pin with no work in it.
"""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .artifacts import fetch_artifact
from .errors import PatchlaneError
from .gittree import BASE_TAG, BRANCH, TreeState, UpstreamTree, is_git_tree
from .lock import Upstream


@dataclass(frozen=True)
class Materialized:
    tree: UpstreamTree
    state: TreeState
    created: bool  # False: an existing materialization of this pin was reused


def pin_label(upstream: Upstream) -> str:
    return f"{upstream.requirement} @ {upstream.tag} {upstream.commit[:12]}"


def unpack_archive(archive: Path, dest: Path) -> None:
    """Unpack an sdist (dropping its single top-level folder) or a wheel into `dest`."""
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(dest)
        return
    if not archive.name.endswith((".tar.gz", ".tgz")):
        raise PatchlaneError(f"do not know how to unpack {archive.name}")
    staging = dest.parent / f".{dest.name}.unpack"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive) as tf:
        tf.extractall(staging, filter="data")
    roots = list(staging.iterdir())
    top = roots[0] if len(roots) == 1 and roots[0].is_dir() else staging
    dest.mkdir(parents=True, exist_ok=True)
    for item in top.iterdir():
        shutil.move(str(item), dest / item.name)
    shutil.rmtree(staging, ignore_errors=True)


def _from_submodule(path: Path, upstream: Upstream) -> Materialized:
    tree = UpstreamTree(path)
    if tree.base_commit() is None:
        tree.git("tag", BASE_TAG, upstream.commit)
        tree.git("checkout", "--quiet", "-B", BRANCH, upstream.commit)
        tree.write_excludes()
    elif tree.base_commit() != upstream.commit:
        raise PatchlaneError(
            f"{path}: its `{BASE_TAG}` tag is at {tree.base_commit()}, the lock pins {upstream.commit}",
            f"the pin moved: check the tree is clean, then `git -C {path} tag -d upstream` and rebuild",
        )
    state = TreeState(
        upstream=upstream.name, source="submodule", pin=pin_label(upstream),
        artifact_sha256="", base_commit=upstream.commit,
    )
    tree.write_state(state)
    return Materialized(tree=tree, state=state, created=True)


def materialize_upstream(
    root: Path, upstream: Upstream, cache_dir: Path, offline: bool, python: str, log=print, dest: Path | None = None
) -> Materialized:
    """Make `dest` (default third_party/<name>) a git tree of the pinned release with its base tagged."""
    path = dest or (root / upstream.path)
    if is_git_tree(path):
        tree = UpstreamTree(path)
        state = tree.read_state()
        if state is not None:
            if state.pin == pin_label(upstream):
                return Materialized(tree=tree, state=state, created=False)
            raise PatchlaneError(
                f"{path} holds {state.pin}, the lock now pins {pin_label(upstream)}",
                f"make sure its work is exported (apply_patches.py status), then move it aside"
                f" (mv {path} {path}.old) and build again",
            )
        if tree.has_commit(upstream.commit):
            log(f"  using the git submodule checkout at {upstream.commit[:12]}")
            return _from_submodule(path, upstream)
        raise PatchlaneError(
            f"{path} is a git tree that neither this tool made nor holds the pinned commit {upstream.commit[:12]}",
            f"check it out at the pin (git -C {path} fetch && git -C {path} checkout {upstream.commit}),"
            " or move it aside so the tool can materialize the PyPI release there",
        )
    if path.exists() and any(path.iterdir()):
        raise PatchlaneError(
            f"{path} exists, is not empty and is not a git tree: refusing to overwrite it",
            "move its contents aside, or run `git submodule update --init` to check out the pinned commit",
        )
    fetched = fetch_artifact(upstream, cache_dir, offline, python, log)
    kind = "wheel" if upstream.install == "wheel" else "sdist"
    log(f"  unpacking {fetched.path.name} ({kind}, from {fetched.source}) into {path}")
    path.mkdir(parents=True, exist_ok=True)
    unpack_archive(fetched.path, path)
    message = (
        f"upstream: {upstream.requirement} ({kind} {fetched.path.name})\n\n"
        f"Pinned release {upstream.tag} ({upstream.git_url} {upstream.commit}),\n"
        f"materialized from the PyPI artifact, sha256 {upstream.artifact().sha256}\n"
    )
    tree = UpstreamTree.init_from_directory(path, message)
    state = TreeState(
        upstream=upstream.name, source=fetched.source, pin=pin_label(upstream),
        artifact_sha256=upstream.artifact().sha256, base_commit=tree.head(),
    )
    tree.write_state(state)
    return Materialized(tree=tree, state=state, created=True)
