"""bench/bench_cap.py's DeepSpeed configs: what each row hands DeepSpeed (DeepSpeed itself is not installed in CI)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_cap import BLOCK_PARAMS, LARGEST_PARAM, deepspeed_zero_config  # noqa: E402


def test_block_sizes_match_the_bench_model():
    block = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    numels = [p.numel() for p in block.parameters()]
    assert sum(numels) == BLOCK_PARAMS == 8_393_728
    assert max(numels) == LARGEST_PARAM == 4_194_304


def test_plain_rows_keep_deepspeed_defaults():
    assert deepspeed_zero_config("none", "/swap") == ({"stage": 3}, None)
    assert deepspeed_zero_config("cpu", "/swap") == (
        {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "cpu")
    assert deepspeed_zero_config("nvme", "/swap") == (
        {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"},
         "offload_param": {"device": "nvme", "nvme_path": "/swap"}}, "nvme")


def test_sized_rows_set_buffers_for_the_model():
    assert deepspeed_zero_config("cpu-sized", "/swap") == (
        {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
         "sub_group_size": 4_194_304}, "cpu")
    assert deepspeed_zero_config("nvme-sized", "/swap") == (
        {"stage": 3, "sub_group_size": 4_194_304,
         "offload_optimizer": {"device": "nvme", "nvme_path": "/swap", "buffer_count": 4},
         "offload_param": {"device": "nvme", "nvme_path": "/swap", "buffer_size": 4_194_304, "buffer_count": 4}},
        "nvme")


@pytest.mark.parametrize("name", ["nvme-big", "disk", "cpu-"])
def test_unknown_config_is_refused(name):
    with pytest.raises(ValueError, match="unknown DeepSpeed config"):
        deepspeed_zero_config(name, "/swap")
