"""The data pipeline: a data directory's layout (`layout`) and what its build recorded (`manifest`), the default
corpus build (`build`), conversion of your own data (`convert`), the indexed-dataset format (`format`) and the checks
a run's data passes before any GPU work (`checks`); `python -m nam56r.training.data` (`cli`). Imports the recipe core
only."""
