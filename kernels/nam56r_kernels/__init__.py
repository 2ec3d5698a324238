"""The kernels NAM56R uses: each fused op beside its PyTorch reference, and the ops that have no fused path
(the n-gram hash embedding, IndexCache's plan). Imports torch/triton/tilelang only.

The import name carries the `nam56r_` prefix so it never collides with the PyPI distribution `kernels`.
"""
