"""Host syncs in one optimizer step: a small constant, whatever the layers, buckets or micro-batches.

A host sync is an operation that makes the host wait for the device (tests/sync_count.py lists them).
Each case counts the syncs of one whole optimizer step (every micro-batch's forward and backward, then
``engine.step()``), after a warm-up step, on 2 ranks, for a model and for the same model with twice the
layers (so twice the parameters and buckets) and twice the micro-batches.  The step may read the gradient
norm once (clipping decides on the host); nothing else.  Reading the loss is the training loop's business
and is not in the counted step.

Stages 0-2 run on the ``standin`` device, whose backend refuses host tensors, and count the operations on
its tensors, copies between host and device included.  Stage 3 cannot run there (it resizes storages) and
runs on the CPU-storage stand-in accelerator, counting the scalar reads, ``tolist`` and value-dependent
shapes of every tensor; copies cannot be seen there (everything is on the host).

Dropless MoE (no capacity) has to know each expert's token count on the host: the exchange's uneven
splits and the experts' matmul sizes are host numbers.  It reads them once per MoE layer and forward
(one copy holding this rank's counts and, with expert parallelism, what the peers send it; the backward
reuses them), so its count is ``1 + layers x micro-batches``, asserted as such.  With a capacity factor
the exchange has fixed sizes and reads nothing.
"""

from __future__ import annotations

import sync_cases
from distributed import run_distributed

NORM_READ = "scalar read (.item() / bool() / float() / int()) at rayzero/optim/clip.py"
DISPATCH_READ = "tolist at rayzero/moe/dispatch.py"


def _runs(kind: str, **cfg) -> list[dict]:
    """The same step for a model of 2 layers and 1 micro-batch, and of 4 layers and 2 micro-batches."""
    return [dict(kind=kind, layers=2, config=sync_cases.config(gas=1, **cfg)),
            dict(kind=kind, layers=4, config=sync_cases.config(gas=2, **cfg))]


def _check_constant(results: list[list[dict]], names: list[str], allowed: int = 1) -> None:
    for rank, per_rank in enumerate(results):
        for i, name in enumerate(names):
            small, big = per_rank[2 * i], per_rank[2 * i + 1]
            for r in (small, big):
                where = f"{name}, rank {rank}, syncs:\n{r['summary']}"
                assert r["count"] == allowed, where
                assert r["summary"].startswith(f"1 x {NORM_READ}"), where


def _dense_cases(stages, dtypes, **extra) -> tuple[list[str], list[dict]]:
    names, runs = [], []
    for stage in stages:
        for dtype in dtypes:
            names.append(f"stage {stage} {dtype} {extra or ''}")
            runs += _runs("dense", stage=stage, dtype=dtype, **extra)
    return names, runs


def test_stages_0_to_2_on_the_device_read_only_the_norm():
    """fp32 and bf16 at every stage; fp16 (dynamic loss scaling) and SGD at one stage each."""
    names, runs = _dense_cases((0, 1, 2), ("fp32", "bf16"))
    more_names, more = _dense_cases((2,), ("fp16",))
    names, runs = names + more_names, runs + more
    more_names, more = _dense_cases((1,), ("fp32",), optimizer="SGD")
    names, runs = names + more_names, runs + more
    _check_constant(run_distributed(sync_cases.step_syncs, 2, runs, True, init_pg=False), names)


def test_optimizer_offload_on_the_device_reads_only_the_norm():
    names, runs = _dense_cases((1, 2), ("fp32", "bf16"), offload="cpu")
    _check_constant(run_distributed(sync_cases.step_syncs, 2, runs, True, init_pg=False), names)


def test_stage_3_reads_only_the_norm():
    """On the CPU-storage stand-in: with and without optimizer offload, and with parameter offload."""
    names, runs = _dense_cases((3,), ("fp32", "bf16"))
    more_names, more = _dense_cases((3,), ("fp32",), offload="cpu")
    names, runs = names + more_names, runs + more
    more_names, more = _dense_cases((3,), ("bf16",), offload="cpu", param_offload="cpu")
    names, runs = names + more_names, runs + more
    names.append("stage 3 MoE with capacity")
    runs += _runs("moe_capacity", stage=3)
    _check_constant(run_distributed(sync_cases.step_syncs, 2, runs, False, env={"RAYZERO_SHM": "0"}), names)


def test_moe_with_capacity_reads_only_the_norm():
    """rayzero MoE layers with a capacity factor: fixed-size exchange, without and with EP 2."""
    names = ["MoE capacity stage 2", "MoE capacity EP2 stage 1 bf16"]
    runs = _runs("moe_capacity", stage=2) + _runs("moe_capacity", stage=1, ep=2, dtype="bf16")
    _check_constant(run_distributed(sync_cases.step_syncs, 2, runs, True, init_pg=False), names)


def test_dropless_moe_reads_the_counts_once_per_layer_and_micro_batch():
    """rayzero's MoE without and with EP 2, and Qwen3-MoE under AutoEP 2, in one pair of processes."""
    cases = [("moe", 1), ("moe", 2), ("hf_moe", 2)]
    runs = [run for kind, ep in cases for run in _runs(kind, stage=2, ep=ep)]
    for rank, results in enumerate(run_distributed(sync_cases.step_syncs, 2, runs, True, init_pg=False)):
        for i, (kind, ep) in enumerate(cases):
            for r, run in zip(results[2 * i:2 * i + 2], runs[2 * i:2 * i + 2]):
                reads = run["layers"] * run["config"]["gradient_accumulation_steps"]
                where = f"{kind} ep {ep}, {run['layers']} layers, rank {rank}, syncs:\n{r['summary']}"
                assert r["count"] == 1 + reads, where
                lines = r["summary"].splitlines()
                assert any(line.startswith(f"{reads} x {DISPATCH_READ}") for line in lines), where
                assert any(line.startswith(f"1 x {NORM_READ}") for line in lines), where


def test_the_counter_sees_each_kind_of_sync_and_where():
    (r,) = run_distributed(sync_cases.counter_kinds, 1, init_pg=False)
    kinds = [k for k, _ in r["device"]]
    scalar = "scalar read (.item() / bool() / float() / int())"
    assert kinds == [scalar] * 4 + [
        "tolist", "indexing with a boolean mask", "nonzero", "masked_select", "unique",
        "repeat_interleave with tensor repeats and no output_size", "bincount (its size reads the input's maximum)",
        "blocking copy device->host", "blocking copy host->device",
    ], r["device"]
    # each names the line that made it (the case's own, outside rayzero)
    assert all(where.startswith("sync_cases.py:") and "counter_kinds" in where for _, where in r["device"])
    assert len({where for _, where in r["device"][:4]}) == 1  # the four scalar reads share their line
    assert r["all"] == [scalar, "indexing with a boolean mask", "tolist"]
