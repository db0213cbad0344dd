"""rayzero/memory.py, the one memory model: its model-state figures equal the bytes of a real engine's tensors
after a step (stages 0-3, two gloo ranks), its stage-3 gathers and buckets are what the engine uses, and every
consumer (the engine's start-up check, its "auto", rayzero.fit's plan check and the driver's "auto") decides
at the same byte count; and the peak RSS of real ranks (set-up included, glibc as it comes) against it."""

from __future__ import annotations

import os

import pytest
import torch

import memory_cases
from memory_cases import peak_rss_over_baseline
from device_cases import StandInAccelerator
from distributed import run_distributed
from rayzero.config import Config, ConfigError
from rayzero.memory import model_state_bytes, rank_memory

WORLD = 2
KINDS = ("weights", "master", "grads", "optimizer")


def _meta_net() -> torch.nn.Module:
    with torch.device("meta"):
        return memory_cases.Net()


def _many(rank: int, world: int, configs: list[dict]) -> list[dict]:
    return [memory_cases.engine_tensors(rank, world, c) for c in configs]


CASES = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    configs = [memory_cases.config(stage, dtype) for stage, dtype in CASES]
    swap = str(tmp_path_factory.mktemp("swap"))  # parameters and optimizer on NVMe: leaf units, one bucket in flight
    configs.append(memory_cases.config(3, "fp32", offload_optimizer={"device": "nvme", "nvme_path": swap},
                                       offload_param={"device": "nvme", "nvme_path": swap}))
    configs.append(memory_cases.config(3, "fp32", stage3_prefetch_bucket_size=1000))  # a smaller budget
    configs.append(memory_cases.config(2, "fp32", reduce_bucket_size=2000, allgather_bucket_size=3000))
    ranks = run_distributed(_many, WORLD, configs, env={"RAYZERO_SHM": "0"})
    return {"configs": configs, "ranks": ranks}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{s}-{d}" for s, d in CASES])
def test_model_states_equal_the_engines_tensors(measured, index):
    """weights, fp32 master, fp32 gradients (stage 1: + its whole local buffer) and AdamW's moments, as
    summed over the engine's tensors after a step (each storage once: stage 0's fp32 parameters are views
    of the master), equal rank_memory's figures byte for byte (the model pads nothing at world 2)."""
    cfg = Config.from_any(measured["configs"][index])
    model = rank_memory(_meta_net(), cfg, WORLD)
    for rank, real in enumerate(measured["ranks"]):
        got = {k: real[index][k] for k in KINDS}
        assert got == {k: getattr(model, k) for k in KINDS}, (CASES[index], rank)
    assert model.model_states() == model_state_bytes(_meta_net(), cfg, WORLD)[0]  # fit's count is the same


def test_buckets_are_the_engines(measured):
    """Derived bucket sizes (the config leaves them out) are the engine's, taken from the same rule; the
    reduce buckets in flight are the engine's largest bucket, max_inflight + 1 times (one in flight with
    parameters on NVMe); stages 1-2 add two
    all-gather buckets.  Sizes written in the config are used as they are."""
    for index, c in enumerate(measured["configs"]):
        cfg = Config.from_any(c)
        model = rank_memory(_meta_net(), cfg, WORLD)
        real = measured["ranks"][0][index]
        assert (model.reduce_bucket_size, model.allgather_bucket_size) == (
            real["reduce_bucket_size"], real["allgather_bucket_size"]), c
        stage = cfg.zero_optimization.stage
        reduce = (real["max_inflight"] + 1) * real["largest_reduce_bucket"] * 4 if stage >= 2 else 0
        total = sum(p.numel() for p in _meta_net().parameters())
        w = 2 if cfg.compute_dtype != torch.float32 else 4
        publish = 2 * min(real["allgather_bucket_size"], total) * w if stage in (1, 2) else 0
        assert model.buckets == reduce + publish, c
    assert measured["ranks"][0][-1]["reduce_bucket_size"] == 2000  # the config's own
    nvme = measured["ranks"][0][len(CASES)]
    assert nvme["max_inflight"] == 1 and measured["ranks"][0][0]["max_inflight"] == 2


def test_stage3_gathers_are_the_engines(measured):
    """Stage 3's units and prefetch budget are the ParamGatherer's; the gathered bytes the engine held at
    once over the step never exceed rank_memory's ``gathered`` (the running unit + the budget, or one unit
    when one is larger), and reach at least two units (the prefetch ran)."""
    for index, c in enumerate(measured["configs"]):
        cfg = Config.from_any(c)
        if cfg.zero_optimization.stage != 3:
            continue
        model = rank_memory(_meta_net(), cfg, WORLD)
        w = 2 if cfg.compute_dtype != torch.float32 else 4
        for per_rank in measured["ranks"]:
            real = per_rank[index]
            units = real["units"]
            if cfg.zero_optimization.offload_param.device == "nvme":  # leaf units: inp, out, each up and down
                assert len(units) == 10 and units.count(max(units)) == 4
            else:
                assert len(units) == 6 and units.count(max(units)) == 4  # inp, out and the four blocks
            assert model.gathered == (max(units) + max(real["prefetch_elements"], max(units))) * w, c
            assert 2 * max(units) * w <= real["gathered_peak"] <= model.gathered, (c, real["gathered_peak"])
    budget = measured["ranks"][0][-2]
    assert budget["prefetch_elements"] == 1000
    assert rank_memory(_meta_net(), Config.from_any(measured["configs"][-2]), WORLD).gathered == \
        2 * max(budget["units"]) * 4  # a budget smaller than a unit still gathers the next one


def test_totals_add_up():
    cfg = Config.from_any(memory_cases.config(3, "bf16"))
    m = rank_memory(_meta_net(), cfg, WORLD, activations=1234)
    assert m.transient() == m.gathered + m.buckets + m.grads_in_flight + 1234
    assert m.total() == m.model_states() + m.swap_pool + m.transient()
    assert m.device == "cpu" and m.swap_pool == 0 and m.host_shared == m.transport == 0
    assert m.charged() == m.total()
    # ranks of one host sharing memory: bf16 stage 3 keeps one copy of the weights per host and gathers nothing
    shared = rank_memory(_meta_net(), cfg, WORLD, activations=1234, local_ranks=WORLD)
    managed = sum(p.numel() for p in _meta_net().parameters() if p.numel() > 20)  # over the persistence threshold
    assert shared.host_shared == 2 * managed and shared.gathered == 0 and shared.transport > 0
    assert shared.total() == shared.model_states() + shared.transient() + shared.host_shared + shared.transport
    assert shared.charged() == shared.total() - (shared.host_shared + shared.transport) // 2


@pytest.mark.parametrize("stage", [2, 3])
def test_the_consumers_decide_at_the_same_bytes(stage):
    """The same config and model on one accelerator rank whose free memory is exactly rank_memory's model
    states B: the engine's start-up check passes, its "auto" keeps the optimizer, rayzero.fit's plan check
    passes and the driver's "auto" keeps it too; at B - 1 every one of them says it does not fit."""
    from rayzero.offload.optimizer import check_model_states_fit, resolve_offload_device
    from rayzero.train.cluster_config import ClusterConfig
    from rayzero.train.offload_check import resolve_auto
    from rayzero.train.state_memory import _check_fits

    torch.manual_seed(0)
    net = memory_cases.Net()
    params = list(net.parameters())
    raw = memory_cases.config(stage)
    need = rank_memory(net, Config.from_any(raw), 1, device="standin").model_states()
    one = ClusterConfig.from_any({"workers": 1})

    def nodes(free):
        return [{"hostname": "g0", "memory_total": free, "devices": 1, "accelerator": "cuda",
                 "memory_source": "device memory", "host_memory_total": 1 << 40}]

    def auto_cfg():
        return Config.from_any({**raw, "zero_optimization": {**raw["zero_optimization"],
                                                             "offload_optimizer": {"device": "auto"}}})

    acc = StandInAccelerator()
    for free, fits in ((need, True), (need - 1, False)):
        acc.free_memory = free
        cfg = Config.from_any(raw)
        if fits:
            check_model_states_fit(cfg, params, lambda p: 1, stage, "standin", "none", 0, accelerator=acc)
            _check_fits(net, cfg, one, nodes(free))
        else:
            with pytest.raises(ConfigError, match="device memory"):
                check_model_states_fit(cfg, params, lambda p: 1, stage, "standin", "none", 0, accelerator=acc)
            with pytest.raises(ConfigError, match="cannot fit"):
                _check_fits(net, cfg, one, nodes(free))
        expected = "none" if fits else "cpu"
        assert resolve_offload_device(auto_cfg(), params, stage, lambda p: 1, acc) == expected
        driver = auto_cfg()
        resolve_auto(net, driver, one, nodes(free))
        assert driver.zero_optimization.offload_optimizer.device == expected


def test_nvme_counts_the_swap_pool_once():
    """With the optimizer on NVMe the plan check counts the model states left in memory plus the swap pool,
    which rank_memory keeps apart (``swap_pool``)."""
    raw = memory_cases.config(3)
    raw["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 4}
    cfg = Config.from_any(raw)
    m = rank_memory(_meta_net(), cfg, WORLD)
    assert m.master == 0 and m.optimizer == 0 and m.swap_pool > 0
    assert model_state_bytes(_meta_net(), cfg, WORLD)[0] == m.model_states() + m.swap_pool


# ---- measured: the process's peak RSS, as a user's process has it ----------------------------------------
DIM, HIDDEN, BLOCKS = 512, 2048, 4  # 8.4M parameters: 64 MiB of fp32 weights, 4 gather units


_PLAIN: list = []  # the plain run's ranks, shared by the tests that read it (one spawn)


def _ranks(zero: dict) -> list[dict]:
    if not zero and _PLAIN:
        return _PLAIN[0]
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "RAYZERO_KEEP_FREED_MEMORY"):
        os.environ.pop(k, None)
    out = run_distributed(peak_rss_over_baseline, 2, zero, DIM, HIDDEN, BLOCKS, 5)
    if not zero:
        _PLAIN.append(out)
    return out


def _peaks(zero: dict) -> tuple[float, str | None]:
    out = _ranks(zero)
    return max(r["peak_mib"] for r in out), out[0]["policy"]


def test_peak_rss_follows_the_memory_model():
    """ZeRO-3 with the config's defaults on 2 ranks of one host: the peak RSS over the warm baseline, set-up
    included, is within 1.40x of what rank_memory says the rank maps (and not far below it: the model counts
    nothing the rank does not hold)."""
    from rayzero.config import Config

    peak, policy = _peaks({})
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(),
                                                          torch.nn.Linear(HIDDEN, DIM)) for _ in range(BLOCKS)])
    cfg = Config.from_any({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                           "zero_optimization": {"stage": 3}})
    model_mib = rank_memory(model, cfg, 2, local_ranks=2).total() / 2**20
    assert policy == "keep"
    # bench/bench_zero.py --memory holds the bench model (33.6M parameters) to 1.25x; on a model this small the
    # process's own bookkeeping and the allocator's slack (~20-40 MiB) weigh more, and what glibc keeps of the
    # freed step buffers moves with the order it reuses them in: against a model of 152 MiB this peak measured
    # 187-196 MiB in isolated runs and 205.5 MiB once in a full suite (1.35x), so the bound is 1.40x; a
    # caching host allocator of rayzero's own is what would take that slack out (issue 27)
    assert 0.8 * model_mib <= peak <= 1.40 * model_mib, (peak, model_mib)


def test_what_set_up_freed_is_not_resident_after_it():
    """Under the keep policy (ZeRO-3, config defaults, CPU) what set-up freed leaves the process at its end:
    zero_init's full-size weights, made whole by each module before it is sharded, and its shards once
    copied into the masters.  The anonymous memory set-up added is then what malloc still has handed out
    (its live blocks and mappings), within 4 MiB; before, the freed blocks stayed resident under the keep
    policy's 2 GiB trim threshold: 58-62 MiB of anonymous memory against 32.2 MiB handed out on this model
    (rayzero/accelerator/host_allocator.end_of_set_up; issue 27)."""
    for r in _ranks({}):
        assert r["policy"] == "keep"
        assert r["setup"]["anon_mib"] <= r["setup"]["held_mib"] + 4, r["setup"]


def test_the_steps_reuse_the_heap_they_freed():
    """Under the keep policy the weight gradients of one step take the heap blocks the previous step freed:
    glibc's free heap does not grow from step to step.  Before the gradients came from rayzero's own
    buffers (zero/grad_pool.py) each step's gradients took fresh heap beside the holes the previous ones
    left, for the first steps, and the holes stayed resident (bench/README.md "Where the excess over the
    model is"; issue 27)."""
    for r in _ranks({}):
        assert r["policy"] == "keep"
        free = r["heap_free_mib"]
        assert max(free[1:]) <= free[0] + 1, free


def test_nvme_offload_holds_less_than_no_offload(tmp_path):
    """Optimizer and parameters on NVMe: the rank's peak RSS (set-up included) is well below the same model's
    without offload, not above it (freed memory given back under offload, no shard held twice, pools sized
    to what is in flight, gradients and zero_init shards in the swap files): at most issue 27's 0.6x.
    Measured 0.50-0.52x; 0.58x before the gradients and the shards went to the swap files (whose own test,
    tests/test_nvme_gradients.py, looks where they are), 1.28x before issue 27."""
    plain, _ = _peaks({})
    swap = str(tmp_path / "swap")
    nvme, policy = _peaks({"offload_optimizer": {"device": "nvme", "nvme_path": swap},
                           "offload_param": {"device": "nvme", "nvme_path": swap}})
    assert policy == "release"
    assert nvme <= 0.6 * plain, (nvme, plain)
