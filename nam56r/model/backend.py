"""Which layer backend NAM56R builds on, `te` or `local`, resolved without importing Megatron (the launcher
resolves it before it starts the ranks; `nam56r.model.specs` builds the chosen one's modules)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Literal

Backend = Literal["te", "local"]
# The notice is logged under the specs module's name, where the backends are built.
logger = logging.getLogger("nam56r.model.specs")
_announced: set[str] = set()


def resolve_backend(requested: str) -> Backend:
    """`te`, `local`, or `auto` (te when transformer_engine is importable); the choice is logged once."""
    if requested not in ("auto", "te", "local"):
        raise ValueError(f"backend must be 'auto', 'te' or 'local', got {requested!r}")
    have_te = importlib.util.find_spec("transformer_engine") is not None
    if requested == "te" and not have_te:
        raise RuntimeError("backend 'te' asked for, but transformer_engine is not installed (pip install transformer_engine[pytorch])")
    backend: Backend = "te" if requested == "te" or (requested == "auto" and have_te) else "local"
    if backend not in _announced:
        _announced.add(backend)
        why = "TransformerEngine" if backend == "te" else "Megatron's local modules; MoE experts on torch's grouped_mm"
        logger.warning("NAM56R layer backend: %s (%s, requested %r)", backend, why, requested)
    return backend
