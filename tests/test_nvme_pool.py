"""NVMe optimizer offload: what stays in memory.  The swap pool serves sub-groups it still holds without
reading their files again, and checkpoint saves and loads bring one sub-group into memory at a time
(real gloo processes, real O_DIRECT swap files)."""

from __future__ import annotations

import contextlib

import torch

import rayzero
from distributed import run_distributed
from offload_cases import _train, zero_section
from zero_cases import base_config, batches, make_model

SUB_GROUP = 120  # 5 sub-groups per rank at world 2 (one parameter is larger than a sub-group)
BUFFERS = 12  # 4 slots of 3 tensor buffers (AdamW): fewer slots than sub-groups, a step cannot keep them all


def _config(world: int, device: str, swap_root: str, **zero) -> dict:
    off = {"device": device, "buffer_count": BUFFERS, **({"nvme_path": swap_root} if device == "nvme" else {})}
    section = zero_section(2, sub_group_size=SUB_GROUP, **zero)
    if device != "none":
        section["offload_optimizer"] = off
    return base_config(2, world, 12, zero_optimization=section, deterministic=True)


def _count_resident(engine) -> list[int]:
    """Wrap the swap's checkpoint entry points so that each records how many sub-groups have their master in
    memory while it runs (the real methods run underneath)."""
    swap, peaks = engine.swap, []
    resident = lambda: sum(not swap.swapped_out(gi) for gi in range(len(engine.partitions.groups)))

    def counted(method):
        @contextlib.contextmanager
        def run(*args, **kwargs):
            with method(*args, **kwargs) as value:
                peaks.append(resident())
                yield value
        return run

    swap.group_resident = counted(swap.group_resident)
    swap.loading = counted(swap.loading)
    return peaks


def pool_and_checkpoint_run(rank: int, world: int, device: str, swap_root: str, ckpt: str) -> dict:
    data = batches(6, 12)
    engine = rayzero.initialize(make_model(), _config(world, device, swap_root))
    peaks = _count_resident(engine) if engine.swap is not None else []
    _train(engine, rank, world, data[:3])
    out = {"groups": len(engine.partitions.groups)}
    if engine.swap is not None:
        out["reads_skipped"] = engine.swap.reads_skipped
        out["bytes_read"] = engine.swap.store.stats["bytes_read"]
    engine.save_checkpoint(ckpt, tag="sync")
    engine.save_checkpoint(ckpt, tag="async", async_save=True)
    out["save_peaks"] = list(peaks)
    _train(engine, rank, world, data[3:])
    out["straight"] = engine.full_state_dict()
    engine.destroy()

    for tag in ("sync", "async"):
        engine = rayzero.initialize(make_model(seed=5), _config(world, device, swap_root))
        peaks = _count_resident(engine) if engine.swap is not None else []
        engine.load_checkpoint(ckpt, tag=tag)
        out[f"load_peaks_{tag}"] = list(peaks)
        _train(engine, rank, world, data[3:])
        out[f"resumed_{tag}"] = engine.full_state_dict()
        engine.destroy()
    return out


def test_pool_reuse_and_one_sub_group_at_a_time_checkpoints(tmp_path):
    """Three steps and a save (sync and async), three more; loads of both saves into fresh engines then
    continue bitwise, and everything equals the same run without offload (deterministic policy)."""
    plain = run_distributed(pool_and_checkpoint_run, 2, "none", "", str(tmp_path / "plain"))
    nvme = run_distributed(pool_and_checkpoint_run, 2, "nvme", str(tmp_path / "swap"), str(tmp_path / "ckpt"))
    for rank in range(2):
        p, n = plain[rank], nvme[rank]
        assert n["groups"] == 5
        for key in ("straight", "resumed_sync", "resumed_async"):
            for name in p["straight"]:
                assert torch.equal(n[key][name], p["straight"][name]), (rank, key, name)
                assert torch.equal(p[key][name], p["straight"][name]), (rank, key, name)
        # steps 2 and 3 run in the other order than the step before, and take back what the pool still holds
        assert n["reads_skipped"] >= 2 * 2, n["reads_skipped"]
        partition_bytes = sum(g.numel() for g in p["straight"].values()) * 4 // 2  # fp32, half per rank
        # without reuse: step 1 reads the masters, steps 2 and 3 the masters and two moments each
        assert n["bytes_read"] < partition_bytes * (1 + 3 + 3)
        # the save, the async snapshot and the loads each had exactly one sub-group in memory at a time
        assert n["save_peaks"] and set(n["save_peaks"]) == {1}, n["save_peaks"]
        assert len(n["save_peaks"]) == 3 * 5  # sync save: hash pass and write pass; async snapshot: one pass
        for tag in ("sync", "async"):
            assert n[f"load_peaks_{tag}"] and set(n[f"load_peaks_{tag}"]) == {1}, n[f"load_peaks_{tag}"]
    assert not list((tmp_path / "swap").rglob("*.swap"))


def partial_load_run(rank: int, world: int, device: str, swap_root: str, ckpt: str) -> dict:
    """Save from the plain model with AdamW; load its weights (strict=False) into a model with an extra
    parameter and SGD, so a sub-group is only partly in the checkpoint and the parameter it lacks keeps its
    value; then train two steps."""
    data = batches(4, 12)
    saver = rayzero.initialize(make_model(), _config(world, "none", swap_root))
    _train(saver, rank, world, data[:2])
    saver.save_checkpoint(ckpt, tag="s2")
    saver.destroy()
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}}
    engine = rayzero.initialize(make_model(seed=3, unused=True), {**_config(world, device, swap_root), **sgd})
    engine.load_checkpoint(ckpt, tag="s2", strict=False)
    losses = _train(engine, rank, world, data[2:])
    state = engine.full_state_dict()
    engine.destroy()
    return {"state": state, "losses": losses, "report": engine.load_report}


def test_partial_load_under_nvme_keeps_the_parameters_the_checkpoint_lacks(tmp_path):
    plain = run_distributed(partial_load_run, 2, "none", "", str(tmp_path / "plain"))[0]
    got = run_distributed(partial_load_run, 2, "nvme", str(tmp_path / "swap"), str(tmp_path / "ckpt"))[0]
    assert any("spare" in line for line in plain["report"]) and got["report"] == plain["report"]
    assert got["losses"] == plain["losses"]
    for name in plain["state"]:
        assert torch.equal(got["state"][name], plain["state"][name]), name
    # the parameter the checkpoint lacks kept its own value (it gets no gradient, and SGD has no decay here)
    fresh = make_model(seed=3, unused=True).spare
    assert torch.equal(got["state"]["spare.weight"], fresh.weight.detach())
    assert torch.equal(got["state"]["spare.bias"], fresh.bias.detach())


def amsgrad_turned_on_run(rank: int, world: int, device: str, swap_root: str, ckpt: str) -> dict:
    """Save without amsgrad; load with it turned on (its state starts at zero), save again before any step,
    then train: the new state tensor is swapped like the others."""
    data = batches(4, 12)
    saver = rayzero.initialize(make_model(), _config(world, "none", swap_root))
    _train(saver, rank, world, data[:2])
    saver.save_checkpoint(ckpt, tag="s2")
    saver.destroy()
    amsgrad = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}}}
    engine = rayzero.initialize(make_model(seed=3), {**_config(world, device, swap_root), **amsgrad})
    engine.load_checkpoint(ckpt, tag="s2")
    engine.save_checkpoint(ckpt, tag="again")
    losses = _train(engine, rank, world, data[2:])
    state = engine.full_state_dict()
    engine.destroy()
    return {"state": state, "losses": losses}


def test_a_state_the_config_turns_on_at_load_is_swapped_too(tmp_path):
    plain = run_distributed(amsgrad_turned_on_run, 2, "none", "", str(tmp_path / "plain"))[0]
    got = run_distributed(amsgrad_turned_on_run, 2, "nvme", str(tmp_path / "swap"), str(tmp_path / "ckpt"))[0]
    assert got["losses"] == plain["losses"]
    for name in plain["state"]:
        assert torch.equal(got["state"][name], plain["state"][name]), name
