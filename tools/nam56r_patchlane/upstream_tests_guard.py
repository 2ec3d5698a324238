"""pytest plugin of `upstream-tests`: stops the session (exit 3) when the upstream under test imports from anywhere but
the tree the side runs in, so that a side never silently tests the environment's installed copy instead; and gives
each pytest process a rendezvous port of its own."""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest

GUARD_EXIT = 17  # not one of pytest's own exit codes (0-5)


def pytest_configure(config: pytest.Config) -> None:
    # Every pytest process (a side, or each of its xdist workers) rendezvouses on a port of its own: both sides and a
    # side's workers run at once, and upstream's distributed tests each form a one-rank group on MASTER_PORT
    # (Megatron's default 29500), so a shared port fails all but one with EADDRINUSE.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])


def pytest_sessionstart(session: pytest.Session) -> None:
    tree = Path(os.environ["NAM56R_UPSTREAM_TESTS_TREE"]).resolve()
    package = os.environ.get("NAM56R_UPSTREAM_TESTS_IMPORTS", "").split(",")[0].split(".")[0]
    if not package:
        return
    # Where the package would load from, without running it: a release that cannot import (a missing compiled
    # extension) fails its tests, which is a verdict, not a reason to stop.
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.exit(f"upstream-tests guard: {package} is not importable from {tree}", returncode=GUARD_EXIT)
    location = Path(spec.origin if spec.origin not in (None, "namespace") else next(iter(spec.submodule_search_locations)))
    if not location.resolve().is_relative_to(tree):
        pytest.exit(f"upstream-tests guard: {package} would import from {location}, not from the tree {tree}",
                    returncode=GUARD_EXIT)
