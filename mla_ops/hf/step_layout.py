"""The layout of a step plan's int32 buffer ("pack"), defined once.

A step's plan is one int32 buffer of named fields, in this order (B rows, M block-table
columns):

    table            [B * M]   block table after the step (-1: no block)
    seq_lens         [B]       lengths the attention reads
    query_start_loc  [B + 1]   row b's tokens start at query_start_loc[b]
    bounded_table    [B * M]   table clamped to [0, num_blocks - 1]       (bound only)
    bounded_lens     [B]       seq_lens clamped to [1, M * block_size]    (bound only)
    taken            [1]       blocks taken from the allocator this step

bound: the plan also carries the decode kernels' inputs bounded once per step (where the
layers run FlashMLA). One buffer, because compiled, Inductor recomputes a small computed
tensor for every custom op that reads it, while views of one realized buffer are passed as
they are. mla::decode_step_plan's kernel writes it (at the offsets given here), the cache's
torch path builds it with pack(), and both read it through views().
"""
from __future__ import annotations

import torch


class PackLayout:
    """Named int32 fields of given lengths, laid out one after another in one buffer."""

    def __init__(self, fields):
        self.fields = tuple((name, int(n)) for name, n in fields)     # ((name, length), ...)
        self.offsets, at = {}, 0
        for name, n in self.fields:
            self.offsets[name] = at
            at += n
        self.size = at                                                 # int32s in all

    def __contains__(self, name: str) -> bool:
        return name in self.offsets

    def offset(self, name: str) -> int:
        return self.offsets[name]

    def views(self, pack: torch.Tensor) -> dict:
        """name -> 1-D view of pack [size] holding that field."""
        if pack.dim() != 1 or pack.shape[0] != self.size:
            raise ValueError(f"pack must be 1-D of {self.size} values for this layout, got "
                             f"{tuple(pack.shape)}")
        return {name: pack[self.offsets[name]:self.offsets[name] + n] for name, n in self.fields}

    def pack(self, **parts: torch.Tensor) -> torch.Tensor:
        """The buffer [size] of the fields' values (each any shape of its length), in order."""
        if set(parts) != set(self.offsets):
            raise ValueError(f"pack() needs the fields {[n for n, _ in self.fields]}, got "
                             f"{sorted(parts)}")
        out = [parts[name].reshape(-1).to(torch.int32) for name, _ in self.fields]
        for (name, n), t in zip(self.fields, out):
            if t.shape[0] != n:
                raise ValueError(f"field {name} holds {n} values, got {t.shape[0]}")
        return torch.cat(out)


def step_layout(batch: int, width: int, bound: bool) -> PackLayout:
    """The plan's layout for batch rows of a block table width columns wide."""
    B, M = batch, width
    fields = [("table", B * M), ("seq_lens", B), ("query_start_loc", B + 1)]
    if bound:
        fields += [("bounded_table", B * M), ("bounded_lens", B)]
    return PackLayout(fields + [("taken", 1)])
