"""The launcher's refusal: a run that cannot start as asked, with what to change (printed as `error: ...`, exit 2)."""


class TrainError(RuntimeError):
    pass
