"""The shared-memory transport (rayzero/comm/shm.py) against the ordered pairwise gloo transport (sums in rank
order), on real ranks."""

from __future__ import annotations

import pytest
import torch

import shm_cases
from distributed import run_distributed
from rayzero.comm.shm import shm_supported

pytestmark = pytest.mark.skipif(not shm_supported(), reason="needs /dev/shm on x86-64")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20], ids=["many-chunks", "one-chunk"])
def test_shm_collectives_equal_pairwise_bitwise(world, chunk_bytes):
    for r in run_distributed(shm_cases.collectives, world, chunk_bytes):
        for key, (shm, ref) in r.items():
            for a, b in zip(shm, ref):
                assert torch.equal(a, b), key


def test_the_segment_leaves_no_name_behind():
    for r in run_distributed(shm_cases.no_segment_left, 2):
        assert r["mapped"] and torch.equal(r["sum"], torch.full((5,), 1.0))
        assert r["during"] == []  # unlinked once every rank had mapped it: nothing to clean up after a crash


def test_a_rank_that_stops_answering_times_out_with_its_name():
    r0, r1 = run_distributed(shm_cases.a_rank_stops_answering, 2)
    assert r1["error"] is None
    assert r0["error"].startswith("shared-memory collective: rank(s) [1] of this group of 2 did not write chunk 2 within 2 s")
    assert 2.0 <= r0["waited"] < 10.0


def test_gloo_groups_pick_shm_on_one_host_and_gloo_when_it_is_disabled():
    kinds = run_distributed(shm_cases.transport_kinds, 2)
    assert kinds[0] == {"auto": "ShmTransport", "ordered": "ShmTransport", "ordered_flag": True}
    off = run_distributed(shm_cases.transport_kinds, 2, env={"RAYZERO_SHM": "0"})
    assert off[0] == {"auto": "PairwiseTransport", "ordered": "OrderedTransport", "ordered_flag": None}


def test_a_dev_shm_too_small_falls_back_to_gloo_on_every_rank():
    for r in run_distributed(shm_cases.too_big_for_dev_shm, 2):
        assert r["shm"] is False and torch.equal(r["sum"], torch.full((4,), 3.0))
