"""NAM56R: the hybrid Mamba-3 / MLA / DSA / MoE model, its recipe and launcher, on the patched Megatron.

This package imports the patched upstreams (built by `nox -s build`) and the fused kernels in
`nam56r_kernels`. It is the only place that knows the model.
"""

import importlib.util as _importlib_util
import warnings as _warnings

if _importlib_util.find_spec("transformer_engine") is None:
    # Without TransformerEngine and Apex, Megatron warns at import of each of a dozen modules that it uses
    # its local implementations. NAM56R chooses its backend explicitly and says so once
    # (`nam56r.specs.resolve_backend`), so these repeat what the run already states; no other warning is hidden.
    for _message in (
        r"Transformer Engine and Apex are not installed\. Falling back to",
        r"Apex is not installed\. Falling back to Torch Norm",
        r"Only transformer-engine>=[\d.]+ supports MoE experts, but your version is 0\.0\.0",
    ):
        _warnings.filterwarnings("ignore", message=_message, category=UserWarning)
