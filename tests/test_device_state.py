"""Device-side state on an accelerator other than the CPU, through a stand-in accelerator that computes on
the CPU (tests/device_cases.py): the device's random generator in checkpoints, timers that wait for it."""

from __future__ import annotations

import torch

import device_cases
from distributed import run_distributed


def test_checkpoint_restores_the_device_generator_and_timers_synchronize(tmp_path):
    for r in run_distributed(device_cases.rng_and_timers, 2, str(tmp_path), init_pg=False):
        assert r["accelerator"] == "standin"
        assert not torch.equal(r["moved"], r["saved"])
        assert torch.equal(r["restored"], r["saved"])
        # forward, backward and step each read the clock twice, waiting for the device when it counts
        assert r["syncs"] == {False: 0, True: 6}


def test_off_cpu_set_up_places_the_rank_on_its_device_and_trains_like_the_cpu():
    standin = run_distributed(device_cases.off_cpu_path, 2, True)
    cpu = run_distributed(device_cases.off_cpu_path, 2, False)
    for rank, (s, c) in enumerate(zip(standin, cpu)):
        assert s["set_devices"] == [rank]  # LOCAL_RANK, before the process group
        assert s["norms"] == c["norms"]
        for k, v in c["state"].items():
            assert torch.equal(s["state"][k], v)
