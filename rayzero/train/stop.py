"""Clean stops of a ``rayzero.fit`` run: SIGINT/SIGTERM on the driver stop the workers at the next step boundary.

The driver's handler (``StopSignals``) writes a stop request for the run into Ray's GCS key-value store.  Rank 0
of the worker group reads it in a background thread (``StopWatcher``: one GCS read every ``POLL_S`` seconds,
nothing in the step itself); the ranks agree on it through the step's loss all-reduce, which carries one more
element (``agree``), so every rank stops after the same step.  They save a checkpoint there (unless
``ClusterConfig(save_on_stop=False)``), report it to Ray Train and return; ``fit`` then raises ``RunStopped``
with what was saved and how to resume.  A second signal while the run stops aborts it at once: the checkpoints
saved before stay good (a save is atomic: a checkpoint without its manifest is never loaded).

A node's preemption notice takes the same path: Ray Train marks every worker when a node of the group is
draining for preemption; rank 0's watcher reads the mark, the ranks agree on it in the same all-reduce and
save a checkpoint at that step, then wait: at the node's deadline Ray Train tears the group down and restarts
it on the nodes that stay, from that checkpoint, charged to ``FailureConfig.max_preemption_failures``.  (An
earlier restart would count the draining node's resources, which Ray still reports, and wait for them.)
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading

import torch

STOP_NAMESPACE = "rayzero-stop"
POLL_S = 0.5  # how often rank 0 reads the stop request (one GCS read; the steps never wait for it)
SIGNAL_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class RunStopped(KeyboardInterrupt):
    """``fit`` was stopped by SIGINT/SIGTERM on the driver.  A ``KeyboardInterrupt``, so that code which cleans
    up on Ctrl-C still does, and ``except Exception`` does not swallow a stop.  ``step``: the step the workers
    stopped after (None: they stopped before finishing a step); ``checkpoint``: the directory of the checkpoint
    a rerun resumes from (None: none, the rerun starts afresh); ``saved``: whether it was saved at the stop."""

    def __init__(self, message: str, run: str, step: int | None, checkpoint: str | None, saved: bool):
        super().__init__(message)
        self.run, self.step, self.checkpoint, self.saved = run, step, checkpoint, saved

    def __str__(self) -> str:
        return self.args[0]


# ---- the request, in the GCS key-value store ---------------------------------------------------------------


def request_stop(run: str, why: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(run, why, overwrite=True, namespace=STOP_NAMESPACE)


def stop_requested(run: str) -> str | None:
    """The reason the run was asked to stop (``"SIGINT"``, ...), or None."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return None
    value = _internal_kv_get(run, namespace=STOP_NAMESPACE)
    return value.decode() if value else None


def clear_stop(run: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(run, namespace=STOP_NAMESPACE)


# ---- the workers ----------------------------------------------------------------------------------------------


STOP, PREEMPT = 1.0, 2.0  # what rank 0 puts in the step's all-reduce: the driver's stop, a preemption notice
PREEMPTION_NO_DEADLINE_S = 120.0  # Ray Train's wait for a notice without a deadline (DEFAULT_PREEMPTION_DEADLINE_S)
PREEMPTION_WAIT_S = 120.0  # how long past the deadline the workers wait for Ray Train's teardown before raising


def preemption_notice():
    """Ray Train's ``PreemptionInfo`` for this worker's group once a node hosting one of its workers is being
    preempted (Ray's drain with reason preemption, which Ray Train's ``PreemptionWatcher`` fans out to every
    worker), else None.  Read from the worker's own train context: no call, no barrier (``ray.train.
    get_preemption_info()`` is a barrier across all workers on every call)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except Exception:  # noqa: BLE001 - no train context (a worker of another kind), or Ray moved it
        return None


class StopWatcher(threading.Thread):
    """On rank 0: every ``poll_s`` seconds reads the run's stop request (``requested``) and whether a node of the
    worker group is being preempted (``preemption``: Ray Train's ``PreemptionInfo``).  A failed read (the GCS busy
    or gone) counts as no request: the run goes on as it would without a stop."""

    def __init__(self, run: str, poll_s: float = POLL_S):
        super().__init__(daemon=True, name="rayzero-stop-watcher")
        self.run_name, self.poll_s = run, poll_s
        self.requested = threading.Event()
        self.preemption = None
        self.done = threading.Event()

    def run(self) -> None:  # noqa: D401 - threading.Thread's entry point
        while not self.done.wait(self.poll_s):
            if self.preemption is None:
                self.preemption = preemption_notice()
            if not self.requested.is_set():
                try:
                    if stop_requested(self.run_name):
                        self.requested.set()
                except Exception:  # noqa: BLE001 - a courtesy read: never fail the run for it
                    pass
            if self.requested.is_set() and self.preemption is not None:
                return

    def flag(self) -> float:
        """What rank 0 adds to the step's all-reduce: a stop asked by the driver wins over a preemption notice."""
        if self.requested.is_set():
            return STOP
        return PREEMPT if self.preemption is not None else 0.0

    def close(self) -> None:
        self.done.set()


def agree(comm, step_loss: torch.Tensor, flag: float, world: int) -> tuple[float, float]:
    """Sum the step's loss over the ranks and agree whether to stop, in the one all-reduce the step already
    does: the loss tensor carries a second element, rank 0's ``flag`` (0, ``STOP`` or ``PREEMPT``; the other
    ranks add 0).  Returns the summed loss (a Python float) and the flag every rank now has.  The loss element
    is summed as it was alone (the transports add element by element)."""
    if world == 1:
        return step_loss.item(), flag
    both = torch.cat([step_loss.reshape(1), step_loss.new_full((1,), flag)])
    loss, agreed = comm.sum_scalar(both).tolist()
    return loss, agreed


def preempted_message(step: int, tag: str | None, info) -> str:
    """What a worker raises (``NodePreempted``) after the checkpoint it saved on a preemption notice."""
    nodes = ", ".join(getattr(info, "preempted_node_ids", None) or []) or "a node of the worker group"
    deadline = getattr(info, "deadline_ms", None)
    import time

    left = f", {max(0.0, deadline / 1000 - time.time()):.0f} s before its deadline" if deadline else ""
    saved = f"saved checkpoint {tag} at step {step}" if tag else f"stopped after step {step}"
    return (f"node {nodes} is being preempted{left}: {saved}; at the deadline Ray Train restarts the run from it "
            "on the nodes that stay (a preemption counts against FailureConfig.max_preemption_failures, not "
            "max_failures)")


# ---- the driver ---------------------------------------------------------------------------------------------


class StopSignals:
    """While ``fit`` waits on Ray Train: the first SIGINT/SIGTERM asks the workers to stop (``request_stop``);
    a second one aborts the run (Ray Train's controller, when known) and raises ``KeyboardInterrupt``.  Installed
    only from the main thread (Python's rule for signal handlers); elsewhere the signals keep their handlers.
    ``controller``: set to Ray Train's controller handle once the trainer has one."""

    def __init__(self, run: str, say, save: bool = True):
        self.run, self.say, self.save = run, say, save
        self.signal_name: str | None = None
        self.controller = None
        self.aborted: str | None = None  # the message of a second signal's abort
        self.previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNAL_NAMES:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind, value, tb) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()
        if self.aborted and kind is not None and issubclass(kind, KeyboardInterrupt):
            # Ray's wait turns the handler's exception into a bare KeyboardInterrupt: give it back its words
            raise KeyboardInterrupt(self.aborted) from None

    def _handle(self, signum, frame) -> None:
        name = SIGNAL_NAMES.get(signum, str(signum))
        if self.signal_name is None:
            self.signal_name = name
            try:
                request_stop(self.run, name)
            except Exception as e:  # noqa: BLE001 - no GCS: nothing can be stopped cleanly
                self._abort()
                raise KeyboardInterrupt(f"{name}: could not ask the workers of run {self.run} to stop ({e}); "
                                        "the run was aborted") from None
            there = "saving a checkpoint there" if self.save else "without saving one there (save_on_stop=False)"
            self.say(f"{name}: stopping run {self.run} at the next step boundary and {there} "
                     f"(press Ctrl-C again to abort at once: the checkpoints saved before stay good)")
            return
        self.aborted = (f"run {self.run} aborted by a second {name} while it stopped, without a checkpoint at the "
                        "stop; the checkpoints saved before stay good: rerun the same call to resume from the latest")
        self.say(self.aborted)
        self._abort()
        raise KeyboardInterrupt(self.aborted)

    def _abort(self) -> None:
        if self.controller is not None:
            try:
                import ray

                ray.get(self.controller.abort.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the controller exits as it aborts; the driver's exit ends the rest
                pass


def resume_text(run: str, named: bool, storage: str) -> str:
    """How to resume: the same call, which finds the run by its name and storage (a name ``fit`` made from the
    time must be given), and the command line this driver ran as."""
    if named:
        how = f"rerun the same call (ClusterConfig name {run!r}, storage {storage!r})"
    else:
        how = (f"rerun the same call with ClusterConfig(name={run!r}, storage={storage!r}) (this run's name was "
               "made from the time: without it a rerun starts a new run)")
    command = shlex.join([os.path.basename(sys.executable)] + sys.argv) if sys.argv and sys.argv[0] else None
    if command and sys.argv[0].endswith(("ipykernel_launcher.py", "-c")):
        command = None
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        how += "; under `ray job submit`, submit the same entrypoint again"
        if command:
            how += f" (this driver ran as: {command})"
    elif command:
        how += f"; this driver ran as: {command}"
    return how


def stopped_message(run: str, why: str, step: int | None, checkpoint: str | None, saved: bool, how: str) -> str:
    if saved and checkpoint:
        what = f"saved checkpoint {os.path.basename(checkpoint.rstrip('/'))} (step {step}) at {checkpoint}"
    elif checkpoint:
        what = (f"no checkpoint saved at the stop (save_on_stop=False); the latest is "
                f"{os.path.basename(checkpoint.rstrip('/'))} at {checkpoint}, and a rerun redoes the steps after it")
    else:
        what = "no checkpoint was saved (save_on_stop=False, and none before): a rerun starts afresh"
    at = f"after step {step}" if step is not None else "before its first step"
    return f"run {run} stopped by {why} {at}: {what}. To resume, {how}"
