"""From a recipe to a run: data, Megatron flags, the launcher and the per-rank pretrain entry, the run
directory, run logs and records, the training preflight and the GPU acceptance check."""
