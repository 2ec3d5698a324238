"""The n-gram hash embedding NAM56R adds to the token embedding at its entrance.

For each position, the 2-gram and 3-gram ending there are hashed by `heads` hash functions into
one table per order (`table_size` rows of `embed_dim`); the looked-up rows are projected to the
hidden size and added to the token embedding. Hash, gather and projection are the kernels
package's (`nam56r_kernels.ngram_hash`): a masked gather of the tables' rows into the
[b, s, orders*heads*dim] features, then one linear with `proj.weight` (cuBLAS on CUDA).
"""

from __future__ import annotations

import torch
from nam56r_kernels.ngram_hash import make_hash_params, ngram_hash_project

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
        return ngram_hash_project(input_ids, self.tables, self.config.orders, self.hash_mult, self.hash_offset, self.proj.weight)
