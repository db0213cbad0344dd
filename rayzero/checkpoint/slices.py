"""Reading one rank's EP/TP slice of a parameter from a checkpoint saved at any slicing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rayzero.parallel.slicing import canonical_to_full, from_layout_dicts, local_shape_of, local_slice, order_key

if TYPE_CHECKING:
    from rayzero.checkpoint.reader import FragmentIndex


def slice_filler(index: FragmentIndex, saved: dict, entry):
    """How to read elements ``[lo, hi)`` of this rank's slice of a parameter from the checkpoint.

    Where the saved slicing orders the full tensor like this rank's (always without TP, and for any EP
    degree on stacked experts) that is a plain range read at the slice's canonical offset.  Otherwise (a
    TP degree change on a column-cut weight) the full tensor is rebuilt from the saved slices once per
    state and this rank's slice cut out of it.
    """
    saved_splits = from_layout_dicts(saved.get("splits", []))
    offset = entry.canonical_offset
    if order_key(saved_splits) == order_key(entry.splits):
        return lambda name, state, lo, hi, out: index.fill(name, state, offset + lo, offset + hi, out)

    def fill(name: str, state: str, lo: int, hi: int, out: torch.Tensor) -> None:
        flat = torch.empty(saved["numel"], dtype=out.dtype)
        index.fill(name, state, 0, saved["numel"], flat)
        full = canonical_to_full(flat, local_shape_of(saved["shape"], saved_splits), saved_splits)
        out.copy_(local_slice(full, entry.splits).reshape(-1)[lo:hi])

    return fill


def prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
