"""The driver's plan for a world size: the parallel layout, and micro-batch x accumulation x data-parallel
= the user's global batch.

The global batch never changes across elastic resizes (that would change the optimisation); what changes
is how it is cut.  A world of W workers is laid out as ``tp`` (tensor-parallel) x ``dp`` (data-parallel),
``dp = W // tp``, and the dp replicas of each TP shard are split further into ``edp`` blocks of ``ep``
expert-parallel ranks (the engine's ``rayzero.topology.ParallelDims``).  Only the ``dp`` data shards consume
distinct samples: the ``tp`` ranks of one TP group feed the same batch.  So the plan takes the largest
acceptable micro-batch m with ``global % (m * dp) == 0`` and accumulates ``global / (m * dp)`` micro-batches
per step.  With ``tp == ep == 1`` (no model parallelism) ``dp == W`` and this is the plain ZeRO plan.

The user's own cut is kept where it fits: a config's ``train_micro_batch_size_per_gpu`` and/or
``gradient_accumulation_steps`` (``micro_batch`` / ``accumulation`` here, or carried by a
``MicroBatchSizes`` list so that every worker's re-plan keeps them too) are used as given at a world size
whose ``global / dp`` samples per data shard they cut exactly.  At a world size where they do not, the
plan takes the closest valid cut (the micro-batch first: the largest acceptable size not above the user's;
with only an accumulation given, the accumulation nearest to it) and says what it changed and why in
``StepPlan.note``.

A world size can host the layout only when it is a multiple of ``tp * ep``: ``W % tp == 0`` and
``(W // tp) % ep == 0``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rayzero.config import ConfigError

logger = logging.getLogger("rayzero")


@dataclass(frozen=True)
class StepPlan:
    world_size: int
    global_batch: int
    micro_batch: int
    accumulation: int
    tp: int = 1
    ep: int = 1
    # what this plan changed from the user's micro-batch / accumulation and why ("" when nothing); not part
    # of the cut, so plans that cut the same way compare equal
    note: str = field(default="", compare=False)

    @property
    def dp(self) -> int:
        """Data shards per step (ranks that feed distinct samples): world size // tp."""
        return self.world_size // self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert slice, dp // ep."""
        return self.dp // self.ep

    @property
    def dims(self):
        """The engine's layout of this plan (``rayzero.topology.ParallelDims``): which data shard
        (``dims.coords(rank).dp``) each rank feeds."""
        from rayzero.topology import ParallelDims

        return ParallelDims(self.world_size, tp=self.tp, ep=self.ep)

    def config_overrides(self) -> dict:
        return {
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
        }

    def describe(self) -> str:
        """One log line: the layout and the cut, e.g. ``world 4 = tp 2 x dp 2 (ep 2 x edp 1): ...``."""
        layout = f"world {self.world_size}"
        if self.tp > 1 or self.ep > 1:
            layout += f" = tp {self.tp} x dp {self.dp}"
            if self.ep > 1:
                layout += f" (ep {self.ep} x edp {self.edp})"
        line = f"{layout}: micro-batch {self.micro_batch} x accumulation {self.accumulation}"
        return f"{line} (re-planned: {self.note})" if self.note else line


class MicroBatchSizes(list):
    """The acceptable micro-batch sizes (a list of ints, as ``plan_step`` takes them; empty means every
    divisor of the per-shard batch) that also carries the user's own ``micro_batch`` and ``accumulation``.

    The driver hands this list to the workers (``WorkerSpec.micro_batch_sizes``), so each worker's re-plan
    of its world size keeps the user's cut exactly as the driver's plan did.  It pickles with its attributes.
    """

    def __init__(self, sizes=(), micro_batch: int | None = None, accumulation: int | None = None):
        super().__init__(sizes or ())
        self.micro_batch = micro_batch
        self.accumulation = accumulation

    def __repr__(self) -> str:
        return (f"MicroBatchSizes({list(self)!r}, micro_batch={self.micro_batch!r}, "
                f"accumulation={self.accumulation!r})")


def _check_degree(label: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{label} must be an integer >= 1, got {value!r}")


def layout_problem(world_size: int, tp: int = 1, ep: int = 1) -> str | None:
    """Why ``world_size`` workers cannot be laid out as tp x dp with dp a multiple of ep, or None if they can."""
    _check_degree("tensor_parallel.autotp_size", tp)
    _check_degree("expert_parallel.autoep_size", ep)
    if world_size % tp:
        return (
            f"{world_size} workers cannot host tensor_parallel.autotp_size={tp}: {world_size} % {tp} = "
            f"{world_size % tp} (the world size must be a multiple of tp x ep = {tp * ep})"
        )
    dp = world_size // tp
    if dp % ep:
        how = f" (world {world_size} // tp {tp})" if tp > 1 else ""
        return (
            f"{world_size} workers give {dp} data-parallel ranks{how}, which cannot host "
            f"expert_parallel.autoep_size={ep}: {dp} % {ep} = {dp % ep} (the world size must be a multiple "
            f"of tp x ep = {tp * ep})"
        )
    return None


def plan_step(
    global_batch: int,
    world_size: int,
    micro_batch_sizes: list[int] | None = None,
    tp: int = 1,
    ep: int = 1,
    *,
    micro_batch: int | None = None,
    accumulation: int | None = None,
) -> StepPlan:
    """The cut of ``global_batch`` over the ``world_size // tp`` data shards of ``world_size`` ranks, or a
    ConfigError that names the numbers and shows the options.

    Without ``micro_batch`` / ``accumulation`` (the user's own cut; by default those a ``MicroBatchSizes``
    carries) the micro-batch is the largest acceptable size.  With them, the user's cut where it fits this
    world size, else the closest valid one, with ``note`` saying what changed and why.
    """
    if micro_batch is None:
        micro_batch = getattr(micro_batch_sizes, "micro_batch", None)
    if accumulation is None:
        accumulation = getattr(micro_batch_sizes, "accumulation", None)
    for label, value in (("train_micro_batch_size_per_gpu", micro_batch),
                         ("gradient_accumulation_steps", accumulation)):
        if value is not None:
            _check_degree(label, value)
    if global_batch < 1 or world_size < 1:
        raise ConfigError(f"global batch ({global_batch}) and world size ({world_size}) must be >= 1")
    problem = layout_problem(world_size, tp, ep)
    if problem is not None:
        raise ConfigError(problem)
    dp = world_size // tp
    if global_batch % dp:
        if tp == 1:
            raise ConfigError(
                f"the global batch of {global_batch} samples cannot be split over {world_size} workers "
                f"({global_batch} % {world_size} = {global_batch % world_size}); use a global batch that is a "
                f"multiple of every world size in the elastic range, or a range whose sizes divide {global_batch}"
            )
        raise ConfigError(
            f"the global batch of {global_batch} samples cannot be split over the {dp} data shards of "
            f"{world_size} workers (world {world_size} // tp {tp} = {dp}; {global_batch} % {dp} = "
            f"{global_batch % dp}); use a global batch that is a multiple of world // tp for every world size "
            f"in the elastic range"
        )
    per_shard = global_batch // dp
    candidates = sorted(micro_batch_sizes or _divisors(per_shard), reverse=True)
    fits = [m for m in candidates if m >= 1 and per_shard % m == 0]  # largest first
    where = f"{world_size} workers" if tp == 1 else f"the {dp} data shards of {world_size} workers (tp {tp})"
    unit = "worker" if tp == 1 else "data shard"
    if not fits:
        raise ConfigError(
            f"none of the acceptable micro-batch sizes {sorted(candidates)} divides the {per_shard} samples per "
            f"{unit} that a global batch of {global_batch} gives on {where}; acceptable sizes that would work: "
            f"{_divisors(per_shard)}"
        )
    m, note = _choose_micro(fits, per_shard, micro_batch, accumulation,
                            f"the {per_shard} samples per {unit} ({global_batch} / {dp} on {where})")
    return StepPlan(world_size, global_batch, m, per_shard // m, tp, ep, note)


def _choose_micro(
    fits: list[int], per_shard: int, micro_batch: int | None, accumulation: int | None, samples: str
) -> tuple[int, str]:
    """The micro-batch (one of ``fits``: the acceptable sizes that divide ``per_shard``, largest first) and
    the note on what differs from the user's ``micro_batch`` / ``accumulation``."""
    if micro_batch is None and accumulation is None:
        return fits[0], ""  # no cut of the user's: the largest acceptable micro-batch
    notes = []
    if micro_batch is not None:
        if micro_batch in fits:
            m = micro_batch
        else:
            # never a bigger micro-batch than the user's (it bounds activation memory) unless none is smaller
            below = [c for c in fits if c <= micro_batch]
            m = below[0] if below else fits[-1]
            why = (f"{micro_batch} does not divide {samples}" if per_shard % micro_batch
                   else f"{micro_batch} is not one of the acceptable micro-batch sizes")
            notes.append(f"micro-batch {micro_batch} -> {m}: {why}")
        if accumulation is not None and per_shard // m != accumulation:
            notes.append(
                f"gradient accumulation {accumulation} -> {per_shard // m}: micro-batch {m} x accumulation must "
                f"make {samples}"
            )
        return m, "; ".join(notes)
    want = per_shard // accumulation if per_shard % accumulation == 0 else None
    if want in fits:
        return want, ""
    # the accumulation nearest the user's; on a tie the larger one (the smaller micro-batch, less memory)
    m = min(fits, key=lambda c: (abs(per_shard // c - accumulation), c))
    why = (f"{samples} are not a multiple of {accumulation}" if want is None
           else f"its micro-batch {want} is not one of the acceptable micro-batch sizes")
    return m, f"gradient accumulation {accumulation} -> {per_shard // m} (micro-batch {m}): {why}"


def skipped_sizes(min_workers: int, max_workers: int, tp: int = 1, ep: int = 1) -> dict[int, str]:
    """World sizes in ``[min, max]`` that cannot host the tp x ep layout, each with the reason."""
    out = {}
    for w in range(min_workers, max_workers + 1):
        problem = layout_problem(w, tp, ep)
        if problem is not None:
            out[w] = problem
    return out


def plan_range(
    global_batch: int,
    min_workers: int,
    max_workers: int,
    micro_batch_sizes: list[int] | None = None,
    tp: int = 1,
    ep: int = 1,
    *,
    micro_batch: int | None = None,
    accumulation: int | None = None,
) -> dict[int, StepPlan]:
    """Plans for every world size in an elastic range that can host the layout; an error before launch if
    ``min`` or ``max`` cannot host it, or if a size that can host it cannot cut the global batch.

    Sizes strictly inside the range that are not multiples of ``tp * ep`` are left out of the returned plans
    (and logged): a worker group started at such a size stops with a ConfigError (``train_loop_per_worker``
    re-plans and refuses it) instead of training with a wrong layout.  With ``tp == ep == 1`` every size can
    host the layout, so every size must cut the batch.  ``micro_batch`` / ``accumulation`` (the user's cut)
    are kept where they fit and re-planned with a note where they do not (``plan_step``).
    """
    if min_workers < 1 or max_workers < min_workers:
        raise ConfigError(f"the worker range [{min_workers}, {max_workers}] needs 1 <= min <= max")
    skipped = skipped_sizes(min_workers, max_workers, tp, ep)
    plans, problems = {}, []
    for w in range(min_workers, max_workers + 1):
        if w in skipped:
            if w in (min_workers, max_workers):
                end = "min" if w == min_workers else "max"
                problems.append(f"  {w} workers ({end} of the range): {skipped[w]}")
            continue
        try:
            plans[w] = plan_step(global_batch, w, micro_batch_sizes, tp, ep, micro_batch=micro_batch,
                                 accumulation=accumulation)
        except ConfigError as e:
            problems.append(f"  {w} workers: {e}")
    if problems:
        if tp == 1 and ep == 1:
            works = [w for w in range(1, max_workers + 1) if global_batch % w == 0]
            hint = f"world sizes that divide it: {works}"
        else:
            upto = max(max_workers, 4 * tp * ep)
            works = [w for w in range(tp * ep, upto + 1, tp * ep) if global_batch % (w // tp) == 0]
            hint = (
                f"world sizes (up to {upto}) that host tp {tp} x ep {ep} and split the batch over their "
                f"world // tp data shards: {works}"
            )
        raise ConfigError(
            f"the global batch of {global_batch} cannot be kept at every world size in [{min_workers}, "
            f"{max_workers}]" + (f" with tp {tp} x ep {ep}" if tp > 1 or ep > 1 else "") + ":\n"
            + "\n".join(problems) + f"\n{hint}"
        )
    if skipped:
        logger.info(
            "world sizes %s in [%d, %d] cannot host tp %d x ep %d (not multiples of %d) and are skipped; a "
            "worker group Ray starts at one of them stops with a ConfigError; usable sizes: %s",
            sorted(skipped), min_workers, max_workers, tp, ep, tp * ep, sorted(plans),
        )
    return plans


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
