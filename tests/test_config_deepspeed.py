"""DeepSpeed configs as written: published configs load, keys inert at their value are accepted with one
notice, every problem of a config comes in one error, and the csv monitor writes DeepSpeed's events.

The configs below are written out from their documented content: DeepSpeed's getting-started and CIFAR-10
tutorials (docs/_tutorials/), DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, and the ZeRO-2 / ZeRO-3
examples of the Hugging Face Transformers DeepSpeed guide."""

from __future__ import annotations

import csv
import filecmp
import logging
import runpy
from pathlib import Path

import pytest
import torch

import rayzero
import rayzero.monitor
from rayzero.config import Config, ConfigError, NotSupportedYetError
from rayzero.monitor import build_monitor

# DeepSpeed docs, getting-started: the older boolean form of zero_optimization
GETTING_STARTED = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "zero_optimization": True,
}

# DeepSpeed docs, CIFAR-10 tutorial's ds_config.json
CIFAR_TUTORIAL = {
    "train_batch_size": 4,
    "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "wall_clock_breakdown": False,
}


def cifar_example(stage: int, dtype: str) -> dict:
    """DeepSpeedExamples' cifar10_deepspeed.py config for --stage and --dtype."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam",
                      "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


_HF_COMMON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO2 = {**_HF_COMMON, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
    "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
    "contiguous_gradients": True,
}}
HF_ZERO3 = {**_HF_COMMON, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
}}
# the "auto" keys DeepSpeed cannot read either; in zero_optimization, fp16 and bf16 DeepSpeed reads "auto" as the
# key's default, and so does rayzero (named in the notice)
HF_AUTO_KEYS = {
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
    "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps", "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
    "train_micro_batch_size_per_gpu",
}
HF_DEFAULTED = {"fp16.enabled", "bf16.enabled"}
HF_ZERO3_DEFAULTED = HF_DEFAULTED | {"zero_optimization.reduce_bucket_size",
                                     "zero_optimization.stage3_prefetch_bucket_size",
                                     "zero_optimization.stage3_param_persistence_threshold"}

# what the Trainer writes for "auto" (its own arguments: bf16 run, lr 5e-5, ...), by key name
HF_FILLED = {
    ("fp16", "enabled"): False, ("bf16", "enabled"): True, ("params", "lr"): 5e-5,
    ("params", "betas"): [0.9, 0.999], ("params", "eps"): 1e-8, ("params", "weight_decay"): 0.0,
    ("params", "warmup_min_lr"): 0.0, ("params", "warmup_max_lr"): 5e-5, ("params", "warmup_num_steps"): 100,
    (None, "gradient_accumulation_steps"): 2, (None, "gradient_clipping"): 1.0, (None, "train_batch_size"): 32,
    (None, "train_micro_batch_size_per_gpu"): 4, ("zero_optimization", "reduce_bucket_size"): 4096 * 4096,
    ("zero_optimization", "stage3_prefetch_bucket_size"): int(0.9 * 4096 * 4096),
    ("zero_optimization", "stage3_param_persistence_threshold"): 10 * 4096,
}


def _fill(cfg: dict, parent: str | None = None) -> dict:
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out[key] = _fill(value, key)
        else:
            out[key] = HF_FILLED[(parent, key)] if value == "auto" else value
    return out


def _ignored_notice(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "accepted with no effect" in r.getMessage()]


def test_deepspeed_tutorial_and_example_configs_load_as_written(caplog):
    caplog.set_level(logging.WARNING, logger="rayzero")
    cfg = Config.from_any(GETTING_STARTED)
    assert cfg.zero_optimization.stage == 1  # DeepSpeed reads true as stage 1 (runtime/zero/config.py)
    assert cfg.fp16.enabled and cfg.optimizer.params == {"lr": 0.00015}
    assert cfg.ignored_keys == {"zero_optimization": True}
    assert Config.from_any({**GETTING_STARTED, "zero_optimization": False}).zero_optimization.stage == 0
    cfg = Config.from_any({**GETTING_STARTED, "allgather_size": 1000})  # the old form's bucket size
    assert cfg.zero_optimization.allgather_bucket_size == 1000

    cfg = Config.from_any(CIFAR_TUTORIAL)
    assert cfg.scheduler.type == "WarmupLR" and cfg.ignored_keys == {}

    caplog.clear()
    for stage in (0, 1, 2, 3):
        for dtype in ("fp16", "bf16", "fp32"):
            cfg = Config.from_any(cifar_example(stage, dtype))
            assert cfg.zero_optimization.stage == stage
            assert cfg.compute_dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
            assert cfg.zero_optimization.allgather_bucket_size == 50000000 and cfg.gradient_clipping == 1.0
            assert cfg.ignored_keys == {"prescale_gradients": False, "fp16.fp16_master_weights_and_grads": False,
                                        "zero_optimization.cpu_offload": False}
    notices = _ignored_notice(caplog)
    assert len(notices) == 12  # one per load, each naming all three keys with their values
    assert all("prescale_gradients = False" in n and "fp16.fp16_master_weights_and_grads = False" in n
               and "zero_optimization.cpu_offload = False" in n for n in notices)


@pytest.mark.parametrize("hf, defaulted", [(HF_ZERO2, HF_DEFAULTED), (HF_ZERO3, HF_ZERO3_DEFAULTED)],
                         ids=["zero2", "zero3"])
def test_hugging_face_configs(hf, defaulted, caplog):
    # passed to rayzero directly: one error naming every "auto" key DeepSpeed cannot read either
    with pytest.raises(ConfigError) as err:
        Config.from_any(hf)
    named = {str(p).split("'")[1] for p in err.value.problems}
    assert named == HF_AUTO_KEYS
    assert all("Hugging Face Trainer placeholder" in str(p) for p in err.value.problems)
    assert f"the config has {len(HF_AUTO_KEYS)} problems" in str(err.value)
    # with those filled, the sections' "auto" keys take rayzero's defaults, as DeepSpeed takes its own
    top = {k: v for k, v in _fill(hf).items() if k not in ("zero_optimization", "fp16", "bf16")}
    cfg = Config.from_any({**hf, **top})
    assert set(cfg.ignored_keys) >= defaulted and all(cfg.ignored_keys[k] == "auto" for k in defaulted)
    assert cfg.compute_dtype == torch.float32  # fp16 and bf16 off, their default
    if "zero_optimization.reduce_bucket_size" in defaulted:
        assert cfg.zero_optimization.reduce_bucket_size is None  # rayzero derives it at start-up
    caplog.clear()

    # as the Trainer hands it on, with the values written in
    caplog.set_level(logging.WARNING, logger="rayzero")
    filled = _fill(hf)
    cfg = Config.from_any(filled)
    z = cfg.zero_optimization
    assert cfg.compute_dtype == torch.bfloat16 and cfg.gradient_clipping == 1.0
    assert cfg.resolve_batch(4).gradient_accumulation_steps == 2
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    if z.stage == 3:
        assert z.offload_param.device == "cpu" and z.stage3_gather_16bit_weights_on_model_save
        assert z.reduce_bucket_size == 4096 * 4096 and z.stage3_param_persistence_threshold == 40960
        assert cfg.ignored_keys == {"zero_optimization.stage3_max_live_parameters": 1e9,
                                    "zero_optimization.stage3_max_reuse_distance": 1e9}
        assert len(_ignored_notice(caplog)) == 1
    else:
        assert z.stage == 2 and z.reduce_bucket_size == 200_000_000 and cfg.ignored_keys == {}
    assert Config.from_any(cfg.to_dict()) == cfg


def test_three_problems_come_in_one_error():
    bad = {
        "train_batch_sise": 8,                                   # unknown key
        "sparse_gradients": True,                                # on, and not supported
        "zero_optimization": {"stage": 5, "reduce_bucket_size": "5e8"},   # only the type is checked per key
        "gradient_clipping": "1.0",                              # wrong type
    }
    with pytest.raises(ConfigError) as err:
        Config.from_any(bad)
    assert not isinstance(err.value, NotSupportedYetError)
    msg = str(err.value)
    assert msg.startswith("the config has 4 problems; fix all of them before training:\n")
    assert "unknown config key 'train_batch_sise'; did you mean 'train_batch_size'?" in msg
    assert ("config key 'sparse_gradients' = True (sparse embedding gradients) is not supported "
            "yet by rayzero; set it to false or remove it") in msg
    assert "'zero_optimization.reduce_bucket_size' has value '5e8'" in msg
    assert "'gradient_clipping' has value '1.0'" in msg
    assert len(err.value.problems) == 4

    # all not-supported: the error keeps that type; the switch-like ones say which value is accepted
    with pytest.raises(NotSupportedYetError) as err:
        Config.from_any({"comms_logger": {"enabled": True}, "moe": {},
                         "zero_optimization": {"zero_quantized_gradients": True}})
    assert [type(p) for p in err.value.problems] == [NotSupportedYetError] * 3
    assert 'set "enabled": false or remove the section' in str(err.value)
    # a single problem is raised as it is, without the list
    with pytest.raises(ConfigError) as err:
        Config.from_any({"train_batch_sise": 8})
    assert str(err.value) == "unknown config key 'train_batch_sise'; did you mean 'train_batch_size'?"


def test_inert_keys_at_their_value_and_refused_otherwise(caplog):
    caplog.set_level(logging.WARNING, logger="rayzero")
    inert = {
        "prescale_gradients": False, "gradient_predivide_factor": 1.0, "zero_allow_untested_optimizer": True,
        "tensorboard": {"enabled": False}, "wandb": {"enabled": False}, "csv_monitor": {"enabled": False},
        "comms_logger": {"enabled": False}, "flops_profiler": {"enabled": False, "profile_step": 1},
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True, "zero_hpz_partition_size": 1,
                              "cpu_offload": False, "round_robin_gradients": True},
        "fp16": {"fp16_master_weights_and_grads": False},
    }
    cfg = Config.from_any(inert)
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True  # read, not ignored
    assert set(cfg.ignored_keys) == {
        "prescale_gradients", "gradient_predivide_factor", "zero_allow_untested_optimizer", "comms_logger",
        "flops_profiler", "bf16.loss_scale", "bf16.initial_scale_power",
        "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.zero_hpz_partition_size", "zero_optimization.cpu_offload",
        "zero_optimization.round_robin_gradients", "fp16.fp16_master_weights_and_grads",
    }
    notices = _ignored_notice(caplog)
    assert len(notices) == 1 and "13 DeepSpeed config key(s)" in notices[0]
    assert "bf16.loss_scale = 0 (bf16 uses no loss scaling)" in notices[0]

    # the same keys switched on are refused, all in one error
    on = {"sparse_gradients": True, "disable_allgather": True, "comms_logger": {"enabled": True},
          "activation_checkpointing": {"partition_activations": True},
          "zero_optimization": {"zero_hpz_partition_size": 8}, "fp16": {"fp16_master_weights_and_grads": True}}
    with pytest.raises(NotSupportedYetError) as err:
        Config.from_any(on)
    assert len(err.value.problems) == 6

    # DeepSpeed's older offload switches read as the sections they stand for
    z = Config.from_any({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                               "cpu_offload_use_pin_memory": True}}).zero_optimization
    assert (z.offload_optimizer.device, z.offload_param.device) == ("cpu", "cpu")
    assert z.offload_optimizer.pin_memory and z.offload_param.pin_memory
    with pytest.raises(ConfigError, match="'zero_optimization.cpu_offload' and 'zero_optimization.offload_optimizer'"):
        Config.from_any({"zero_optimization": {"stage": 2, "cpu_offload": True,
                                               "offload_optimizer": {"device": "cpu"}}})
    z = Config.from_any({"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True}})
    assert z.zero_optimization.stage3_gather_16bit_weights_on_model_save


def _read_csv(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_monitor_writes_the_engines_losses_and_lrs(tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 3, "warmup_type": "linear"}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run1"},
        "tensorboard": {"enabled": False},
        "wall_clock_breakdown": True, "steps_per_print": 2,
    }
    caplog.set_level(logging.INFO, logger="rayzero")
    engine = rayzero.initialize(model, cfg)
    data = torch.randn(8, 2, 4)
    target = torch.randn(8, 2, 1)
    losses, lrs = [], []
    for i in range(8):  # 4 optimizer steps of 2 micro-steps
        loss = torch.nn.functional.mse_loss(engine(data[i]), target[i])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if i % 2 == 1:  # a boundary: the step was taken
            lrs.append(engine.get_lr()[0])
    # a window that ends in a non-finite gradient error writes nothing; the next window's loss is its own
    engine.backward(torch.nn.functional.mse_loss(engine(data[0]), target[0]))
    engine.step()
    engine.backward(torch.nn.functional.mse_loss(engine(data[1]), target[1]) * float("inf"))
    with pytest.raises(rayzero.NonFiniteGradientError):
        engine.step()
    for i in range(2):
        loss = torch.nn.functional.mse_loss(engine(data[i]), target[i])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    lrs.append(engine.get_lr()[0])
    engine.destroy()

    log_dir = tmp_path / "run1"
    timed = [f"Train_Samples_elapsed_time_ms_{k}.csv" for k in ("backward", "forward", "step")]
    assert sorted(p.name for p in log_dir.iterdir()) == [*timed, "Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    loss_rows = _read_csv(log_dir / "Train_Samples_train_loss.csv")
    lr_rows = _read_csv(log_dir / "Train_Samples_lr.csv")
    assert loss_rows[0] == ["step", "train_loss"] and lr_rows[0] == ["step", "lr"]
    # x-axis: samples trained (train_batch_size 4 per step); the loss before the step, the lr after it
    assert [int(r[0]) for r in loss_rows[1:]] == [0, 4, 8, 12, 16]
    assert [int(r[0]) for r in lr_rows[1:]] == [4, 8, 12, 16, 20]
    want = [(losses[2 * k] + losses[2 * k + 1]) / 2 for k in range(5)]
    assert [float(r[1]) for r in loss_rows[1:]] == pytest.approx(want, rel=1e-6)
    assert [float(r[1]) for r in lr_rows[1:]] == pytest.approx(lrs, rel=1e-12)
    assert len(set(lrs)) > 1  # the schedule moved: the rows follow it

    # each window's milliseconds: the engine's own log (every 2 steps, the mean per step over them) agrees.
    # Rows are steps 1, 2, 3, 4 and 6; the window that ended in the error (step 5) counts with step 6's.
    reports = [r.getMessage() for r in caplog.records if "ms/step" in r.getMessage()]
    assert [m.split(":")[0] for m in reports] == ["step 2", "step 4", "step 6"]
    for phase in ("forward", "backward", "step"):
        rows = [float(r[1]) for r in _read_csv(log_dir / f"Train_Samples_elapsed_time_ms_{phase}.csv")[1:]]
        assert len(rows) == 5 and all(v > 0 for v in rows)
        logged = [float(m.split(f" {phase} ")[1].split(",")[0]) for m in reports]
        assert [(rows[0] + rows[1]) / 2, (rows[2] + rows[3]) / 2, rows[4] / 2] == pytest.approx(logged, abs=0.051)


def test_monitor_sinks_rank0_only_and_missing_packages_said_once(tmp_path, caplog, monkeypatch):
    cfg = Config.from_any({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)},
                           "wandb": {"enabled": True}})
    assert build_monitor(cfg, rank=1) is None  # only rank 0 writes
    assert build_monitor(Config(), rank=0) is None  # nothing enabled, no monitor
    caplog.set_level(logging.WARNING, logger="rayzero")
    monkeypatch.setattr(rayzero.monitor, "_SAID_MISSING", set())  # a fresh process's record
    try:
        import wandb  # noqa: F401
    except ImportError:
        for _ in range(2):
            monitor = build_monitor(cfg, rank=0)
            assert [type(s).__name__ for s in monitor.sinks] == ["CSVSink"]
        said = [r.getMessage() for r in caplog.records if "'wandb' package is not installed" in r.getMessage()]
        assert len(said) == 1 and "pip install wandb" in said[0]
    monitor = build_monitor(cfg, rank=0)
    monitor.write([("Train/Samples/lr", 0.5, 3)])
    monitor.write([("Train/Samples/lr", 0.25, 6)])
    assert _read_csv(tmp_path / "DeepSpeedJobName" / "Train_Samples_lr.csv") == [
        ["step", "lr"], ["3", "0.5"], ["6", "0.25"]]


def test_csv_files_are_deepspeeds_bytes(tmp_path):
    """The same events give the same files as DeepSpeed's csv_monitor (tests/data/deepspeed_csv_monitor)."""
    data = Path(__file__).parent / "data" / "deepspeed_csv_monitor"
    events = runpy.run_path(str(data / "regenerate.py"))["EVENTS"]
    sink = rayzero.monitor.CSVSink(str(tmp_path), "job")
    for batch in events:
        sink.write(batch)
    names = sorted(p.name for p in (data / "job").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "job").iterdir()) and len(names) == 3
    for name in names:
        assert filecmp.cmp(data / "job" / name, tmp_path / "job" / name, shallow=False), name


def test_lr_events_match_a_deepspeed_engine(tmp_path, monkeypatch):
    """Where DeepSpeed is installed: its engine and rayzero's, on the same model and config, write the same
    Train/Samples/lr file (DeepSpeed 0.19 writes no train_loss)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed as dist

    def run(which: str) -> list[list[str]]:
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
               "csv_monitor": {"enabled": True, "output_path": str(tmp_path / which), "job_name": "job"}}
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        if which == "deepspeed":
            cfg["optimizer"]["params"]["torch_adam"] = True
            for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT="29535").items():
                monkeypatch.setenv(key, value)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        else:
            engine = rayzero.initialize(model, cfg)
        torch.manual_seed(1)
        data, target = torch.randn(8, 2, 4), torch.randn(8, 2, 1)
        for i in range(8):
            engine.backward(torch.nn.functional.mse_loss(engine(data[i]), target[i]))
            engine.step()
        if which == "rayzero":
            engine.destroy()
        return _read_csv(tmp_path / which / "job" / "Train_Samples_lr.csv")

    try:
        ours = run("rayzero")
        theirs = run("deepspeed")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert ours == theirs == [["step", "lr"], ["4", "0.01"], ["8", "0.01"], ["12", "0.01"], ["16", "0.01"]]


def test_tensorboard_events_where_tensorboard_is_installed(tmp_path):
    """Where the tensorboard package is installed: the same events as the csv sink, read back from the event
    files (float32 in TensorBoard)."""
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    sinks = {"output_path": str(tmp_path), "job_name": "job"}
    engine = rayzero.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                        "tensorboard": {"enabled": True, **sinks},
                                        "csv_monitor": {"enabled": True, **sinks, "job_name": "csv"}})
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    engine.destroy()
    acc = ea.EventAccumulator(str(tmp_path / "job"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["Train/Samples/lr", "Train/Samples/train_loss"]
    for tag in acc.Tags()["scalars"]:
        rows = _read_csv(tmp_path / "csv" / (tag.replace("/", "_") + ".csv"))[1:]
        assert [e.step for e in acc.Scalars(tag)] == [int(r[0]) for r in rows]
        assert [e.value for e in acc.Scalars(tag)] == pytest.approx([float(r[1]) for r in rows], rel=1e-6)


def test_wandb_logs_where_wandb_is_installed(tmp_path, monkeypatch):
    """Where the wandb package is installed: an offline run gets the csv sink's events (its summary holds each
    one's value at the run's last committed step)."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    engine = rayzero.initialize(torch.nn.Linear(4, 1), {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "wandb": {"enabled": True, "project": "rayzero-test"},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "csv"}})
    try:
        for _ in range(4):
            engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
            engine.step()
        run = wandb.run
        assert run is not None and run.project == "rayzero-test"
        step = run.summary["_step"]  # (wandb commits a step's row when a later step is logged)
        assert step > 0
        for tag in ("Train/Samples/train_loss", "Train/Samples/lr"):
            rows = {int(r[0]): float(r[1]) for r in _read_csv(tmp_path / "csv" / (tag.replace("/", "_") + ".csv"))[1:]}
            assert run.summary[tag] == pytest.approx(rows[step], rel=1e-12)
    finally:
        engine.destroy()
        wandb.finish()
