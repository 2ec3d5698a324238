"""The launcher: a recipe lowered to Megatron's flags (`flags`), checked (`preflight`, `gpu_arch`) and launched with
torchrun (`train`, `train_args`, `launch`), the ranks held at the launch gate (`launch_gate`) and entered through
`pretrain`; the compiled-kernel cache and its prewarm (`kernel_cache`, `kernel_cache_cli`, `kernel_prewarm`).
`python -m nam56r.training.launcher` is the training command. Imports the recipe core, `data` and `runs`."""
