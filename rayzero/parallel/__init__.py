"""Model parallelism beyond ZeRO: how a parameter is sliced across expert- and tensor-parallel ranks."""

from rayzero.parallel.slicing import (
    SplitSpec,
    canonical_to_full,
    full_numel,
    full_shape_of,
    full_to_canonical,
    mark_split,
    slice_count,
    slice_index,
    splits_of,
    take_slice,
)

__all__ = [
    "SplitSpec",
    "canonical_to_full",
    "full_numel",
    "full_shape_of",
    "full_to_canonical",
    "mark_split",
    "slice_count",
    "slice_index",
    "splits_of",
    "take_slice",
]
