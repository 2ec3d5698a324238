"""`nox -s bench`: measured speed and memory of the stack, patched against unpatched in the same run.

Suites (``python -m nam56r_bench --list``): ``tooling`` (CPU: the patch lane's build times), ``kernels``
(GPU: each fused kernel or memory patch against its reference or upstream path), ``train-step``,
``microbatch`` and ``compile-tax`` (GPU: the training step through ``nam56r.training.launcher``). Every suite writes
``<suite>.json`` (stamped with host, versions, commit and upstream pins) and ``<suite>.png``.
"""
