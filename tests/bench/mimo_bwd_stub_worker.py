"""A stand-in for `nam56r_bench.mimo_bwd_worker.worker_main` with its message protocol and no GPU, for the sweep's
process handling on CPU: each candidate's `calls["behaviour"]` says what it does. Standard library only, so that a
spawned process starts in about a second."""

from __future__ import annotations

import os
import time
from typing import Any

MEASURED = {"time_ms": 1.0, "reference_ms": 2.0, "speedup": 2.0, "max_error": 0.0, "errors": {}, "bitwise_equal": True}


def stub_worker(current: dict[str, Any], work: list[tuple[int, str, dict[str, str]]], quick: bool, channel: Any) -> None:
    if current.get("reference") == "fatal":
        channel.send(("fatal", "RuntimeError: the reference broke"))
        return
    if current.get("reference") == "crash":
        os._exit(5)
    channel.send(("reference", {"mamba_mimo_bwd_fwd": {"time_ms": 2.0}, "mamba_mimo_bwd_bwd": {"time_ms": 4.0}}))
    for index, _target, calls in work:
        behaviour = calls["behaviour"]
        if behaviour == "hang":
            time.sleep(3600)
        elif behaviour == "crash":
            os._exit(3)
        elif behaviour == "raise":
            channel.send(("failed", index, "RuntimeError: launch failed"))
            return
        channel.send(("measured", index, MEASURED))
    channel.send(("done",))
