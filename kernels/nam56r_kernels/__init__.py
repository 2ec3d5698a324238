"""Fused kernels NAM56R uses, each beside its PyTorch reference. Imports torch/triton/tilelang only.

The import name carries the `nam56r_` prefix so it never collides with the PyPI distribution `kernels`.
"""
