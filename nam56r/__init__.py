"""NAM56R: the hybrid Mamba-3 / MLA / DSA / MoE model (`nam56r.model`) and the training that turns a recipe
into a run (`nam56r.training`), on the patched Megatron.

The model imports the patched upstreams (built by `nox -s build`) and the fused kernels in `nam56r_kernels`;
the training imports the model and the patch lane's pure readers (`nam56r_patchlane`).
"""

import importlib.util as _importlib_util
import os as _os
import warnings as _warnings
from pathlib import Path as _Path

CHECKOUT_ROOT = _Path(__file__).resolve().parent.parent  # the checkout this package is installed from (editable)
VERBOSE_ENV = "NAM56R_VERBOSE"  # set (to 1) by `nam56r.training.launcher --verbose`: every upstream warning shows

# Without TransformerEngine and Apex, Megatron warns at import of each of a dozen modules that it uses
# its local implementations. NAM56R chooses its backend explicitly and says so once
# (`nam56r.model.specs.resolve_backend`), so these repeat what the run already states; no other warning is hidden.
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
