"""Every offset in rayzero lives here: parameters -> padded shards -> each rank's partition.

Layout rule (the same for ZeRO stages 1, 2 and 3):

* A parameter of ``numel`` elements is flattened and padded with zeros to ``world * chunk`` elements,
  where ``chunk = ceil(numel / world)``.  Rank ``r`` owns the element range
  ``[r * chunk, min((r + 1) * chunk, numel))`` of the flattened parameter: its *shard*.
* A rank's *partition* of an optimizer param group is the concatenation, in registration order, of its
  shards of that group's parameters (padding included, so every rank's partition has the same size).
* Stage 0 uses the same machinery with ``world = 1``: the one partition is the whole group.

Per-parameter sharding (rather than cutting one long flat buffer into ``world`` pieces) makes every
collective evenly sized: gathering a module's parameters or reducing a bucket of gradients moves exactly
``chunk`` elements per parameter per rank, and sizes that do not divide the world size cost at most
``world - 1`` padding elements per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayzero.parallel.slicing import SplitSpec, full_shape_of, slice_index, splits_of


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ParamEntry:
    """One parameter's place in its group's layout."""

    name: str  # the model's own name for the parameter (first name if shared)
    group_index: int  # optimizer param group
    index_in_group: int
    shape: torch.Size
    numel: int
    chunk: int  # elements per rank, padding included
    partition_offset: int  # where this parameter's shard starts inside the rank's partition

    def owner_range(self, rank: int) -> tuple[int, int]:
        """Element range ``[start, end)`` of the flattened parameter that ``rank`` owns (may be empty)."""
        start = min(rank * self.chunk, self.numel)
        end = min(start + self.chunk, self.numel) if rank * self.chunk < self.numel else start
        return start, end

    world: int
    # EP/TP slicing of the model's full tensor this parameter holds (parallel/slicing.py); () when whole
    splits: tuple[SplitSpec, ...] = ()

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape of the model's tensor this parameter is a slice of (its own shape when not sliced)."""
        return full_shape_of(self.shape, self.splits)

    @property
    def canonical_offset(self) -> int:
        """Where this rank's slice starts in the full tensor's canonical element order."""
        return slice_index(self.splits) * self.numel if self.splits else 0


@dataclass(frozen=True)
class GroupLayout:
    """Layout of one optimizer param group over ``world`` ranks."""

    group_index: int
    world: int
    entries: tuple[ParamEntry, ...]
    partition_numel: int

    @staticmethod
    def build(group_index: int, named_params: list[tuple[str, torch.Tensor]], world: int) -> "GroupLayout":
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        entries = []
        offset = 0
        for i, (name, p) in enumerate(named_params):
            chunk = ceil_div(p.numel(), world)
            entries.append(
                ParamEntry(
                    name=name,
                    group_index=group_index,
                    index_in_group=i,
                    shape=p.shape,
                    numel=p.numel(),
                    chunk=chunk,
                    partition_offset=offset,
                    world=world,
                    splits=splits_of(p),
                )
            )
            offset += chunk
        return GroupLayout(group_index, world, tuple(entries), offset)

    def shard_slice(self, entry: ParamEntry) -> slice:
        """Where ``entry``'s shard lives inside a partition tensor of this group."""
        return slice(entry.partition_offset, entry.partition_offset + entry.chunk)


def rows_view(flat_padded: torch.Tensor, world: int, chunk: int) -> torch.Tensor:
    """View a padded flat parameter (``world * chunk`` elements) as ``(world, chunk)``: row r is rank r's shard."""
    return flat_padded.view(world, chunk)


def copy_into_rows(dst: torch.Tensor, col: int, chunk: int, flat: torch.Tensor, accumulate: bool = False) -> None:
    """Write an unpadded flat tensor into columns ``[col, col + chunk)`` of a ``(world, cols)`` buffer.

    Row ``r`` receives elements ``[r * chunk, (r + 1) * chunk)`` of ``flat``; positions past the end of
    ``flat`` are padding and are left untouched (callers keep them zero).
    """
    numel = flat.numel()
    full_rows = numel // chunk if chunk else 0
    body = dst[:full_rows, col : col + chunk]
    src = flat[: full_rows * chunk].view(full_rows, chunk)
    if accumulate:
        body.add_(src)
    else:
        body.copy_(src)
    rem = numel - full_rows * chunk
    if rem:
        tail = dst[full_rows, col : col + rem]
        if accumulate:
            tail.add_(flat[full_rows * chunk :])
        else:
            tail.copy_(flat[full_rows * chunk :])


def zero_padding(dst: torch.Tensor, col: int, chunk: int, numel: int) -> None:
    """Zero the padding of a parameter of ``numel`` elements in columns ``[col, col + chunk)`` of a
    ``(world, cols)`` buffer: what :func:`copy_into_rows` leaves untouched."""
    full_rows = numel // chunk if chunk else dst.shape[0]
    rem = numel - full_rows * chunk
    if full_rows < dst.shape[0]:
        dst[full_rows, col + rem : col + chunk].zero_()
        dst[full_rows + 1 :, col : col + chunk].zero_()


def copy_from_rows(flat: torch.Tensor, src: torch.Tensor, col: int, chunk: int) -> None:
    """Inverse of :func:`copy_into_rows`: gather columns ``[col, col + chunk)`` of every row into ``flat``."""
    numel = flat.numel()
    full_rows = numel // chunk if chunk else 0
    flat[: full_rows * chunk].view(full_rows, chunk).copy_(src[:full_rows, col : col + chunk])
    rem = numel - full_rows * chunk
    if rem:
        flat[full_rows * chunk :].copy_(src[full_rows, col : col + rem])


def shard_of(flat: torch.Tensor, entry: ParamEntry, rank: int, out: torch.Tensor) -> None:
    """Copy ``rank``'s shard of an unpadded flat parameter into ``out`` (``entry.chunk`` elements, zero padded)."""
    start, end = entry.owner_range(rank)
    n = end - start
    if n:
        out[:n].copy_(flat[start:end])
    if n < entry.chunk:
        out[n:].zero_()
