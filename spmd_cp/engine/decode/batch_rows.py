"""How a batched decode step deals its rows to the ranks (batched_decode.py)."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ...attention import merge_stacked
from ...attention.block import pack_partial, unpack_partial


class RowSplit(NamedTuple):
    """The batch's rows dealt to the ranks in contiguous runs (the first ``B mod N``
    ranks one more): each rank computes its rows' projections, MLP and logits (the
    replicated weights read once a step for B / N rows), while attention takes every
    rank's KV shard for every row."""

    total: int
    counts: list[int]

    @classmethod
    def of(cls, total: int, ranks: int) -> "RowSplit":
        return cls(total, [total // ranks + (r < total % ranks) for r in range(ranks)])

    def rows(self, rank: int) -> slice:
        start = sum(self.counts[:rank])
        return slice(start, start + self.counts[rank])

    def gather(self, collectives, q, k, v):
        """Every rank's rows of q (NH, n, d), k and v (NKV, n, d), as (., B, d): one
        Allgather of the three."""
        if collectives.size == 1:
            return q, k, v
        heads, kv_heads = q.shape[0], k.shape[0]
        joined = collectives.allgather_rows(
            mx.concatenate([q, k.astype(q.dtype), v.astype(q.dtype)]), axis=1,
            counts=self.counts)
        return (joined[:heads], joined[heads:heads + kv_heads].astype(k.dtype),
                joined[heads + kv_heads:].astype(v.dtype))

    def merge_mine(self, collectives, out: mx.array, lse: mx.array) -> mx.array:
        """The partials (NH, B, d) and (NH, B) of this rank's shard: every rank's
        gathered (one Allgather of B rows' partials: a few KB; graph collectives have no
        Alltoallv), this rank's rows merged over every rank's shard."""
        gathered = collectives.allgather_stack(pack_partial(out, lse, mx.float32))
        mine = gathered[:, :, self.rows(collectives.rank)]
        return merge_stacked(*unpack_partial(mine, out.shape[-1]))[0]
