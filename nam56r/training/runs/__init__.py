"""A run's directory and records: its layout (`layout`), TensorBoard events and faults, the summary and plot
(`summary`, `plot`; `python -m nam56r.training.runs.summarize`), the train record, comparisons of runs
(`python -m nam56r.training.runs.compare`) and the resume checks. Imports the recipe core and `data`; it starts
training only as a command (`python -m nam56r.training.launcher`), never by import."""
