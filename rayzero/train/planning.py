"""The driver's plan for a world size: micro-batch x accumulation x data-parallel = the user's global batch.

The global batch never changes across elastic resizes (that would change the optimisation); what changes
is how it is cut.  For a world size W the plan takes the largest acceptable micro-batch m with
``global % (m * W) == 0`` and accumulates ``global / (m * W)`` micro-batches per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayzero.config import ConfigError


@dataclass(frozen=True)
class StepPlan:
    world_size: int
    global_batch: int
    micro_batch: int
    accumulation: int

    def config_overrides(self) -> dict:
        return {
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
        }


def plan_step(global_batch: int, world_size: int, micro_batch_sizes: list[int] | None = None) -> StepPlan:
    """The cut of ``global_batch`` over ``world_size`` ranks, or a ConfigError that shows the options."""
    if global_batch < 1 or world_size < 1:
        raise ConfigError(f"global batch ({global_batch}) and world size ({world_size}) must be >= 1")
    if global_batch % world_size:
        raise ConfigError(
            f"the global batch of {global_batch} samples cannot be split over {world_size} workers "
            f"({global_batch} % {world_size} = {global_batch % world_size}); use a global batch that is a multiple "
            f"of every world size in the elastic range, or a range whose sizes divide {global_batch}"
        )
    per_rank = global_batch // world_size
    candidates = sorted(micro_batch_sizes or _divisors(per_rank), reverse=True)
    for m in candidates:
        if m >= 1 and per_rank % m == 0:
            return StepPlan(world_size, global_batch, m, per_rank // m)
    raise ConfigError(
        f"none of the acceptable micro-batch sizes {sorted(candidates)} divides the {per_rank} samples per worker "
        f"that a global batch of {global_batch} gives on {world_size} workers; acceptable sizes that would work: "
        f"{_divisors(per_rank)}"
    )


def plan_range(
    global_batch: int, min_workers: int, max_workers: int, micro_batch_sizes: list[int] | None = None
) -> dict[int, StepPlan]:
    """Plans for every world size in an elastic range; an error before launch if any size is impossible."""
    plans, problems = {}, []
    for w in range(min_workers, max_workers + 1):
        try:
            plans[w] = plan_step(global_batch, w, micro_batch_sizes)
        except ConfigError as e:
            problems.append(f"  {w} workers: {e}")
    if problems:
        works = [w for w in range(1, max_workers + 1) if global_batch % w == 0]
        raise ConfigError(
            f"the global batch of {global_batch} cannot be kept at every world size in [{min_workers}, "
            f"{max_workers}]:\n" + "\n".join(problems) + f"\nworld sizes that divide it: {works}"
        )
    return plans


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
