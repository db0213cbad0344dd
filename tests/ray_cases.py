"""Data, model and loops shared by the Ray tests and their plain multi-process references."""

from __future__ import annotations

import os
import signal

import torch
import torch.nn.functional as F

# what a Ray worker of the tests puts first on its path: this checkout's rayzero (not whichever one the venv
# installed in editable mode), then the test helpers the workers import
_TESTS = os.path.dirname(os.path.abspath(__file__))
WORKER_PYTHONPATH = os.pathsep.join([os.path.dirname(_TESTS), _TESTS])

IN, OUT = 7, 5


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int = 96):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, IN, generator=g)
        self.y = torch.randn(n, OUT, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def model_factory():
    return torch.nn.Sequential(torch.nn.Linear(IN, 13), torch.nn.Tanh(), torch.nn.Linear(13, OUT))


class MoERegression(torch.nn.Module):
    """The regression task through a rayzero.moe.MoE layer, for the expert-parallel Ray tests."""

    def __init__(self):
        super().__init__()
        from rayzero.moe import MoE

        self.inp = torch.nn.Linear(IN, 16)
        self.moe = MoE(16, 24, num_experts=4, top_k=2, aux_loss_coef=0.0)
        self.out = torch.nn.Linear(16, OUT)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))


def moe_factory():
    return MoERegression()


def mse(out, batch):
    return F.mse_loss(out.float(), batch[1])


CONFIG = {
    "train_batch_size": 12,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 40},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "gradient_clipping": 1.0,
}
MOE_CONFIG = {**CONFIG, "expert_parallel": {"enabled": True, "autoep_size": 2}}


def plain_run(rank, world, steps, micro):
    """The same training as rayzero.fit, by the engine alone on a gloo group: the reference."""
    import torch.distributed as dist

    import rayzero
    from rayzero.train.data import GlobalOrder, micro_batches

    data = Regression()
    torch.manual_seed(0)
    engine = rayzero.initialize(model_factory(), {**CONFIG, "train_micro_batch_size_per_gpu": micro})
    order = GlobalOrder(len(data), seed=0)
    losses = []
    for step in range(steps):
        total = torch.zeros(1)
        acc = CONFIG["train_batch_size"] // (world * micro)
        for ids in micro_batches(order, step, CONFIG["train_batch_size"], world, rank, micro):
            batch = torch.utils.data.default_collate([data[i] for i in ids])
            loss = mse(engine(batch[0]), batch)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / acc
        dist.all_reduce(total)
        losses.append(total.item() / world)
    engine.destroy()
    return losses


def cpu_fit(rank: int, world: int, cases: list[dict], steps: int, out_dir: str) -> list[list[float]]:
    """What ``rayzero.fit`` trains on the CPU, without Ray: for each case (its ``config``, ``name``), the
    worker's own steps (``rayzero.train.worker.run_step``) over the same samples (the seeded global order,
    cut by ``micro_batches``), the model built as the worker builds it (``zero_init`` at stage 3, else
    seeded), the losses read as the worker reads them, and a checkpoint at the end under ``out_dir/name``.
    tests/test_ray_fit.py checks it against ``rayzero.fit`` bit for bit; other Ray tests take it as their
    reference run (one pair of processes for every case, instead of a Ray fit each)."""
    import rayzero
    from rayzero.train.data import GlobalOrder, micro_batches
    from rayzero.train.planning import plan_step
    from rayzero.train.worker import WorkerSpec, run_step

    data = Regression()
    per_case = []
    for case in cases:
        config = case["config"]
        micro = config.get("train_micro_batch_size_per_gpu")  # as fit's driver offers the sizes up to it
        plan = plan_step(config["train_batch_size"], world, list(range(1, micro + 1)) if micro else None,
                         micro_batch=micro)
        if config.get("zero_optimization", {}).get("stage") == 3:  # as fit's workers build a model from its factory
            with rayzero.zero_init(seed=0):
                model = model_factory()
        else:
            torch.manual_seed(0)
            model = model_factory()
        engine = rayzero.initialize(model, {**config, **plan.config_overrides()})
        spec = WorkerSpec(model=None, config={}, global_batch=plan.global_batch, max_steps=steps, loss_fn=mse)
        order = GlobalOrder(len(data), 0, True)
        losses = []
        for step in range(steps):
            ids = micro_batches(order, step, plan.global_batch, world, rank, plan.micro_batch)
            batches = (torch.utils.data.default_collate([data[i] for i in m]) for m in ids)
            loss = engine.comm.sum_scalar(run_step(engine, spec, batches, plan.accumulation))
            losses.append(loss.item() / world)
        engine.save_checkpoint(os.path.join(out_dir, case["name"]), tag=f"checkpoint_step{steps:08d}")
        engine.destroy()
        per_case.append(losses)
    return per_case


class KillOnce:
    """A train_step that SIGKILLs one rank's process at one step, only on the first attempt."""

    def __init__(self, marker: str, rank: int, step: int, delay_s: float = 0.0):
        self.marker, self.rank, self.step, self.delay_s = marker, rank, step, delay_s

    def __call__(self, engine, batch):
        import time

        import ray.train

        if (
            engine.global_steps == self.step
            and ray.train.get_context().get_world_rank() == self.rank
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.delay_s:
            time.sleep(self.delay_s)
        loss = mse(engine(batch[0]), batch)
        engine.backward(loss)
        engine.step()
        return loss


def final_samples(samples_file: str) -> dict[int, list[int]]:
    """Per step, the sample ids of the attempt that counted (a restarted step's later records win)."""
    import json

    per_step: dict[int, dict[int, list[int]]] = {}
    worlds: dict[int, int] = {}
    with open(samples_file) as f:
        for line in f:
            r = json.loads(line)
            if worlds.get(r["step"]) != r["world_size"]:
                per_step[r["step"]] = {}
                worlds[r["step"]] = r["world_size"]
            # the ranks of one TP group read the same samples: count each data shard once, and check it
            shard = r.get("dp_rank", r["rank"])
            seen = per_step[r["step"]].get(shard)
            assert seen is None or seen == r["ids"], f"step {r['step']}: ranks of data shard {shard} read different samples"
            per_step[r["step"]][shard] = r["ids"]
    return {s: sorted(i for ids in ranks.values() for i in ids) for s, ranks in per_step.items()}


def expected_samples(steps: int, global_batch: int, length: int, seed: int = 0) -> dict[int, list[int]]:
    from rayzero.train.data import GlobalOrder

    order = GlobalOrder(length, seed)
    return {s: sorted(order.step_indices(s, global_batch)) for s in range(steps)}


def stop_head(head, root: str, wait_s: float) -> None:
    """Stop a Ray head a test started with ``subprocess.Popen(..., start_new_session=True)``: SIGTERM, up to
    ``wait_s`` to exit, then SIGKILL whatever of its process group is left; remove its directory."""
    import shutil
    import subprocess

    head.send_signal(signal.SIGTERM)
    try:
        head.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)  # anything of this head's group still alive
    except ProcessLookupError:
        pass
    shutil.rmtree(root, ignore_errors=True)



def tune_stream(rank, world, micro):
    """Endless regression micro-batches for the ``rayzero tune`` tests; micro-batch 3 is refused, so a trial
    that uses it fails the way a user's trial can."""
    if micro == 3:
        raise ValueError("micro-batch 3 is refused by this data factory")
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randn(micro, IN, generator=g), torch.randn(micro, OUT, generator=g)
