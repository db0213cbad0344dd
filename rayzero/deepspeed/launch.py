"""``rayzero launch``: run a DeepSpeed-style script on a Ray cluster, one Ray actor per rank.

The launcher's job of torchrun (or DeepSpeed's ``deepspeed`` command), on Ray: it joins the cluster (or
starts a local one), reserves one bundle per rank in a placement group (PACK, so ranks share nodes where
they fit), starts one actor per rank in it, gives each the variables torchrun gives its processes
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` = rank 0's
node address, ``MASTER_PORT`` = a port free on rank 0's node) and runs the script as ``__main__`` in it
with ``sys.argv = [script, *args]``.  The script's own ``init_distributed`` (``rayzero.deepspeed.comm``,
``torch.distributed``) then makes the process group from those variables, as under torchrun.

Every rank's output reaches the driver through Ray's log forwarding, prefixed ``(rankN pid=...)``.  The
status is 0 when every rank ends with 0; otherwise it is the first failing rank's, whose error is printed,
and the other ranks are ended at once (killed: a script's error does not go away on a retry, so there is
none).  Ctrl-C ends every rank too.

Ranks are numbered node by node (the ranks of one node are consecutive, as torchrun numbers them).  On the
driver's node a rank runs in the driver's working directory; elsewhere in its Ray worker's (the job's
``working_dir`` under ``ray job submit --working-dir``), so the script's path must name a file there.
"""

from __future__ import annotations

import os
import sys
import time

EXIT_OK = 0
EXIT_INTERRUPTED = 130
_TAIL_LINES = 15  # of a failing rank's traceback, printed on the driver


class RankProcess:
    """One rank: a Ray actor (its own worker process) that runs the script once."""

    def __init__(self, rank: int):
        self.rank = rank

    def __repr__(self) -> str:  # Ray prefixes the actor's output lines with this: "(rank1 pid=...)"
        return f"rank{self.rank}"

    def where(self) -> tuple[str, str, list]:
        """(node id, node address, GPU ids Ray gave this actor)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), list(ray.get_gpu_ids())

    def free_port(self) -> int:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, script: str, args: list, driver_node: str, driver_cwd: str, env: dict) -> tuple[int, str]:
        """Run ``script`` as ``__main__``; returns (exit status, the error's text, '' on success)."""
        import runpy
        import traceback

        import ray

        os.environ.update(env)
        if ray.get_runtime_context().get_node_id() == driver_node and os.path.isdir(driver_cwd):
            os.chdir(driver_cwd)
        path = os.path.abspath(script)
        if not os.path.isfile(path):
            return 2, (f"no script {path} on node {ray.util.get_node_ip_address()}: the script must exist at that "
                       "path on every node a rank runs on (copy it there, or submit with `ray job submit "
                       "--working-dir DIR` and give its path relative to DIR)\n")
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(path))  # as `python script.py` does
        status, error = EXIT_OK, ""
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            if e.code is None or e.code == 0:
                status = EXIT_OK
            elif isinstance(e.code, int):
                status, error = e.code, f"SystemExit: {e.code}\n"
            else:
                status, error = 1, f"SystemExit: {e.code}\n"
        except BaseException:
            status, error = 1, traceback.format_exc()
            print(error, file=sys.stderr, end="")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return status, error


def _connect(address: str | None) -> bool:
    """Join the cluster this process is connected to, the one at ``address`` (or ``RAY_ADDRESS``), or start a
    local one; returns whether this call connected (and so should disconnect at the end)."""
    import ray

    if ray.is_initialized():
        return False
    import logging

    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = notice.level
    notice.setLevel(logging.ERROR)  # "token authentication is enabled ...", on every local start
    try:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or None, log_to_driver=True,
                 logging_level=logging.WARNING)
    finally:
        notice.setLevel(level)
    return True


def _too_small(workers: int, bundle: dict, when: str) -> str:
    import ray

    total = ray.cluster_resources()
    return (f"the Ray cluster cannot place {workers} ranks of {bundle} {when} (it has {total.get('CPU', 0):g} CPUs, "
            f"{total.get('GPU', 0):g} GPUs in all): use fewer --workers or a larger cluster")


def _check_size(workers: int, bundle: dict) -> None:
    """A local cluster this process started cannot grow: refuse at once what it cannot hold."""
    import ray

    from rayzero.train.agent import started_here

    total = ray.cluster_resources()
    if started_here() and any(total.get(k, 0) < v * workers for k, v in bundle.items()):
        raise RuntimeError(_too_small(workers, bundle, "now, nor later: this process started it, as a local "
                                      "cluster that cannot grow"))


def _rank_layout(bundle_nodes: dict, workers: int) -> list[tuple[int, str]]:
    """[(bundle index, node id)] in rank order: the bundles of a node consecutive, nodes in the order their
    first bundle comes."""
    order: list[str] = []
    for b in range(workers):
        if bundle_nodes[b] not in order:
            order.append(bundle_nodes[b])
    return [(b, node) for node in order for b in range(workers) if bundle_nodes[b] == node]


def launch(script: str, args: list[str] | tuple = (), workers: int = 2, address: str | None = None,
           env: dict | None = None, gpus_per_worker: float = 0, start_timeout_s: float = 60.0) -> int:
    """Run ``script`` (a path) with ``args`` on ``workers`` ranks of the Ray cluster at ``address`` (default:
    the connected one, else ``RAY_ADDRESS``, else a local cluster started here); ``env`` is set in every rank
    before the script starts (Ray's workers do not inherit the driver's environment).  With
    ``gpus_per_worker``, each rank holds that many GPUs and the ranks of a node see all that node's GPUs of
    the run, in ``LOCAL_RANK`` order, as under torchrun.  Returns the exit status (0: every rank ended 0)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if workers < 1:
        raise ValueError(f"--workers must be at least 1, not {workers}")
    env = {str(k): str(v) for k, v in (env or {}).items()}
    connected = _connect(address)
    bundle = {"CPU": 1.0, **({"GPU": float(gpus_per_worker)} if gpus_per_worker else {})}
    try:
        _check_size(workers, bundle)
    except RuntimeError:
        if connected:
            ray.shutdown()
        raise
    pg = placement_group([dict(bundle) for _ in range(workers)], strategy="PACK")
    actors: list = []
    try:
        if not pg.wait(timeout_seconds=start_timeout_s):
            raise RuntimeError(_too_small(workers, bundle, f"within {start_timeout_s:g} s"))
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        layout = _rank_layout(bundle_nodes, workers)
        cls = ray.remote(RankProcess)
        runtime_env = {"env_vars": env} if env else None
        for rank, (b, _) in enumerate(layout):
            actors.append(cls.options(
                num_cpus=1, num_gpus=gpus_per_worker or 0, max_restarts=0, max_task_retries=0,
                runtime_env=runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
            ).remote(rank))
        where = ray.get([a.where.remote() for a in actors])
        port = ray.get(actors[0].free_port.remote())
        per_node: dict[str, list[int]] = {}
        for rank, (node, _, _) in enumerate(where):
            per_node.setdefault(node, []).append(rank)
        nodes = list(per_node)
        rank_env = []
        for rank, (node, _, gpus) in enumerate(where):
            mates = per_node[node]
            e = {"RANK": rank, "WORLD_SIZE": workers, "LOCAL_RANK": mates.index(rank),
                 "LOCAL_WORLD_SIZE": len(mates), "GROUP_RANK": nodes.index(node), "NODE_RANK": nodes.index(node),
                 "MASTER_ADDR": where[0][1], "MASTER_PORT": port}
            if gpus_per_worker:  # the node's ranks' GPUs, each rank's at its LOCAL_RANK
                ids = [str(g) for r in mates for g in where[r][2]]
                e["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(ids))
            rank_env.append({k: str(v) for k, v in e.items()})
        driver_node = ray.get_runtime_context().get_node_id()
        cwd = os.getcwd()
        pending = {a.run.remote(script, list(args), driver_node, cwd, rank_env[r]): r for r, a in enumerate(actors)}
        return _wait(pending)
    except KeyboardInterrupt:
        print("rayzero launch: interrupted: ending every rank", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
        if connected:
            time.sleep(0.5)  # the ranks' last output lines reach the driver
            ray.shutdown()


def _wait(pending: dict) -> int:
    """Wait for the ranks; the first failure ends the wait (the caller kills the rest)."""
    import ray
    from ray.exceptions import RayActorError

    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        rank = pending.pop(done[0])
        try:
            status, error = ray.get(done[0])
        except RayActorError as e:  # the process died under the script (a crash, os._exit, killed)
            status, error = 1, f"its process died: {e}\n"
        if status != EXIT_OK:
            tail = "".join(error.splitlines(keepends=True)[-_TAIL_LINES:])
            others = f"; ending the other {len(pending)} rank(s)" if pending else ""
            print(f"rayzero launch: rank {rank} failed with exit status {status}{others}:\n{tail}", file=sys.stderr,
                  end="" if tail.endswith("\n") else "\n")
            return status
    return EXIT_OK
