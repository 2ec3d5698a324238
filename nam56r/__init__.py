"""NAM56R: the hybrid Mamba-3 / MLA / DSA / MoE model, its recipe and launcher, on the patched Megatron.

This package imports the patched upstreams (built by `nox -s build`) and the fused kernels in
`nam56r_kernels`. It is the only place that knows the model.
"""

import importlib.util as _importlib_util
import os as _os
import warnings as _warnings

VERBOSE_ENV = "NAM56R_VERBOSE"  # set (to 1) by `nam56r.train --verbose`: every upstream warning shows

# Without TransformerEngine and Apex, Megatron warns at import of each of a dozen modules that it uses
# its local implementations. NAM56R chooses its backend explicitly and says so once
# (`nam56r.specs.resolve_backend`), so these repeat what the run already states; no other warning is hidden.
KNOWN_WARNINGS = (
    r"Transformer Engine and Apex are not installed\. Falling back to",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"Only transformer-engine>=[\d.]+ supports MoE experts, but your version is 0\.0\.0",
)


def verbose() -> bool:
    """Whether the environment asks for every upstream warning (VERBOSE_ENV set, and not to 0)."""
    return _os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def show_known_warnings() -> None:
    """Undo the filters of KNOWN_WARNINGS in this process (`--verbose`)."""
    _warnings.filters[:] = [f for f in _warnings.filters if not (f[0] == "ignore" and f[1] is not None and f[1].pattern in KNOWN_WARNINGS)]


if _importlib_util.find_spec("transformer_engine") is None and not verbose():
    for _message in KNOWN_WARNINGS:
        _warnings.filterwarnings("ignore", message=_message, category=UserWarning)
