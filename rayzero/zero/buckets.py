"""Bucket sizes rayzero derives when the config leaves them out.

A step overlaps communication with compute only when it has several buckets: the gradients of the last
layers are reduced while backward still runs through the first ones, and one bucket of weights is
all-gathered while the next is packed.  One bucket the size of the model (DeepSpeed's GPU-era default of
50,000,000 elements is larger than many whole models) serializes the step: every byte waits for the end of
backward.  Too many tiny buckets pay the transport's per-collective cost over and over instead.

The rule (docs/config.md, "Derived bucket sizes"):

* aim for ``TARGET_BUCKETS`` buckets over the model's elements;
* no larger than one of the model's repeated blocks (a transformer layer, found from HF's
  ``_no_split_modules`` or as the module class that repeats over most of the model), so a block's
  gradients leave as soon as its backward ends;
* no smaller than what keeps the transport busy for ``MIN_LATENCIES`` times its per-collective latency,
  and no larger than the transport's cap (DDP's 25 MiB over gloo).

A value written in the config always wins; only left-out keys are derived.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

TARGET_BUCKETS = 8
MIN_LATENCIES = 20


@dataclass(frozen=True)
class TransportProfile:
    """What the rule needs to know about a backend: per-collective latency, bandwidth and a bucket cap."""

    latency_s: float
    bandwidth_bytes_s: float
    max_bucket_bytes: int

    def min_bucket_bytes(self) -> int:
        return int(MIN_LATENCIES * self.latency_s * self.bandwidth_bytes_s)


# gloo, as rayzero drives it (comm/, pairwise): ~0.5 ms a collective however small, ~1.5 GB/s of bucket per
# second for a reduce-scatter or all-gather over 2 ranks on one host (bench/bench_comm.py); the cap is DDP's
# bucket_cap_mb=25.  NCCL (tens of GB/s, ~20 us): the cap is the 50,000,000 fp32 elements DeepSpeed uses on GPUs.
TRANSPORTS: dict[str, TransportProfile] = {
    "gloo": TransportProfile(5e-4, 1.5e9, 25 * 2**20),
    "nccl": TransportProfile(2e-5, 50e9, 200_000_000),
}
DEFAULT_TRANSPORT = TRANSPORTS["gloo"]


def _to_stderr(text: str) -> None:
    print(f"rayzero: {text}", file=sys.stderr, flush=True)


# Where rank 0 says which sizes it derived.  rayzero.fit's workers point it at the driver's start-up phase
# lines ("[rayzero] derived ..."), so the console shows it once, without a worker's prefix.
announce: Callable[[str], None] = _to_stderr


@dataclass(frozen=True)
class BucketPlan:
    reduce_bucket_size: int
    allgather_bucket_size: int
    derived: tuple[str, ...]  # the keys rayzero chose (the others came from the config)
    why: str

    def message(self) -> str:
        chosen = ", ".join(f"{k} {getattr(self, k):,}" for k in self.derived)
        return f"derived {chosen} elements from {self.why}; set these keys in zero_optimization to override"


def repeated_block(model: torch.nn.Module, numel: Callable[[torch.nn.Parameter], int],
                   containers_only: bool = False) -> tuple[str, int] | None:
    """The model's repeated block as ``(class name, elements of its largest instance)``, or None.

    HF models name it in ``_no_split_modules``; otherwise the module class (other than the model's own)
    with two or more instances that together hold the most elements, the larger instance on a tie
    (``containers_only``: only classes made of smaller modules, so a leaf such as ``Linear`` is never the
    block; stage 3's gather units).  ``numel`` counts a parameter's elements (its layout entry's: stage 3
    parameters have no storage).
    """
    sizes: dict[str, list[int]] = defaultdict(list)
    leaves: set[str] = set()
    for m in model.modules():
        if m is model:
            continue
        n = sum(numel(p) for p in m.parameters())
        if n:
            sizes[type(m).__name__].append(n)
            if next(m.children(), None) is None:
                leaves.add(type(m).__name__)
    named = [c for c in (getattr(model, "_no_split_modules", None) or []) if c in sizes]
    if named:
        best = max(named, key=lambda c: max(sizes[c]))
        return best, max(sizes[best])
    repeated = [(sum(v), max(v), c) for c, v in sizes.items()
                if len(v) >= 2 and not (containers_only and c in leaves)]
    if not repeated:
        return None
    _, largest, cls = max(repeated)
    return cls, largest


def derive_bucket_sizes(
    model: torch.nn.Module,
    params: Iterable[torch.nn.Parameter],
    numel: Callable[[torch.nn.Parameter], int],
    backend: str,
    comm_bytes: int,
    reduce_bucket_size: int | None,
    allgather_bucket_size: int | None,
) -> BucketPlan:
    """Fill in the bucket sizes the config left out (None) for ``model`` over ``backend``."""
    total = sum(numel(p) for p in params)
    t = TRANSPORTS.get(backend, DEFAULT_TRANSPORT)
    target = math.ceil(total / TARGET_BUCKETS)
    block = repeated_block(model, numel)
    if block is not None:
        target = min(target, block[1])
    lo = max(1, t.min_bucket_bytes() // comm_bytes)
    hi = max(lo, t.max_bucket_bytes // comm_bytes)
    size = max(lo, min(hi, max(1, target)))
    where = (f"the {backend} transport" if backend in TRANSPORTS else
             "one rank" if backend == "none" else f"the {backend} transport (gloo's figures)")
    block_text = f", repeated block {block[0]} of {block[1]:,}" if block else ""
    why = f"{total:,} elements{block_text} and {where} (a bucket {lo:,}..{hi:,} elements)"
    derived = tuple(k for k, v in (("reduce_bucket_size", reduce_bucket_size),
                                   ("allgather_bucket_size", allgather_bucket_size)) if v is None)
    return BucketPlan(
        reduce_bucket_size=size if reduce_bucket_size is None else reduce_bucket_size,
        allgather_bucket_size=size if allgather_bucket_size is None else allgather_bucket_size,
        derived=derived,
        why=why,
    )


def engine_bucket_plan(model: torch.nn.Module, partitions, dp_comm, config, rank: int) -> BucketPlan:
    """An engine's bucket sizes: the config's, with the left-out ones derived from the model's partitioned
    parameters and the data-parallel group's backend; rank 0 prints what it derived, once."""
    import torch.distributed as dist

    z = config.zero_optimization
    backend = dist.get_backend(dp_comm.group) if dp_comm.world > 1 and dist.is_initialized() else "none"
    entry_of = partitions.entry_of
    plan = derive_bucket_sizes(
        model, partitions.all_params(), lambda p: entry_of[p].padded_numel if p in entry_of else 0,
        backend, config.comm_dtype.itemsize, z.reduce_bucket_size, z.allgather_bucket_size,
    )
    if plan.derived and rank == 0:
        announce(plan.message())
    return plan
