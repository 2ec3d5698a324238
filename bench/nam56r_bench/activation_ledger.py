"""The bytes autograd keeps for the backward of one forward pass, read from its saved-tensor hooks.

`SavedTensorLedger` is a context manager around a forward: every tensor autograd packs for the backward passes
through `torch.autograd.graph.saved_tensors_hooks`, and the ledger records the storage it lives in once (a view and
its base, or one tensor saved by several nodes, count once: the storage is what stays allocated), with its size in
bytes (elements x dtype size of the whole storage), the module that was running when it was saved, and its kind:

- "parameter": a parameter's storage (weights are resident anyway; not an activation),
- "input": the storage of a tensor handed to the forward (the residual stream the previous layer produced),
- "activation": everything else, allocated by this forward and kept alive by its graph.

What it cannot see: tensors a custom autograd Function keeps as plain `ctx` attributes instead of through
`save_for_backward`, and tensors a module keeps in its own attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch

KINDS = ("activation", "input", "parameter")


@dataclass(frozen=True)
class SavedStorage:
    """One storage autograd keeps for the backward: the first tensor saved in it names it."""

    module: str  # dotted path of the innermost module running when it was first saved ("" for the root)
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # the whole storage's bytes
    kind: str  # one of KINDS
    saves: int = 1  # how many times autograd packed a tensor living in it


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class SavedTensorLedger:
    """Records the storages saved for backward inside its `with` block; `module` names submodules of it in the
    records, `inputs` are the tensors the forward receives."""

    def __init__(self, module: torch.nn.Module | None = None, inputs: Sequence[torch.Tensor] = ()) -> None:
        self.module = module
        self.storages: dict[int, SavedStorage] = {}
        self._parameters = {_storage_key(p) for p in module.parameters()} if module is not None else set()
        self._inputs = {_storage_key(t) for t in inputs}
        self._path: list[str] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes() == 0:
            return t
        key = _storage_key(t)
        if key in self.storages:
            old = self.storages[key]
            self.storages[key] = SavedStorage(old.module, old.shape, old.dtype, old.nbytes, old.kind, old.saves + 1)
            return t
        kind = "parameter" if key in self._parameters else "input" if key in self._inputs else "activation"
        where = self._path[-1] if self._path else ""
        self.storages[key] = SavedStorage(where, tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), kind)
        return t

    # Module hooks that return something replace the module's inputs or output: these return None.
    def _enter(self, name: str) -> None:
        self._path.append(name)

    def _leave(self, name: str) -> None:
        # Some modules run a submodule's pre-hooks without its forward (our grouped experts): pop through those.
        while self._path and self._path.pop() != name:
            pass

    def __enter__(self) -> SavedTensorLedger:
        if self.module is not None:
            for name, sub in self.module.named_modules():
                self._handles.append(sub.register_forward_pre_hook(lambda *_, n=name: self._enter(n)))
                self._handles.append(sub.register_forward_hook(lambda *_, n=name: self._leave(n)))
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self._hooks.__exit__(kind, error, trace)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def bytes(self, kinds: Iterable[str] = ("activation", "input")) -> int:
        """Bytes of the saved storages of `kinds` (activations and the saved inputs: what the graph holds beyond weights)."""
        wanted = set(kinds)
        return sum(s.nbytes for s in self.storages.values() if s.kind in wanted)

    def top(self, n: int = 10, kinds: Iterable[str] = ("activation", "input")) -> list[SavedStorage]:
        """The `n` largest saved storages of `kinds`, largest first."""
        wanted = set(kinds)
        return sorted((s for s in self.storages.values() if s.kind in wanted), key=lambda s: -s.nbytes)[:n]

    def by_module(self, depth: int = 2, kinds: Iterable[str] = ("activation", "input")) -> dict[str, int]:
        """Bytes of `kinds` per module path cut to its first `depth` names, largest first."""
        wanted, totals = set(kinds), {}
        for s in self.storages.values():
            if s.kind in wanted:
                key = ".".join(s.module.split(".")[:depth]) if s.module else "(root)"
                totals[key] = totals.get(key, 0) + s.nbytes
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def saved_bytes(forward: object, module: torch.nn.Module | None = None, inputs: Sequence[torch.Tensor] = ()) -> SavedTensorLedger:
    """Run `forward()` under a ledger and return it (a shorthand for tests and one-off counts)."""
    with SavedTensorLedger(module, inputs) as ledger:
        forward()  # type: ignore[operator]
    return ledger
