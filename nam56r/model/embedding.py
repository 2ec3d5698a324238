"""The n-gram hash embedding NAM56R adds to the token embedding at its entrance.

For each position, the 2-gram and 3-gram ending there are hashed by `heads` hash functions into
one table per order (`table_size` rows of `embed_dim`); the looked-up rows are projected to the
hidden size and added to the token embedding. Hash, gather and projection are the kernels
package's (`nam56r_kernels.ngram_hash`): the PyTorch reference (embedding, then `proj`), or, on
CUDA tensors with `NgramHashConfig.kernel="fused"`, one fused Triton kernel that never writes the
[b, s, orders*heads*dim] features (see that field for which is the default and why). CPU runs (tests
and parameter counting, never training) take the reference. Both use `proj.weight`, so the
parameters and the checkpoint layout are the same either way.
"""

from __future__ import annotations

import torch
from nam56r_kernels.ngram_hash import make_hash_params, ngram_hash_project_fused, ngram_hash_project_reference

from nam56r.model.config import NgramHashConfig


class NgramHashEmbedding(torch.nn.Module):
    """token ids [b, s] (int64) -> [b, s, hidden] in the tables' dtype."""

    def __init__(
        self,
        config: NgramHashConfig,
        hidden_size: int,
        *,
        params_dtype: torch.dtype,
        init_std: float | None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tables = torch.nn.Parameter(
            torch.empty(len(config.orders), config.table_size, config.embed_dim, dtype=params_dtype, device=device)
        )
        self.proj = torch.nn.Linear(self.features, hidden_size, bias=False, device=device, dtype=params_dtype)
        mult, offset = make_hash_params(config.orders, config.heads, seed=config.seed)
        # Hash constants are part of the model (a checkpoint must not change them): buffers.
        self.register_buffer("hash_mult", mult.to(device) if device is not None else mult, persistent=True)
        self.register_buffer("hash_offset", offset.to(device) if device is not None else offset, persistent=True)
        if init_std is not None:
            torch.nn.init.normal_(self.tables, std=init_std)
            torch.nn.init.normal_(self.proj.weight, std=init_std)

    @property
    def features(self) -> int:
        return len(self.config.orders) * self.config.heads * self.config.embed_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        fused = self.config.kernel == "fused" and input_ids.is_cuda
        project = ngram_hash_project_fused if fused else ngram_hash_project_reference
        return project(input_ids, self.tables, self.config.orders, self.hash_mult, self.hash_offset, self.proj.weight)
