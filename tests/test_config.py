"""Config parsing, batch arithmetic, optimizer factory and warmup schedulers."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from rayzero.config import (
    BatchPlan,
    BF16Config,
    Config,
    ConfigError,
    FP16Config,
    NotSupportedYetError,
    OptimizerConfig,
    ZeroConfig,
)
from rayzero.optim.factory import build_optimizer


# --- batch arithmetic ---------------------------------------------------------------------------------


def _plan(world: int, **keys) -> BatchPlan:
    return Config.from_any(keys).resolve_batch(world)


@pytest.mark.parametrize(
    "keys, world, expected",
    [
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 4, (32, 4, 2)),
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 2, (32, 4, 4)),
        (dict(train_batch_size=32, gradient_accumulation_steps=2), 4, (32, 4, 2)),
        (dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=5), 2, (30, 3, 5)),
        (dict(train_batch_size=24), 3, (24, 8, 1)),
        (dict(train_micro_batch_size_per_gpu=6), 4, (24, 6, 1)),
        (dict(gradient_accumulation_steps=7), 2, (14, 1, 7)),
        (dict(), 5, (5, 1, 1)),
    ],
)
def test_batch_derivations(keys, world, expected):
    plan = _plan(world, **keys)
    assert (plan.train_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps) == expected
    assert plan.world_size == world
    assert plan.train_batch_size == plan.micro_batch_size * plan.gradient_accumulation_steps * world


def test_batch_plan_is_frozen():
    plan = _plan(2, train_batch_size=4)
    with pytest.raises(Exception):
        plan.world_size = 3  # type: ignore[misc]


def test_batch_mismatch_shows_arithmetic():
    cfg = Config.from_any(
        dict(train_batch_size=32, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=4)
    )
    with pytest.raises(ConfigError) as err:
        cfg.resolve_batch(2)
    msg = str(err.value)
    assert ("train_batch_size 32 != train_micro_batch_size_per_gpu 3 * gradient_accumulation_steps 4 * "
            "world_size 2 = 24") in msg
    assert "set train_batch_size to 24" in msg


@pytest.mark.parametrize(
    "keys, world, fragments",
    [
        (dict(train_batch_size=30, train_micro_batch_size_per_gpu=4), 2,
         ["train_micro_batch_size_per_gpu 4 * world_size 2 = 8", "30 / 8 = 3.75", "multiple of 8"]),
        (dict(train_batch_size=30, gradient_accumulation_steps=4), 2,
         ["gradient_accumulation_steps 4 * world_size 2 = 8", "30 / 8"]),
        (dict(train_batch_size=10), 4, ["train_batch_size 10 is not divisible by world_size 4 = 4", "10 / 4 = 2.5"]),
        (dict(train_batch_size=2, train_micro_batch_size_per_gpu=4), 1, ["= 4", "2 / 4 = 0.5"]),
    ],
)
def test_batch_non_divisible_shows_arithmetic(keys, world, fragments):
    with pytest.raises(ConfigError) as err:
        _plan(world, **keys)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("world", [0, -1, 1.5, True])
def test_batch_bad_world_size(world):
    with pytest.raises(ConfigError, match="world_size"):
        Config().resolve_batch(world)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
def test_batch_keys_positive(key):
    with pytest.raises(ConfigError, match=key):
        Config.from_any({key: 0})


# --- keys: unknown, not supported, types, ranges ------------------------------------------------------


def test_unknown_top_level_key_suggests():
    with pytest.raises(ConfigError) as err:
        Config.from_any({"train_batch_sise": 8})
    assert not isinstance(err.value, NotSupportedYetError)
    assert "unknown config key 'train_batch_sise'; did you mean 'train_batch_size'?" in str(err.value)


def test_unknown_nested_key_suggests_with_dotted_path():
    with pytest.raises(ConfigError) as err:
        Config.from_any({"zero_optimization": {"stage3_prefech_bucket_size": 5}})
    assert str(err.value) == (
        "unknown config key 'zero_optimization.stage3_prefech_bucket_size'; "
        "did you mean 'stage3_prefetch_bucket_size'?"
    )
    with pytest.raises(ConfigError, match=r"'fp16\.loss_scale_windw'; did you mean 'loss_scale_window'"):
        Config.from_any({"fp16": {"loss_scale_windw": 10}})
    with pytest.raises(ConfigError, match=r"'optimizer\.params\.betaz'; did you mean 'betas'"):
        Config.from_any({"optimizer": {"type": "AdamW", "params": {"betaz": [0.9, 0.99]}}})
    with pytest.raises(ConfigError, match=r"'scheduler\.params\.warmup_num_step'; did you mean 'warmup_num_steps'"):
        Config.from_any({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})


def test_unknown_key_without_close_match_lists_known():
    with pytest.raises(ConfigError, match="unknown config key 'bf16.zzz'; known keys here: enabled"):
        Config.from_any({"bf16": {"zzz": 1}})


@pytest.mark.parametrize(
    "cfg, path",
    [
        ({"moe": {"enabled": True}}, "moe"),
        ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing.partition_activations"),
        ({"comet": {"enabled": True}}, "comet"),
        ({"sparse_gradients": True}, "sparse_gradients"),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
         "zero_optimization.offload_optimizer.ratio"),
        ({"aio": {"use_gds": True}}, "aio.use_gds"),
        ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
        ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
        ({"zero_optimization": {"mics_shard_size": 4}}, "zero_optimization.mics_shard_size"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
        ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "optimizer.params.bias_correction"),
    ],
)
def test_not_supported_yet(cfg, path):
    with pytest.raises(NotSupportedYetError) as err:
        Config.from_any(cfg)
    assert f"'{path}'" in str(err.value)
    assert "not supported yet" in str(err.value)


def test_fixed_zero_keys():
    cfg = Config.from_any({"zero_optimization": {"stage": 2, "reduce_scatter": True, "allgather_partitions": True}})
    assert cfg.zero_optimization.stage == 2
    for key in ("reduce_scatter", "allgather_partitions"):
        with pytest.raises(ConfigError, match=rf"'zero_optimization\.{key}' = False is not supported: rayzero always"):
            Config.from_any({"zero_optimization": {key: False}})


@pytest.mark.parametrize(
    "cfg, fragments",
    [
        ({"train_batch_size": "32"}, ["'train_batch_size'", "'32'", "str", "an integer"]),
        ({"train_batch_size": 3.5}, ["'train_batch_size'", "3.5", "an integer"]),
        ({"train_batch_size": True}, ["'train_batch_size'", "True", "an integer"]),
        ({"train_batch_size": "auto"}, ["Hugging Face"]),
        ({"gradient_clipping": "1.0"}, ["'gradient_clipping'", "a number"]),
        ({"zero_optimization": {"overlap_comm": 1}}, ["'zero_optimization.overlap_comm'", "a boolean"]),
        ({"zero_optimization": 2}, ["'zero_optimization'", "a mapping"]),
        ({"fp16": {"enabled": "yes"}}, ["'fp16.enabled'", "'yes'", "a boolean"]),
        ({"optimizer": {"type": "AdamW", "params": "lr=1"}}, ["'optimizer.params'", "a mapping"]),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, ["'optimizer.params.lr'", "a finite number"]),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, ["'optimizer.params.betas'", "two numbers"]),
        ({"communication_data_type": 16}, ["'communication_data_type'", "a string"]),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}},
         ["'scheduler.params.warmup_num_steps'", "integer"]),
    ],
)
def test_wrong_types(cfg, fragments):
    with pytest.raises(ConfigError) as err:
        Config.from_any(cfg)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    "cfg, key",
    [
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"allgather_bucket_size": -1}}, "zero_optimization.allgather_bucket_size"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"nonfinite_grad": "ignore"}, "nonfinite_grad"),
        ({"communication_data_type": "fp8"}, "communication_data_type"),
        ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window"),
        ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale"),
        ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis"),
        ({"fp16": {"loss_scale": -2}}, "fp16.loss_scale"),
        ({"seed": -1}, "seed"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, "scheduler.params.warmup_type"),
        ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}}},
         "scheduler.params.cos_min_ratio"),
    ],
)
def test_ranges(cfg, key):
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        Config.from_any(cfg)


def test_sizes_accept_float_notation_and_aliases():
    cfg = Config.from_any({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "prefetch_bucket_size": 2e7,
                                                 "stage3_param_persistence_threshold": 1e4}})
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 500_000_000 and isinstance(zero.reduce_bucket_size, int)
    assert zero.stage3_prefetch_bucket_size == 20_000_000
    assert zero.stage3_param_persistence_threshold == 10_000
    with pytest.raises(ConfigError, match="set the same option"):
        Config.from_any({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})


def test_defaults():
    cfg = Config()
    assert cfg.zero_optimization == ZeroConfig()
    assert cfg.zero_optimization.reduce_bucket_size is None  # derived at start-up (zero/buckets.py)
    assert cfg.zero_optimization.allgather_bucket_size is None
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.compute_dtype == torch.float32 and cfg.comm_dtype == torch.float32
    assert (cfg.seed, cfg.nonfinite_grad, cfg.steps_per_print, cfg.gradient_clipping) == (1234, "error", 10, 0.0)
    assert FP16Config() == FP16Config(False, 0.0, 16, 1000, 2, False, 1.0)


def test_scheduler_type_required():
    with pytest.raises(ConfigError, match="'scheduler.type' is required"):
        Config.from_any({"scheduler": {"params": {}}})


def test_dtypes_and_precision_conflict():
    assert Config.from_any({"fp16": {"enabled": True}}).compute_dtype == torch.float16
    assert Config.from_any({"bf16": {"enabled": True}}).compute_dtype == torch.bfloat16
    assert Config.from_any({"bfloat16": {"enabled": True}}).compute_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="both 'fp16.enabled' and 'bf16.enabled'"):
        Config.from_any({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="pick one"):
        Config(fp16=FP16Config(enabled=True), bf16=BF16Config(enabled=True))
    for name, dtype in [("fp32", torch.float32), ("float32", torch.float32), ("fp16", torch.float16),
                        ("float16", torch.float16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)]:
        cfg = Config.from_any({"communication_data_type": name})
        assert cfg.comm_dtype == dtype
        assert cfg.communication_data_type in ("fp32", "fp16", "bf16")


def test_python_construction_is_checked_too():
    assert Config(zero_optimization={"stage": 2.0}).zero_optimization.stage == 2  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'zero_optimization.stage'"):
        ZeroConfig(stage="2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'optimizer.type'"):
        OptimizerConfig(type="Adamax")


# --- files and round trip -----------------------------------------------------------------------------

_DS_CONFIG = {
    "train_batch_size": 64,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 5e7, "contiguous_gradients": True},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10,
                                                      "warmup_max_lr": 3e-4}},
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "communication_data_type": "bfloat16",
    "seed": 7,
    "nonfinite_grad": "skip",
    "wall_clock_breakdown": False,
}


def test_load_json_and_yaml(tmp_path):
    yaml = pytest.importorskip("yaml")
    json_path = tmp_path / "ds.json"
    json_path.write_text(json.dumps(_DS_CONFIG))
    yaml_path = tmp_path / "ds.yaml"
    yaml_path.write_text(yaml.safe_dump(_DS_CONFIG))
    from_json = Config.from_any(json_path)
    assert from_json == Config.from_any(str(yaml_path)) == Config.from_any(_DS_CONFIG)
    assert from_json.zero_optimization.stage == 2
    assert from_json.zero_optimization.reduce_bucket_size == 50_000_000
    assert from_json.optimizer == OptimizerConfig("Adam", _DS_CONFIG["optimizer"]["params"])
    assert from_json.scheduler.type == "WarmupDecayLR"
    assert from_json.compute_dtype == torch.bfloat16 and from_json.comm_dtype == torch.bfloat16
    assert from_json.resolve_batch(4) == BatchPlan(64, 8, 2, 4)
    assert Config.from_any(from_json) is from_json
    (tmp_path / "empty.yml").write_text("")
    assert Config.from_any(tmp_path / "empty.yml") == Config()


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_any(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_any(bad)
    toml = tmp_path / "ds.toml"
    toml.write_text("")
    with pytest.raises(ConfigError, match="use .json, .yaml or .yml"):
        Config.from_any(toml)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a mapping"):
        Config.from_any(listing)
    with pytest.raises(ConfigError, match="cannot build a Config from int"):
        Config.from_any(3)  # type: ignore[arg-type]


def test_to_dict_round_trip():
    cfg = Config.from_any(_DS_CONFIG)
    as_dict = cfg.to_dict()
    json.dumps(as_dict)  # plain data
    assert Config.from_any(as_dict) == cfg
    assert Config.from_any(json.loads(json.dumps(as_dict))) == cfg
    assert Config.from_any(Config().to_dict()) == Config()
    as_dict["zero_optimization"]["stage"] = 3  # a copy, not a view
    assert cfg.zero_optimization.stage == 2


# --- optimizer factory --------------------------------------------------------------------------------


def _params(n: int = 2) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4)) for _ in range(n)]


def _opt(cfg: dict | None, groups=None) -> torch.optim.Optimizer:
    opt_cfg = None if cfg is None else OptimizerConfig(**cfg)
    return build_optimizer(opt_cfg, groups if groups is not None else [{"params": _params()}])


def test_optimizer_types():
    default = _opt(None)
    assert type(default) is torch.optim.AdamW and default.defaults["weight_decay"] == 0.01
    assert type(_opt({"type": "AdamW"})) is torch.optim.AdamW
    assert type(_opt({"type": "adamw"})) is torch.optim.AdamW
    adam = _opt({"type": "Adam"})  # DeepSpeed: adam_w_mode defaults to True
    assert type(adam) is torch.optim.AdamW and adam.defaults["weight_decay"] == 0.0
    assert type(_opt({"type": "Adam", "params": {"adam_w_mode": False}})) is torch.optim.Adam
    assert type(_opt({"type": "ADAM", "params": {"torch_adam": True}})) is torch.optim.AdamW
    sgd = _opt({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0.0}})
    assert type(sgd) is torch.optim.SGD
    assert (sgd.defaults["momentum"], sgd.defaults["nesterov"]) == (0.9, True)
    with pytest.raises(ConfigError, match="contradicts"):
        _opt({"type": "AdamW", "params": {"adam_w_mode": False}})


def test_optimizer_unknown_type_lists_supported():
    with pytest.raises(ConfigError, match="'Adamax' is unknown; supported types: Adam, AdamW, SGD"):
        _opt({"type": "Adamax"})


def test_optimizer_params_pass_through():
    opt = _opt({"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.05,
                                            "amsgrad": True, "fused": True}})
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"], d["amsgrad"], d["fused"]) == (
        2e-3, (0.8, 0.9), 1e-6, 0.05, True, True)
    opt = _opt({"type": "SGD", "params": {"lr": 0.1, "foreach": True}})
    assert opt.defaults["foreach"] is True
    for cfg in ({"type": "AdamW", "params": {"fused": True}}, {"type": "Adam", "params": {"adam_w_mode": False, "foreach": True}},
                {"type": "SGD", "params": {"lr": 0.1, "fused": True}}):
        opt = _opt(cfg)
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()  # the fused / foreach CPU kernels really run


def test_optimizer_bad_param_lists_accepted():
    with pytest.raises(ConfigError) as err:
        _opt({"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}})
    msg = str(err.value)
    assert "'optimizer.params.betas'" in msg and "torch.optim.SGD accepts:" in msg
    assert "momentum" in msg and "nesterov" in msg
    with pytest.raises(ConfigError, match="'optimizer.params.momentum'.*torch.optim.AdamW accepts: lr, betas"):
        _opt({"type": "AdamW", "params": {"momentum": 0.9}})


def test_optimizer_torch_rejection_is_config_error():
    with pytest.raises(ConfigError, match="rejected"):
        _opt({"type": "AdamW", "params": {"lr": -1.0}})
    with pytest.raises(ConfigError, match="rejected"):
        _opt({"type": "AdamW", "params": {"fused": True, "foreach": True}})


def test_optimizer_group_overrides_win():
    weights, biases = _params(2)
    opt = build_optimizer(
        OptimizerConfig("AdamW", {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}),
        [{"params": [weights]}, {"params": [biases], "weight_decay": 0.0, "lr": 5e-4, "betas": [0.5, 0.6]}],
    )
    g0, g1 = opt.param_groups
    assert (g0["weight_decay"], g0["lr"], g0["betas"]) == (0.1, 1e-3, (0.9, 0.95))
    assert (g1["weight_decay"], g1["lr"], g1["betas"]) == (0.0, 5e-4, (0.5, 0.6))


# Schedulers: tests/test_schedulers.py.


def test_offload_sections():
    cfg = Config.from_any({
        "zero_optimization": {
            "stage": 3, "sub_group_size": 1e6,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4},
            "offload_param": {"device": "cpu", "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 2, "single_submit": False},
    })
    z = cfg.zero_optimization
    assert (z.sub_group_size, z.offload_optimizer.device, z.offload_optimizer.nvme_path) == (1_000_000, "nvme", "/local_nvme")
    assert z.offload_optimizer.enabled and z.offload_param.enabled and z.offload_param.buffer_size == 100_000_000
    assert cfg.aio.thread_count == 2
    assert Config.from_any(cfg.to_dict()) == cfg
    assert not Config.from_any({}).zero_optimization.offload_optimizer.enabled


@pytest.mark.parametrize(
    "zero, message",
    [
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs ZeRO stage 1, 2 or 3"),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "needs ZeRO stage 3 \\(stage is 2\\)"),
        ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "'nvme_path' is not set"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "'nvme_path' is not set"),
        ({"stage": 2, "offload_optimizer": {"device": "disk"}}, "must be 'none', 'cpu', 'nvme' or 'auto'"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 1}}, "buffer_count"),
        ({"stage": 2, "sub_group_size": 0}, "sub_group_size"),
    ],
)
def test_offload_config_errors(zero, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_any({"zero_optimization": zero})


def test_aio_block_size_must_be_aligned():
    with pytest.raises(ConfigError, match="multiple of 4096"):
        Config.from_any({"aio": {"block_size": 1000}})


def test_offload_paths_must_agree():
    with pytest.raises(ConfigError, match="differ.*same path"):
        Config.from_any({"zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
            "offload_param": {"device": "nvme", "nvme_path": "/b"}}})
    Config.from_any({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a/"},
        "offload_param": {"device": "nvme", "nvme_path": "/a"}}})


@pytest.mark.parametrize(
    "zero, key",
    [
        ({"stage3_param_persistence_threshold": -1}, "stage3_param_persistence_threshold"),
        ({"stage3_prefetch_bucket_size": -5}, "stage3_prefetch_bucket_size"),
        ({"stage3_gather_unit": "blocks please"}, "stage3_gather_unit"),
        ({"stage3_gather_unit": "Block,"}, "stage3_gather_unit"),
    ],
)
def test_stage3_keys_out_of_range_name_themselves(zero, key):
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}"):
        Config.from_any({"zero_optimization": {"stage": 3, **zero}})


def test_stage3_gather_keys_defaults_and_names():
    z = Config.from_any({"zero_optimization": {"stage": 3}}).zero_optimization
    assert z.stage3_prefetch_bucket_size is None and z.stage3_gather_unit == "auto"
    z = Config.from_any({"zero_optimization": {"stage": 3, "stage3_gather_unit": "LlamaDecoderLayer, MLP",
                                               "prefetch_bucket_size": 0}}).zero_optimization
    assert z.stage3_gather_unit == "LlamaDecoderLayer, MLP" and z.stage3_prefetch_bucket_size == 0
