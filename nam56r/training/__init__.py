"""From a recipe to a run, in rooms whose imports point one way (tests/test_layering.py holds them to it):

    recipe core (this folder: recipe, recipe_settings, recipe_checks, settings, phases, recall_probe, arg_types)
      <- data/       the data pipeline                     python -m nam56r.training.data
      <- runs/       a run's directory, logs and records   python -m nam56r.training.runs.summarize / .compare
      <- launcher/   flags, launch, pretrain, preflight    python -m nam56r.training.launcher
      <- gpu_check/  the GPU node's acceptance check       python -m nam56r.training.gpu_check

A room imports the core and the rooms above it, never one below: a lower room that needs a higher one runs its
command as a subprocess (the resume check trains through `python -m nam56r.training.launcher`)."""
