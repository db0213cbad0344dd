"""How a parameter held by one rank relates to the full tensor of the model it came from.

Expert parallelism gives each rank a block of experts (a slice of dim 0 of a stacked ``(E, ...)`` tensor),
and tensor parallelism gives each rank a slice of a linear layer's rows or columns.  Such a parameter
carries its splits, outermost first, as ``param._rayzero_splits``::

    experts.gate_up_proj  full (E, 2I, H), EP=2 x TP=2:
        (SplitSpec("ep", dim=0, parts=2, index=ep_rank), SplitSpec("tp", dim=1, parts=2, index=tp_rank, packed=2))

A :class:`SplitSpec` with ``packed=k`` cuts dimension ``dim`` into ``k`` equal blocks first (a fused
``gate_up`` projection is two blocks) and takes piece ``index`` of ``parts`` from each block.

The *canonical order* of a sliced parameter is the concatenation, over every slice in lexicographic order
of the split indices, of that slice's flattened elements.  A rank's slice is the contiguous range
``[slice_index * local_numel, (slice_index + 1) * local_numel)`` of it, so checkpoints address sliced
parameters by element ranges exactly as they address data-parallel shards.  When every split cuts dim 0
without packing, the canonical order is the full tensor's own flattened order, whatever the degrees.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class SplitSpec:
    axis: str  # "ep" or "tp": which parallel dimension the slices are spread over
    dim: int  # dimension of the (already outer-split) tensor that is cut
    parts: int
    index: int
    packed: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "SplitSpec":
        return SplitSpec(d["axis"], int(d["dim"]), int(d["parts"]), int(d["index"]), int(d.get("packed", 1)))

    def layout(self) -> tuple:
        """What the canonical order depends on (not which slice a rank holds)."""
        return (self.dim, self.parts, self.packed)

    def check(self, size: int, name: str = "parameter") -> None:
        if size % (self.parts * self.packed):
            raise ValueError(
                f"{name}: dimension {self.dim} has {size} elements, which {self.axis} cannot cut into "
                f"{self.parts} parts{f' of each of {self.packed} packed blocks' if self.packed > 1 else ''}; "
                f"choose a {self.axis} size that divides {size // self.packed if self.packed > 1 else size}"
            )


def splits_of(p: torch.Tensor) -> tuple[SplitSpec, ...]:
    return tuple(getattr(p, "_rayzero_splits", ()))


def mark_split(p: torch.Tensor, spec: SplitSpec) -> None:
    """Record that ``p`` (already cut) is slice ``spec.index`` of ``spec.parts`` (appended as innermost split)."""
    p._rayzero_splits = splits_of(p) + (spec,)


def take_slice(t: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
    """The slice ``spec`` describes, cut out of ``t`` (a copy, contiguous)."""
    size = t.shape[spec.dim]
    block = size // spec.packed
    piece = block // spec.parts
    pieces = [t.narrow(spec.dim, b * block + spec.index * piece, piece) for b in range(spec.packed)]
    return torch.cat(pieces, dim=spec.dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


def _with_index(spec: SplitSpec, index: int) -> SplitSpec:
    return SplitSpec(spec.axis, spec.dim, spec.parts, index, spec.packed)


def full_shape_of(local_shape: Iterable[int], splits: tuple[SplitSpec, ...]) -> tuple[int, ...]:
    shape = list(local_shape)
    for s in splits:
        shape[s.dim] *= s.parts
    return tuple(shape)


def full_numel(local_shape: Iterable[int], splits: tuple[SplitSpec, ...]) -> int:
    return math.prod(full_shape_of(local_shape, splits))


def slice_count(splits: tuple[SplitSpec, ...]) -> int:
    return math.prod(s.parts for s in splits)


def slice_index(splits: tuple[SplitSpec, ...]) -> int:
    """Position of this slice in the canonical order (lexicographic over the splits, outermost first)."""
    index = 0
    for s in splits:
        index = index * s.parts + s.index
    return index


def _all_indices(splits: tuple[SplitSpec, ...]) -> list[tuple[int, ...]]:
    out = [()]
    for s in splits:
        out = [prefix + (i,) for prefix in out for i in range(s.parts)]
    return out


def _cut(full: torch.Tensor, splits: tuple[SplitSpec, ...], indices: tuple[int, ...]) -> torch.Tensor:
    t = full
    for s, i in zip(splits, indices):
        t = take_slice(t, _with_index(s, i))
    return t


def full_to_canonical(full: torch.Tensor, splits: tuple[SplitSpec, ...]) -> torch.Tensor:
    """The full tensor's elements in the canonical order of ``splits`` (a flat tensor)."""
    if not splits:
        return full.reshape(-1)
    return torch.cat([_cut(full, splits, idx).reshape(-1) for idx in _all_indices(splits)])


def canonical_to_full(flat: torch.Tensor, local_shape: Iterable[int], splits: tuple[SplitSpec, ...]) -> torch.Tensor:
    """Inverse of :func:`full_to_canonical`: rebuild the full tensor from its canonical-order elements."""
    local_shape = tuple(local_shape)
    if not splits:
        return flat.reshape(local_shape)
    outer, inner = splits[0], splits[1:]
    outer_slice_shape = full_shape_of(local_shape, inner)
    per_slice = math.prod(outer_slice_shape)
    full = torch.empty(full_shape_of(local_shape, splits), dtype=flat.dtype, device=flat.device)
    block = full.shape[outer.dim] // outer.packed
    part = block // outer.parts
    for i in range(outer.parts):
        piece = canonical_to_full(flat[i * per_slice : (i + 1) * per_slice], local_shape, inner)
        for b in range(outer.packed):
            full.narrow(outer.dim, b * block + i * part, part).copy_(piece.narrow(outer.dim, b * part, part))
    return full


def local_slice(full: torch.Tensor, splits: tuple[SplitSpec, ...]) -> torch.Tensor:
    """The slice of ``full`` that ``splits`` (with their own indices) describe."""
    for s in splits:
        full = take_slice(full, s)
    return full


def order_key(splits: tuple[SplitSpec, ...]) -> tuple:
    """Slicings with equal keys put the full tensor's elements in the same canonical order, so a slice
    saved under one is found by plain element ranges under the other (any EP degree on stacked experts)."""
    if all(s.dim == 0 and s.packed == 1 for s in splits):
        return ()
    return tuple(s.layout() for s in splits)


def layout_dicts(splits: tuple[SplitSpec, ...]) -> list[dict]:
    """What a checkpoint records of a slicing: the cut, not which slice one rank held."""
    return [{"axis": s.axis, "dim": s.dim, "parts": s.parts, "packed": s.packed} for s in splits]


def from_layout_dicts(items: list[dict]) -> tuple[SplitSpec, ...]:
    return tuple(SplitSpec.from_dict({**d, "index": 0}) for d in items)


def local_shape_of(full_shape: Iterable[int], splits: tuple[SplitSpec, ...]) -> tuple[int, ...]:
    shape = list(full_shape)
    for s in splits:
        shape[s.dim] //= s.parts
    return tuple(shape)
