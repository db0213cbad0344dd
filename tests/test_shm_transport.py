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


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("exposed_on", ["all", "rank0"])
def test_inputs_read_in_place_equal_pairwise_bitwise(world, exposed_on):
    results = run_distributed(shm_cases.exposed_collectives, world, exposed_on)
    for r in results:
        assert r["region"]
        for key, (shm, ref) in r["results"].items():
            for a, b in zip(shm, ref):
                assert torch.equal(a, b), key
    chunks = results[0]["chunks"]
    if exposed_on == "all":  # only the all-reduces went through the slots: one chunk each
        assert chunks == [1] * len(chunks)
    else:  # a rank whose inputs are not exposed sends every rank through the slots for those collectives
        assert all(c > 1 for c in chunks)


def test_an_exposed_buffer_is_reused_only_after_every_rank_read_it():
    r0, r1 = run_distributed(shm_cases.exposed_region_reuse, 2)
    for r in (r0, r1):
        assert torch.equal(r["sum"], torch.full((4096,), 3.0))
        assert r["same"] and r["too_big"] is None
    assert r0["waited"] > 0.5  # rank 1 read only after its sleep


def test_a_shared_tensor_is_one_memory_on_every_rank():
    for r in run_distributed(shm_cases.shared_tensor_case, 3):
        assert torch.equal(r["seen"], torch.tensor([10.0] * 3 + [11.0] * 3 + [12.0] * 3))


ENGINE_CASES = [
    (1, "fp32", None), (1, "bf16", None), (2, "fp32", None), (2, "bf16", None),
    # stage 3 shares its weights where that costs no more memory than gathering (here: both dtypes)
    (3, "fp32", None), (3, "bf16", None), (3, "fp32", False), (3, "bf16", False)]


@pytest.fixture(scope="module")
def engine_runs():
    """Every case on both transports in one spawn of 2 ranks (one engine after another, each destroyed)."""
    return run_distributed(shm_cases.on_both_transports, 2, shm_cases.engine_on_one_host, ENGINE_CASES)


@pytest.mark.parametrize("stage,dtype,share", ENGINE_CASES)
def test_an_engine_on_one_host_shares_weights_and_trains_like_gloo(engine_runs, stage, dtype, share):
    shm = [r[("1", (stage, dtype, share))] for r in engine_runs]
    gloo = [r[("0", (stage, dtype, share))] for r in engine_runs]
    assert [r["transport"] for r in shm] == ["ShmTransport"] * 2
    assert [r["transport"] for r in gloo] != ["ShmTransport"] * 2
    # two ranks: every sum has one order, so the transports train bitwise alike
    for a, b in zip(shm, gloo):
        assert a["losses"] == b["losses"]
        for k, v in b["weights"].items():
            assert torch.equal(a["weights"][k], v), k
    assert not any(r["shares"] for r in gloo)
    if stage < 3:
        # one copy of the weights on the host: rank 0's write is what rank 1 reads; destroy() gives each
        # rank its own copy back, and the model still runs
        assert all(r["shares"] for r in shm)
        assert [r["seen_shared"] for r in shm] == [1024.0, 1024.0]
        assert [r["seen_after_destroy"] for r in shm] == [2048.0, 1024.0]
        assert gloo[1]["seen_shared"] != 1024.0  # each gloo rank holds its own copy
        assert all(r["still_trains"] for r in shm)
    elif share is not False:
        # one copy of the weights on the host and nothing to gather; gloo gathers
        assert all(r["shares"] for r in shm)
        assert [r["seen_shared"] for r in shm] == [1024.0, 1024.0]
        assert [r["units"] for r in shm] == [0, 0] and all(r["units"] > 0 for r in gloo)
        assert not any(any(r["sources_exposed"]) for r in shm)  # no gather reads them
        # through the slots: the norm's all-reduce and publishing's two barriers (one-element all-reduces)
        assert all(r["chunks"] == [3, 3, 3] for r in shm), shm[0]["chunks"]
        assert all(r["destroyed_left_stand_ins"] for r in shm + gloo)
    else:
        # every gather (packed ones too: a unit's shards lie side by side in the partition) and every
        # reduce-scatter reads its inputs in place: only the norm's all-reduce goes through the slots
        assert not any(r["shares"] for r in shm) and all(r["units"] > 0 for r in shm)
        assert all(all(r["sources_exposed"]) for r in shm)
        assert all(r["chunks"] == [1, 1, 1] for r in shm), shm[0]["chunks"]
        assert all(r["destroyed_left_stand_ins"] for r in shm + gloo)


SHARE_CASES = [
    (3, "fp32", None, True),  # a rank's shards (1.5 units) fit in the largest unit + two units of prefetch
    (8, "fp32", None, False),  # 4 units' worth of shards: more than gathering holds (3)
    (8, "fp32", 4 * 64 * 64, True),  # a larger prefetch budget holds them
    (8, "bf16", None, True),  # 16-bit: the shared shards replace the gathers' compute-dtype partition
]


@pytest.fixture(scope="module")
def share_runs():
    return run_distributed(shm_cases.on_both_transports, 2, shm_cases.stage3_share_choice,
                           [case[:3] for case in SHARE_CASES])


@pytest.mark.parametrize("layers,dtype,prefetch,shares", SHARE_CASES)
def test_stage3_shares_weights_on_a_host_where_that_costs_no_more_memory(share_runs, layers, dtype, prefetch, shares):
    shm = [r[("1", (layers, dtype, prefetch))] for r in share_runs]
    gloo = [r[("0", (layers, dtype, prefetch))] for r in share_runs]
    assert [r["shares"] for r in shm] == [shares, shares]
    assert [r["units"] for r in shm] == ([0, 0] if shares else [layers, layers])
    assert not any(r["shares"] for r in gloo) and all(r["units"] == layers for r in gloo)
    assert [r["losses"] for r in shm] == [r["losses"] for r in gloo]  # sharing or gathering: bitwise alike


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_masters_alias_the_shared_weights_and_train_like_gloo(stage, tmp_path):
    shm = run_distributed(shm_cases.aliased_masters, 2, stage, str(tmp_path / "shm"), env={"RAYZERO_SHM": "1"})
    gloo = run_distributed(shm_cases.aliased_masters, 2, stage, str(tmp_path / "gloo"), env={"RAYZERO_SHM": "0"})
    # on one host the 512 x 512 weight's partition group holds it alone, and its master is the rank's row of
    # the shared weights; over gloo nothing is shared and the parameters keep one group
    assert all(r["shares"] and r["groups"] > 1 and any(r["aliased"]) for r in shm)
    assert not any(r["shares"] for r in gloo) and [r["groups"] for r in gloo] == [1, 1]
    for a, b in zip(shm, gloo):
        # no clipping, so the norm's summation order (per group) does not reach the weights: bitwise alike,
        # through gradient accumulation, a save, a load and a step after it
        assert a["losses"] == b["losses"]
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-5)
        for k, v in b["weights"].items():
            assert torch.equal(a["weights"][k], v), k
            assert torch.equal(a["loaded_weights"][k], v), k
        # the load wrote the shared weights in place: the model computes what it did at the save
        assert not torch.equal(a["moved_output"], a["saved_output"])
        assert torch.equal(a["loaded_output"], a["saved_output"])
        assert torch.equal(a["loaded_output"], b["loaded_output"])


@pytest.mark.parametrize("exposed_on", ["all", "rank0"])
def test_reduce_scatter_reads_a_rank_own_row_where_it_lies(exposed_on):
    """The reducer hands a one-parameter bucket's own row over where it lies in the gradient instead of
    copying it into the bucket; read in place, through the slots, or copied in by gloo: the same sums."""
    for result in run_distributed(shm_cases.own_row_apart, 2, exposed_on, env={"RAYZERO_SHM": "1"}):
        assert result == {7: (True, True), 20_000: (True, True)}, result
