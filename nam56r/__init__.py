"""NAM56R: the hybrid Mamba-3 / MLA / DSA / MoE model, its recipe and launcher, on the patched Megatron.

This package imports the patched upstreams (built by `nox -s build`) and the fused kernels in
`nam56r_kernels`. It is the only place that knows the model.
"""
