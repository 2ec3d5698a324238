"""N-gram hash embeddings for NAM56R: a PyTorch reference (`reference`) and a fused Triton path (`fused`),
with one contract (`contract`: the hash constants and the input checks both call).

Why: NAM56R adds to each token's embedding the embeddings of the n-grams ending at that token. A table
per n-gram would be vocab**n rows, so each n-gram is hashed into a fixed table instead, and several
independent hash functions ("heads") per order make collisions unlikely to hit the same rows for all
heads at once. The fused path computes the hashes inside the gather kernel (see `fused`).

Contract (both implementations):

- ``tokens``: int64 [b, s], values in [0, 2**31) (token ids; the bound keeps every product below 2**62).
- ``orders``: n-gram orders, e.g. ``(2, 3)``; O = len(orders). Each order n >= 1.
- ``mult``: int64 [O, H, max_order], ``offset``: int64 [O, H], values in [0, 2**31). H = heads per order.
  ``make_hash_params`` makes them deterministically from a seed (odd multipliers).
- ``tables``: floating [O, T, D]; the H heads of order o all hash into ``tables[o]`` (T rows).
- Hash of the n-gram of order n = orders[o] ending at position t, head h::

      id(o, h, t) = (sum_{i=0}^{n-1} tokens[t - i] * mult[o, h, i] + offset[o, h]) mod T

  computed exactly in int64 (each product is reduced mod T before it is added, so no sum overflows).
- Positions t < n - 1 (the n-gram would start before the sequence) have no id (-1 in
  ``ngram_hash_ids``): they contribute zeros to the output and no gradient to the tables.
- Output: [b, s, O * H * D] in the tables' dtype, order-major, then head, then dim:
  ``out[b, t, (o*H + h)*D : (o*H + h + 1)*D] = tables[o, id(o, h, t)]`` (or zeros where there is no id).

The model projects these features to its hidden size right away (``features @ proj_weight.T``):
``ngram_hash_project_reference`` is the reference embedding followed by ``F.linear``;
``ngram_hash_project_fused`` does hash + gather + projection in one kernel, the features never in memory.

The fused paths run on CUDA tensors (or under Triton's CPU interpreter, ``TRITON_INTERPRET=1``) and raise
otherwise: there is no silent fallback to the reference.
"""

from nam56r_kernels.ngram_hash.contract import HASH_VALUE_LIMIT, make_hash_params
from nam56r_kernels.ngram_hash.fused import ngram_hash_embed_fused, ngram_hash_project_fused
from nam56r_kernels.ngram_hash.reference import ngram_hash_embed_reference, ngram_hash_ids, ngram_hash_project_reference

__all__ = [
    "HASH_VALUE_LIMIT",
    "make_hash_params",
    "ngram_hash_embed_fused",
    "ngram_hash_embed_reference",
    "ngram_hash_ids",
    "ngram_hash_project_fused",
    "ngram_hash_project_reference",
]
