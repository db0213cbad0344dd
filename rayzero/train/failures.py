"""Which worker errors ``rayzero.fit`` retries, and which end the run at once.

Ray Train retries a failed worker group up to ``ClusterConfig.max_failures`` times from the latest checkpoint.
That is right for a lost node or a killed worker, and pointless for an error that the next attempt meets
again at the same place: a config the model cannot be laid out with, a model or data of the wrong kind, a
non-finite loss or gradient, a checkpoint that cannot be loaded.  Those errors are *fatal*: rayzero's
failure policy (``rayzero.train.failure_policy``, handed to Ray Train's controller) ends the run at the first
one, and ``fit`` raises that error itself (its type and message, once) instead of Ray Train's
``WorkerGroupError``, which repeats every rank's traceback.

Fatal: :class:`rayzero.ConfigError` (and ``NotSupportedYetError``), :class:`NonFiniteLossError`,
:class:`rayzero.NonFiniteGradientError`, a save that finds too little free space on the checkpoint volume
(:class:`~rayzero.checkpoint.format.StorageFullError`), and a
:class:`~rayzero.checkpoint.format.CheckpointError` raised while a worker loads its checkpoint (``mark_fatal``: a save that fails, for example because a peer died
mid-save, is retried as before).  A failure in which any worker died (its process or node lost) is always
left to Ray Train's own policy: the other ranks' errors may then be its consequence.
"""

from __future__ import annotations

FATAL_ATTR = "_rayzero_fatal"  # set on an exception instance that ends the run without retry (mark_fatal)


class NonFiniteLossError(FloatingPointError):
    """The loss of a training step under ``rayzero.fit`` is NaN or infinite and the engine did not skip the
    step: every retry from the last checkpoint would meet it again."""


class NodePreempted(RuntimeError):
    """Raised by every worker of a ``fit`` run after it saved a checkpoint on a node's preemption notice (the
    node is draining: Ray's drain with reason preemption).  Not a failure of the run: rayzero's failure policy
    hands Ray Train a preemption for it (``FailureConfig.max_preemption_failures``, not ``max_failures``), and
    Ray Train restarts the run at once on the nodes that stay, from that checkpoint.  ``preemption_info``: Ray
    Train's ``PreemptionInfo`` of the notice."""

    def __init__(self, message: str, preemption_info=None):
        super().__init__(message)
        self.preemption_info = preemption_info

    def __reduce__(self):
        return (NodePreempted, (self.args[0], self.preemption_info))


def preempted(failure: BaseException):
    """The ``PreemptionInfo`` when every rank of Ray Train's ``failure`` raised :class:`NodePreempted` (they
    saved a checkpoint on a preemption notice and stopped), else None."""
    failures = getattr(failure, "worker_failures", None)
    if not isinstance(failures, dict) or not failures or _died_any(failures):
        return None
    found = [cause_of(e, NodePreempted) for e in failures.values()]
    if not all(e is not None for e in found):
        return None
    return next((e.preemption_info for e in found if e.preemption_info is not None), None)


def cause_of(error: BaseException | None, kind: type) -> BaseException | None:
    """The first exception of ``kind`` along a worker error's causes (Ray's wrappers keep the worker's own
    exception as a RayTaskError's ``.cause``, or as ``__cause__``), ``error`` itself first; None when none is."""
    for _ in range(9):
        if error is None or isinstance(error, kind):
            return error
        error = getattr(error, "cause", None) or error.__cause__
    return None


def _died_any(failures: dict) -> bool:
    return any(_died(e) for e in failures.values())


def mark_fatal(error: BaseException) -> BaseException:
    """Mark ``error`` as one that no retry can get past; the mark travels with the pickled exception."""
    setattr(error, FATAL_ATTR, True)
    return error


def is_fatal(error: BaseException) -> bool:
    """Whether a worker's error ends the run without retry (see the module docstring)."""
    from rayzero.checkpoint.format import StorageFullError
    from rayzero.config import ConfigError
    from rayzero.engine import NonFiniteGradientError

    return bool(getattr(error, FATAL_ATTR, False)) or isinstance(
        error, (ConfigError, NonFiniteLossError, NonFiniteGradientError, StorageFullError)
    )


def _died(error: BaseException) -> bool:
    """A worker that did not raise but was lost (its actor, process or node died, or stopped answering)."""
    from ray.exceptions import RayActorError

    try:
        from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError

        lost: tuple = (RayActorError, WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError)
    except ImportError:
        lost = (RayActorError,)
    return isinstance(error, lost)


def fatal_error(failure: BaseException) -> tuple[int, BaseException] | None:
    """``(rank, error)`` of the fatal error behind Ray Train's ``failure`` (a ``WorkerGroupError``), the lowest
    rank's; None when the failure is not fatal (no fatal error, or a worker was lost)."""
    failures = getattr(failure, "worker_failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    if any(_died(e) for e in failures.values()):
        return None
    for rank in sorted(failures):
        if is_fatal(failures[rank]):
            return rank, failures[rank]
    return None
