"""rayzero's failure policy for Ray Train's controller: Ray Train's default, except that a fatal worker error
(``rayzero.train.failures``) ends the run at its first failure instead of being retried ``max_failures`` times.

Ray Train 2.60 has no public option for which errors are retried: it builds its policy inside
``DataParallelTrainer.fit`` (``create_failure_policy``) and hands it to the controller actor with the other
controller arguments.  :class:`RayzeroTrainer` swaps the policy there.  The controller runs the policy in its
own actor, which imports this module by name (rayzero is installed, or on the job's ``PYTHONPATH``, there too).
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

from rayzero.train.failures import fatal_error, preempted


class FatalErrorPolicy(DefaultFailurePolicy):
    def make_decision(self, training_failed_error):
        if fatal_error(training_failed_error) is not None:
            return FailureDecision.RAISE
        info = preempted(training_failed_error)
        if info is not None:
            # every rank saved a checkpoint on a node's preemption notice and stopped: a preemption, charged to
            # FailureConfig.max_preemption_failures as Ray Train charges its own, and restarted at once
            from ray.train.v2.api.exceptions import PreemptionError

            return super().make_decision(PreemptionError(preemption_info=info))
        return super().make_decision(training_failed_error)


class RayzeroTrainer(TorchTrainer):
    """``TorchTrainer`` whose controller decides retries with :class:`FatalErrorPolicy`."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        default = controller_init_kwargs.get("failure_policy")
        if default is None or not hasattr(default, "failure_config"):
            raise RuntimeError(
                "rayzero: this Ray Train version no longer passes failure_policy to its controller; rayzero's "
                "fatal-error policy cannot be installed (rayzero.train.failure_policy needs updating)"
            )
        controller_init_kwargs["failure_policy"] = FatalErrorPolicy(default.failure_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)
