"""Typed training config that reads DeepSpeed-style JSON/YAML as written.

Every DeepSpeed key is understood, accepted because it has no effect at its value (a switch that is off,
a tuning hint rayzero does not need: one warning per load names them all with their values), or
rejected as "not supported yet" with the reason; any other key is reported as unknown with the closest
known key.  All the problems of a config are reported in one error.  A config that trains under
DeepSpeed either trains the same way here or fails before any worker starts.

    cfg = Config.from_any("ds_config.json")
    plan = cfg.resolve_batch(world_size=8)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch


from rayzero.config_schema import (
    ConfigError,
    Inert,
    NotSupportedYetError,
    _Section,
    combine_problems,
    did_you_mean,
    inert_at,
    inert_when_disabled,
    note_inert,
)

__all__ = [  # the public names, including those defined in rayzero.config_schema
    "AioConfig", "BatchPlan", "BF16Config", "Config", "ConfigError", "CSVMonitorConfig", "ExpertParallelConfig",
    "FP16Config", "GraphCaptureConfig", "NotSupportedYetError", "OffloadOptimizerConfig", "OffloadParamConfig",
    "OptimizerConfig", "SchedulerConfig", "TensorBoardConfig", "TensorParallelConfig", "WandbConfig", "ZeroConfig",
    "did_you_mean",
]


_ZERO_NOT_SUPPORTED = {
    "zenflow": "ZenFlow",
    "leaf_module": "DeepSpeed's stage-3 leaf modules; rayzero's gather units are set by stage3_gather_unit",
}

_TUNING = "a tuning hint rayzero does not need"
_STAGE3_HINT = (f"{_TUNING}: stage 3 frees each gather unit after use and reads ahead by "
                "stage3_prefetch_bucket_size")

# DeepSpeed's zero_optimization keys that have no effect in rayzero (at any value, or at the value shown).
_ZERO_INERT = {
    **dict.fromkeys(("stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance",
                     "max_reuse_distance"), Inert(why=_STAGE3_HINT)),
    **dict.fromkeys(("stage3_model_persistence_threshold", "model_persistence_threshold"),
                    Inert(why=f"{_TUNING}: stage 3 keeps parameters whole by stage3_param_persistence_threshold")),
    **dict.fromkeys(("stage3_module_granularity_threshold", "module_granularity_threshold"),
                    Inert(why=f"{_TUNING}: stage 3's gather units are set by stage3_gather_unit")),
    **dict.fromkeys(("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
                     "stage3_allgather_sequential", "allgather_sequential"),
                    Inert(why=f"{_TUNING}: stage 3 always gathers with one all-gather per unit")),
    "round_robin_gradients": Inert(why=f"{_TUNING}: how offloaded gradients are copied to the host"),
    "use_multi_rank_bucket_allreduce": Inert(why=f"{_TUNING}: how buckets are all-reduced"),
    "memory_efficient_linear": Inert(why="DeepSpeed's stage-3 linear layer, which rayzero does not use"),
    "override_module_apply": Inert(why="DeepSpeed's Module.apply hook under zero.Init"),
    "log_trace_cache_warnings": Inert(why="DeepSpeed's stage-3 trace cache, which rayzero does not have"),
    "save_muon_momentum_buffer_in_memory": Inert(why="read only with the Muon optimizer"),
    "elastic_checkpoint": Inert(why="rayzero checkpoints load at any world size whatever it says"),
    "ignore_unused_parameters": inert_at(True, why="DeepSpeed's default",
                                         refuse="an error for parameters that get no gradient"),
    "load_from_fp32_weights": inert_at(True, why="rayzero checkpoints hold the fp32 masters and load them",
                                       refuse="rebuilding the fp32 masters from the 16-bit weights on load"),
    "grad_hooks": inert_at(True, why="gradients are reduced from backward hooks",
                           refuse="reducing gradients only after the whole backward"),
    "legacy_stage1": inert_at(False, why="off", refuse="DeepSpeed's legacy stage 1"),
    "pipeline_loading_checkpoint": inert_at(False, why="off", refuse="loading checkpoints into pipeline stages"),
    "enable_sanity_checks": inert_at(False, why="off", refuse="DeepSpeed's stage-3 sanity checks"),
    "zero_hpz_partition_size": inert_at(1, why="1 means no hierarchical partitioning",
                                        refuse="ZeRO++ hierarchical partitioning"),
    "zero_quantized_weights": inert_at(False, why="off", refuse="ZeRO++ quantized weights"),
    "zero_quantized_nontrainable_weights": inert_at(False, why="off", refuse="ZeRO++ quantized weights"),
    "zero_quantized_gradients": inert_at(False, why="off", refuse="ZeRO++ quantized gradients"),
    "zeropp_loco_param": inert_at(None, why="off", refuse="ZeRO++ LoCo"),
    "mics_shard_size": inert_at(-1, why="-1 means MiCS is off", refuse="MiCS"),
    "mics_hierarchical_params_gather": inert_at(False, why="off", refuse="MiCS"),
    # read by _translate when true; false (DeepSpeed's default) is off
    "cpu_offload": inert_at(False, why="off"),
    "cpu_offload_param": inert_at(False, why="off"),
    "cpu_offload_use_pin_memory": inert_at(False, why="off"),
}

# DeepSpeed's older offload switches -> (the section they turn on, its keys)
_ZERO_OLD_OFFLOAD = {
    "cpu_offload": ("offload_optimizer", {"device": "cpu"}),
    "cpu_offload_param": ("offload_param", {"device": "cpu"}),
}

# the size the Hugging Face Trainer fills with a fraction (0.9 * hidden_size**2 elements), in both spellings
_ZERO_FRACTIONAL_SIZES = ("stage3_prefetch_bucket_size", "prefetch_bucket_size")

_NVME_PIPELINE = Inert(why=f"{_TUNING}: the NVMe swap always reads ahead while stepping")


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _same_dir(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


@dataclass
class OffloadOptimizerConfig(_Section):
    """`zero_optimization.offload_optimizer`: where the fp32 master partitions and optimizer state live.

    ``cpu`` keeps them (and the fp32 gradient accumulator) in host memory; ``nvme`` keeps them in files
    under ``nvme_path`` and brings one sub-group (``sub_group_size`` elements) at a time into memory to
    step it; ``auto`` lets ``rayzero.fit`` pick ``none`` or ``nvme`` from the memory the workers may use.
    """

    _path: ClassVar[str] = "zero_optimization.offload_optimizer"
    _auto_means_default: ClassVar[bool] = True
    _inert: ClassVar[Mapping[str, Inert]] = {
        "ratio": inert_at(1, why="the whole optimizer state is offloaded", refuse="partial optimizer offload"),
        "fast_init": Inert(why=f"{_TUNING}: how the NVMe swap files are first written"),
        "pipeline": _NVME_PIPELINE, "pipeline_read": _NVME_PIPELINE, "pipeline_write": _NVME_PIPELINE,
        "super_offload": inert_at(False, why="off", refuse="DeepSpeed's SuperOffload"),
        "cpuadam_cores_perc": Inert(why="DeepSpeed's CPU Adam threads; rayzero steps torch's optimizer"),
    }

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4

    def _validate(self) -> None:
        self._check("device", self.device in (*OFFLOAD_DEVICES, "auto"), "must be 'none', 'cpu', 'nvme' or 'auto'")
        self._check("buffer_count", self.buffer_count >= 2,
                    "must be >= 2 (one sub-group being stepped while the next one is read)")
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(
                "config key 'zero_optimization.offload_optimizer.device' is 'nvme' but 'nvme_path' is not set; "
                "set 'nvme_path' to a directory on a local disk (its free space is checked before training)"
            )

    @property
    def enabled(self) -> bool:
        return self.device in ("cpu", "nvme")


@dataclass
class OffloadParamConfig(_Section):
    """`zero_optimization.offload_param` (stage 3): where the parameter partitions live between uses."""

    _path: ClassVar[str] = "zero_optimization.offload_param"
    _auto_means_default: ClassVar[bool] = True
    _inert: ClassVar[Mapping[str, Inert]] = {
        "pipeline": _NVME_PIPELINE, "pipeline_read": _NVME_PIPELINE, "pipeline_write": _NVME_PIPELINE,
    }

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    # left out: derived by rayzero.offload.params.read_pool_shape (two buffers of the largest gather unit's
    # shards) and cache_elements (none)
    buffer_count: int | None = None
    buffer_size: int | None = None
    max_in_cpu: int | None = None

    def _validate(self) -> None:
        self._check("device", self.device in OFFLOAD_DEVICES, "must be 'none', 'cpu' or 'nvme'")
        self._check("buffer_count", self.buffer_count is None or self.buffer_count >= 1, "must be >= 1")
        self._check("buffer_size", self.buffer_size is None or self.buffer_size > 0, "must be > 0 elements")
        self._check("max_in_cpu", self.max_in_cpu is None or self.max_in_cpu >= 0, "must be >= 0 elements")
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(
                "config key 'zero_optimization.offload_param.device' is 'nvme' but 'nvme_path' is not set; "
                "set 'nvme_path' to a directory on a local disk"
            )

    @property
    def enabled(self) -> bool:
        return self.device in ("cpu", "nvme")


@dataclass
class AioConfig(_Section):
    """`aio`: how the NVMe swap store does its I/O (O_DIRECT, block-aligned, on a thread pool)."""

    _path: ClassVar[str] = "aio"
    _inert: ClassVar[Mapping[str, Inert]] = {"use_gds": inert_at(False, why="off", refuse="GPUDirect Storage")}

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    intra_op_parallelism: int = 1

    def _validate(self) -> None:
        self._check("block_size", self.block_size >= 4096 and self.block_size % 4096 == 0,
                    "must be a positive multiple of 4096 bytes (the O_DIRECT alignment)")
        self._check("queue_depth", self.queue_depth >= 1, "must be >= 1")
        self._check("thread_count", self.thread_count >= 1, "must be >= 1")
        self._check("intra_op_parallelism", self.intra_op_parallelism >= 1, "must be >= 1")


@dataclass
class ZeroConfig(_Section):
    """`zero_optimization`: which state is partitioned and how communication is bucketed (elements)."""

    _path: ClassVar[str] = "zero_optimization"
    _auto_means_default: ClassVar[bool] = True
    _not_supported: ClassVar[Mapping[str, str]] = _ZERO_NOT_SUPPORTED
    _inert: ClassVar[Mapping[str, Inert]] = _ZERO_INERT
    _aliases: ClassVar[Mapping[str, str]] = {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }
    _misplaced: ClassVar[Mapping[str, str]] = {
        "aio": "'aio' is a top-level section; move it out of zero_optimization",
    }
    _fixed: ClassVar[Mapping[str, tuple[Any, str]]] = {
        "reduce_scatter": (True, "rayzero always reduce-scatters gradients into their owners' partitions"),
        "allgather_partitions": (True, "rayzero always all-gathers updated partitions"),
    }

    stage: int = 0
    # None: derived from the model and the transport at start-up (zero/buckets.py, docs/config.md)
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    overlap_comm: bool = True
    # stages 1-2 where weights are gathered (ranks across hosts): the all-gather after a step runs during the
    # next forward, each operation waiting for the parameters it reads (zero/publish.py)
    overlap_param_gather: bool = False
    contiguous_gradients: bool = True
    # None: two of the largest gather units (stage3.py); 0 turns prefetching off
    stage3_prefetch_bucket_size: int | None = None
    # "auto" (marked modules, HF _no_split_modules, else the repeated block), "module", or class names
    # separated by commas ("LlamaDecoderLayer")
    stage3_gather_unit: str = "auto"
    stage3_param_persistence_threshold: int = 100_000
    # stage 3 where a communicator's ranks share one host: keep one copy of the weights they all map instead
    # of gathering (zero/stage3.py).  None: where that costs no more memory than gathering
    stage3_share_weights: bool | None = None
    # None: 1e9 elements, or with NVMe optimizer offload the size at which the swap pools hold 1/8 of the rank's partition (rayzero/memory.py)
    sub_group_size: int | None = None
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    # stage 3: save_16bit_model() gathers the partitioned weights and saves them whole (DeepSpeed's key)
    stage3_gather_16bit_weights_on_model_save: bool = False

    @classmethod
    def _translate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """DeepSpeed's older switches ``cpu_offload`` / ``cpu_offload_param`` (true) read as the offload
        sections they stand for; ``cpu_offload_use_pin_memory`` (true) as ``pin_memory`` in both."""
        # a prefetch size in elements with a fraction is rounded down (the Hugging Face Trainer writes an "auto"
        # stage3_prefetch_bucket_size as 0.9 * hidden_size**2)
        for key in _ZERO_FRACTIONAL_SIZES:
            value = data.get(key)
            if isinstance(value, float) and math.isfinite(value) and value >= 0 and not value.is_integer():
                data[key] = math.floor(value)
        pin = data.get("cpu_offload_use_pin_memory") is True
        for old, (section, keys) in _ZERO_OLD_OFFLOAD.items():
            if data.get(old) is not True:
                continue
            if section in data:
                raise ConfigError(
                    f"config keys 'zero_optimization.{old}' and 'zero_optimization.{section}' set the same "
                    f"option; keep '{section}'"
                )
            del data[old]
            data[section] = {**keys, **({"pin_memory": True} if pin else {})}
        if pin:
            targets = [s for s in ("offload_optimizer", "offload_param") if isinstance(data.get(s), Mapping)]
            if not targets:  # nothing is offloaded, so there is nothing to pin (DeepSpeed accepts it too)
                note_inert("zero_optimization.cpu_offload_use_pin_memory", True, "nothing is offloaded to pin")
                del data["cpu_offload_use_pin_memory"]
                return data
            if any("pin_memory" in data[s] and data[s]["pin_memory"] is not True for s in targets):
                raise ConfigError(
                    "config key 'zero_optimization.cpu_offload_use_pin_memory' is true but no offload section "
                    "takes it; write \"pin_memory\": true inside offload_optimizer / offload_param"
                )
            del data["cpu_offload_use_pin_memory"]
            for s in targets:
                data[s] = {**data[s], "pin_memory": True}
        return data

    def _validate(self) -> None:
        self._check("stage", 0 <= self.stage <= 3, "ZeRO stage must be 0, 1, 2 or 3")
        self._check("sub_group_size", self.sub_group_size is None or self.sub_group_size > 0,
                    "must be > 0 elements (or left out for rayzero's choice)")
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ConfigError(
                "config key 'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3 (stage is 0): "
                "set zero_optimization.stage to 1 or more, or remove offload_optimizer"
            )
        opt_path, param_path = self.offload_optimizer.nvme_path, self.offload_param.nvme_path
        if (self.offload_optimizer.device in ("nvme", "auto") and self.offload_param.device == "nvme"
                and opt_path and param_path and _same_dir(opt_path) != _same_dir(param_path)):
            raise ConfigError(
                f"zero_optimization.offload_optimizer.nvme_path ({opt_path!r}) and offload_param.nvme_path "
                f"({param_path!r}) differ; a rank keeps all its swap files in one directory: set both to the "
                "same path"
            )
        if self.offload_param.device != "none" and self.stage != 3:
            raise ConfigError(
                f"config key 'zero_optimization.offload_param' needs ZeRO stage 3 (stage is {self.stage}): "
                "set zero_optimization.stage to 3, or use offload_optimizer for stages 1 and 2"
            )
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            value = getattr(self, key)
            self._check(key, value is None or value > 0, "must be > 0 elements (or left out for rayzero's choice)")
        self._check("stage3_prefetch_bucket_size",
                    self.stage3_prefetch_bucket_size is None or self.stage3_prefetch_bucket_size >= 0,
                    "must be >= 0 elements (0 turns prefetch off; leave it out for two gather units)")
        names = [c.strip() for c in self.stage3_gather_unit.split(",")]
        self._check("stage3_gather_unit",
                    self.stage3_gather_unit in ("auto", "module") or all(c.isidentifier() for c in names),
                    '"auto", "module", or module class names separated by commas (such as '
                    '"LlamaDecoderLayer")')
        self._check("stage3_param_persistence_threshold", self.stage3_param_persistence_threshold >= 0,
                    "must be >= 0 elements")


@dataclass
class OptimizerConfig(_Section):
    """`optimizer`: a torch optimizer by name; `params` go to its constructor as written."""

    _path: ClassVar[str] = "optimizer"
    _inert: ClassVar[Mapping[str, Inert]] = {
        "legacy_fusion": inert_at(False, why="off", refuse="DeepSpeed's legacy fused optimizer"),
    }

    type: str = "AdamW"
    params: dict = field(default_factory=dict)

    def _validate(self) -> None:
        # Checked here so a bad optimizer fails when the config loads, not after workers start.
        from rayzero.optim.factory import resolve_optimizer

        resolve_optimizer(self)


@dataclass
class SchedulerConfig(_Section):
    """`scheduler`: one of DeepSpeed's schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)."""

    _path: ClassVar[str] = "scheduler"

    type: str
    params: dict = field(default_factory=dict)

    def _validate(self) -> None:
        from rayzero.optim.schedulers import resolve_scheduler

        resolve_scheduler(self)


@dataclass
class ActivationCheckpointingConfig(_Section):
    """`activation_checkpointing`: present, the engine checkpoints the model's repeated blocks
    (rayzero/activation_checkpointing.py); DeepSpeed's keys, the ones rayzero cannot honour refused."""

    _path: ClassVar[str] = "activation_checkpointing"

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None  # sizes DeepSpeed's contiguous buffers: nothing to size here
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False  # DeepSpeed's checkpoint timers; rayzero's wall_clock_breakdown times the phases

    def _validate(self) -> None:
        from rayzero.activation_checkpointing import refusals

        problems = refusals(self.to_dict())
        if problems:
            raise combine_problems([NotSupportedYetError(p) for p in problems])


@dataclass
class FP16Config(_Section):
    """`fp16`: fp16 compute with loss scaling (dynamic when loss_scale is 0)."""

    _path: ClassVar[str] = "fp16"
    _auto_means_default: ClassVar[bool] = True
    _not_supported: ClassVar[Mapping[str, str]] = {"fp16_opt_level": "NVIDIA Apex AMP's opt level"}
    _inert: ClassVar[Mapping[str, Inert]] = {
        "auto_cast": Inert(why="engine(x) casts floating-point inputs to the compute dtype either way"),
        "fp16_master_weights_and_grads": inert_at(False, why="the masters and gradients are fp32",
                                                  refuse="fp16 master weights and gradients"),
    }

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def _validate(self) -> None:
        self._check("loss_scale", math.isfinite(self.loss_scale) and self.loss_scale >= 0,
                    "must be a finite number >= 0 (0 means dynamic loss scaling)")
        # 2**128 overflows fp32, where the scale is kept.
        self._check("initial_scale_power", 0 <= self.initial_scale_power < 128, "must be in 0..127")
        self._check("loss_scale_window", self.loss_scale_window > 0, "must be > 0 steps")
        self._check("hysteresis", self.hysteresis > 0, "must be > 0")
        self._check("min_loss_scale", math.isfinite(self.min_loss_scale) and self.min_loss_scale > 0,
                    "must be a finite number > 0")


@dataclass
class BF16Config(_Section):
    """`bf16`: bf16 compute, fp32 master weights; no loss scaling needed."""

    _path: ClassVar[str] = "bf16"
    _auto_means_default: ClassVar[bool] = True
    _inert: ClassVar[Mapping[str, Inert]] = {
        "immediate_grad_update": inert_at(False, why="off", refuse="DeepSpeed's immediate bf16 gradient update"),
        "check_grad_overflow": Inert(why="rayzero checks the global gradient norm every step (nonfinite_grad)"),
        "bf16_master_weights_and_grads": inert_at(False, why="the masters and gradients are fp32",
                                                  refuse="bf16 master weights and gradients"),
        "bf16_optimizer_states": inert_at(False, why="the optimizer state is fp32", refuse="bf16 optimizer states"),
        # fp16's loss-scaling keys, often left in a config switched from fp16 to bf16
        **dict.fromkeys(("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                         "consecutive_hysteresis", "min_loss_scale"), Inert(why="bf16 uses no loss scaling")),
    }

    enabled: bool = False


@dataclass
class ExpertParallelConfig(_Section):
    """`expert_parallel` (DeepSpeed's AutoEP keys): spread each MoE layer's experts over `autoep_size` ranks."""

    _path: ClassVar[str] = "expert_parallel"
    _not_supported: ClassVar[Mapping[str, str]] = dict.fromkeys(
        ("moe_layer_pattern", "router_pattern", "expert_pattern", "score_func", "score_apply", "route_norm",
         "route_scale", "top_k", "routed_scaling_factor", "num_expert_groups", "num_limited_groups", "expert_w1",
         "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern"),
        "AutoEP's description of a custom MoE model; rayzero finds the experts of the preset models itself, or "
        "use rayzero.moe.MoE in your own model",
    )
    _inert: ClassVar[Mapping[str, Inert]] = {
        "expert_tensor_parallel_size": inert_at(1, why="experts are not tensor-parallel",
                                                refuse="tensor parallelism inside the experts"),
        "use_grouped_mm": Inert(why=f"{_TUNING}: how the experts' matmuls are batched"),
        "disable_triton_grouped_mm": Inert(why=f"{_TUNING}: how the experts' matmuls are batched"),
        "load_balance_coeff": inert_at(None, why="off", refuse="auxiliary-loss-free load balancing"),
    }

    enabled: bool = False
    autoep_size: int = 1
    preset_model: str | None = None

    def _validate(self) -> None:
        self._check("autoep_size", self.autoep_size >= 1, "must be an integer >= 1")
        if self.autoep_size > 1 and not self.enabled:
            raise ConfigError(
                f"config key 'expert_parallel.autoep_size' = {self.autoep_size} has no effect while "
                "'expert_parallel.enabled' is false; set enabled to true (or remove autoep_size)"
            )

    @property
    def size(self) -> int:
        return self.autoep_size if self.enabled else 1


@dataclass
class TensorParallelConfig(_Section):
    """`tensor_parallel` (DeepSpeed's AutoTP key): shard linears over `autotp_size` ranks by the model's
    tp_plan (or `tp_plan`, module-name patterns -> colwise / rowwise / packed_colwise)."""

    _path: ClassVar[str] = "tensor_parallel"
    _auto_means_default: ClassVar[bool] = True
    _not_supported: ClassVar[Mapping[str, str]] = {
        "preset_model": "AutoTP's model presets; rayzero reads the model's Hugging Face tp_plan, or write tp_plan",
        "partition_config": "AutoTP's layer specs; write rayzero's tp_plan (module-name patterns -> colwise / rowwise)",
    }
    _inert: ClassVar[Mapping[str, Inert]] = {
        "tp_overlap_comm": inert_at(False, why="off", refuse="overlapping the TP all-reduce with compute"),
    }

    autotp_size: int = 1
    tp_plan: dict | None = None

    def _validate(self) -> None:
        self._check("autotp_size", self.autotp_size >= 1, "must be an integer >= 1")


GRAPH_CAPTURE_TARGETS = ("step", "model")


@dataclass
class GraphCaptureConfig(_Section):
    """`graph_capture`: record the step (the norm's local sum; clip and optimizer update) into accelerator
    graphs and replay them, after `warmup_steps` eager steps; `"targets": ["model"]` also compiles the
    model's forward and backward.  Only on accelerators whose capture is declared working
    (rayzero.accelerator.graphs); anywhere else enabling it is an error, never an eager run."""

    _path: ClassVar[str] = "graph_capture"

    enabled: bool = False
    targets: list | None = None  # default ["step"]
    warmup_steps: int = 1
    cache_dir: str | None = None  # compiled artifacts loaded at set-up, written by rank 0 after capturing

    def _validate(self) -> None:
        self._check("warmup_steps", self.warmup_steps >= 1,
                    "must be an integer >= 1 (the optimizer's state must exist before the step is captured)")
        targets = [] if self.targets is None else self.targets
        bad = [t for t in targets if t not in GRAPH_CAPTURE_TARGETS]
        self._check("targets", not bad, f"must be a list of {' and '.join(repr(t) for t in GRAPH_CAPTURE_TARGETS)} "
                    "(the step is always captured; 'model' adds the model's forward and backward)")
        targets = ["step", *targets]
        object.__setattr__(self, "targets", list(dict.fromkeys(targets)))


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples split: train_batch_size = micro * accumulation * world."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int


_TOP_NOT_SUPPORTED = {
    "moe": "DeepSpeed's older MoE section; use expert_parallel",
    "compression_training": "DeepSpeed's compression library",
    "pipeline": "pipeline parallelism",
    "sparse_attention": "sparse attention kernels",
    "fp8": "fp8 training",
    "graph_harvesting": "graph harvesting",
    "compile": "DeepCompile; see graph_capture",
    "quantize_training": "quantization-aware training",
    "weight_quantization": "weight quantization",
    "timers": "DeepSpeed's throughput timers; wall_clock_breakdown times the step",
    "zero_optimization_stage": "write zero_optimization.stage",
}



def _checkpoint_inert(value: Any) -> bool:
    """DeepSpeed's checkpoint section: tag checks and universal loading are moot (rayzero checkpoints load at
    any world size; tags are directory names); node-local storage and pipeline-parallel writes are not."""
    if not isinstance(value, Mapping) or not set(value) <= {"tag_validation", "load_universal",
                                                              "use_node_local_storage", "parallel_write"}:
        return False
    write = value.get("parallel_write", {})
    return (value.get("use_node_local_storage", False) is False and isinstance(write, Mapping)
            and set(write) <= {"pipeline_stage"} and write.get("pipeline_stage", False) is False)


def _data_types_inert(value: Any) -> bool:
    return (isinstance(value, Mapping) and set(value) <= {"grad_accum_dtype"}
            and value.get("grad_accum_dtype") in (None, "fp32", "float32"))


_OFF = "off"
_DIVIDE = ("where the gradients are divided by the data-parallel size: rayzero divides before the reduction "
           "when communication_data_type is 16-bit and after it in fp32; the gradient is the same mean")
# DeepSpeed's top-level keys that have no effect in rayzero (at any value, or at the value shown).
_TOP_INERT = {
    # DeepSpeed's gradient with either (any factor) is the mean over the data-parallel ranks; the keys only
    # place the division around its all-reduce, which rayzero places by the reduction dtype (zero/reducer.py)
    "prescale_gradients": Inert(why=_DIVIDE, when=lambda v: isinstance(v, bool), refuse="a non-boolean value",
                                fix="set it to true or false"),
    "gradient_predivide_factor": Inert(
        why=_DIVIDE, refuse="a factor that is not a positive number", fix="set it to a number > 0 or remove it",
        when=lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0),
    "gradient_allreduce_op": inert_at("mean", why="rayzero averages gradients over the data-parallel ranks",
                                      refuse="summed instead of averaged gradients"),
    "sparse_gradients": inert_at(False, why=_OFF, refuse="sparse embedding gradients"),
    "zero_allow_untested_optimizer": Inert(
        why="rayzero runs every optimizer it builds on its ZeRO partitions; no permission is needed"),
    "zero_force_ds_cpu_optimizer": Inert(
        why="with offload rayzero steps torch's own optimizer on the host; there is no DeepSpeed CPU Adam to force"),
    "memory_breakdown": inert_at(False, why=_OFF, refuse="memory use printed with the timers"),
    "dump_state": inert_at(False, why=_OFF, refuse="printing the engine's state at start-up"),
    "disable_allgather": inert_at(False, why=_OFF, refuse="broadcasts instead of all-gathers"),
    "dataloader_drop_last": Inert(why="read only by rayzero.deepspeed's data loader (initialize's training_data, "
                                      "deepspeed_io); rayzero's own engine builds no loader"),
    "disable_python_gc": Inert(why=f"{_TUNING}: rayzero leaves Python's garbage collector as it is"),
    "log_level": Inert(why="DeepSpeed's own logger; rayzero logs to logger 'rayzero'"),
    # not a DeepSpeed key (DeepSpeedExamples' imagenet configs have it): DeepSpeed ignores it, as it ignores
    # every top-level key it does not know
    "cuda_visible_devices": Inert(why="not a DeepSpeed key, which DeepSpeed ignores too; the devices a rank sees "
                                      "are set by CUDA_VISIBLE_DEVICES in the launcher's environment"),
    "managed_gradient_accumulation": inert_at(
        True, why="rayzero steps at accumulation boundaries (DeepSpeed's default)",
        refuse="the caller choosing each boundary; use engine.set_gradient_accumulation_boundary"),
    "use_data_before_expert_parallelism": inert_at(False, why=_OFF, refuse="data order before expert parallelism"),
    "sequence_parallel_size": inert_at(1, why="one rank per sequence", refuse="sequence parallelism"),
    "seq_parallel_communication_data_type": Inert(why="read only with sequence parallelism"),
    "checkpoint": Inert(
        why="rayzero checkpoints load at any world size", when=_checkpoint_inert,
        refuse="node-local checkpoint storage or pipeline-parallel writes",
        fix="set use_node_local_storage and parallel_write.pipeline_stage to false, or remove them"),
    "data_types": Inert(why="gradients accumulate in fp32", when=_data_types_inert,
                        refuse="gradient accumulation in a 16-bit dtype",
                        fix='set grad_accum_dtype to "fp32" or remove the section'),
    "flops_profiler": inert_when_disabled("the flops profiler"),
    "comms_logger": inert_when_disabled("the communication logger"),
    "comet": inert_when_disabled("the Comet monitor; use tensorboard, wandb or csv_monitor"),
    "amp": inert_when_disabled("NVIDIA Apex AMP; use bf16 or fp16"),
    "torch_autocast": inert_when_disabled("torch.autocast around the forward; use bf16 or fp16"),
    "elasticity": inert_when_disabled("DeepSpeed's elastic batch sizes; rayzero.fit has its own elastic range"),
    "autotuning": inert_when_disabled("DeepSpeed's autotuner; see `rayzero tune`"),
    "curriculum_learning": inert_when_disabled("curriculum learning"),
    "data_efficiency": inert_when_disabled("data efficiency (sampling and routing)"),
    "progressive_layer_drop": inert_when_disabled("progressive layer drop"),
    "eigenvalue": inert_when_disabled("eigenvalue computation"),
    "nebula": inert_when_disabled("Nebula checkpointing"),
    "hybrid_engine": inert_when_disabled("the hybrid engine"),
}


@dataclass
class TensorBoardConfig(_Section):
    """`tensorboard`: rank 0 writes DeepSpeed's training events with torch's SummaryWriter to
    ``output_path/job_name`` (rayzero/monitor.py)."""

    _path: ClassVar[str] = "tensorboard"
    _auto_means_default: ClassVar[bool] = True

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass
class WandbConfig(_Section):
    """`wandb`: rank 0 logs DeepSpeed's training events to Weights & Biases (``team`` is wandb's entity)."""

    _path: ClassVar[str] = "wandb"
    _auto_means_default: ClassVar[bool] = True

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclass
class CSVMonitorConfig(_Section):
    """`csv_monitor`: rank 0 appends DeepSpeed's training events to one CSV file per event under
    ``output_path/job_name``, in DeepSpeed's layout."""

    _path: ClassVar[str] = "csv_monitor"
    _auto_means_default: ClassVar[bool] = True

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


_COMM_DTYPES = {
    "fp32": "fp32", "float32": "fp32",
    "fp16": "fp16", "float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
}
_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Config(_Section):
    """The whole training config. Build with `Config.from_any(dict | path | Config)`."""

    _path: ClassVar[str] = ""
    _not_supported: ClassVar[Mapping[str, str]] = _TOP_NOT_SUPPORTED
    _inert: ClassVar[Mapping[str, Inert]] = _TOP_INERT
    _aliases: ClassVar[Mapping[str, str]] = {"bfloat16": "bf16"}  # DeepSpeed's older spelling

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    gradient_clipping: float = 0.0
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    graph_capture: GraphCaptureConfig = field(default_factory=GraphCaptureConfig)
    communication_data_type: str | None = None
    seed: int = 1234
    deterministic: bool = False
    nonfinite_grad: str = "error"
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)

    @classmethod
    def _translate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """DeepSpeed's older ``"zero_optimization": true / false`` reads as stage 1 / stage 0 as DeepSpeed reads
        it (true also takes a top-level ``allgather_size`` as ``allgather_bucket_size``)."""
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):
            new: dict[str, Any] = {"stage": 1 if zero else 0}
            if zero and "allgather_size" in data:
                new["allgather_bucket_size"] = data.pop("allgather_size")
            note_inert("zero_optimization", zero, f"DeepSpeed's older form, read as {json.dumps(new)}")
            data["zero_optimization"] = new
        return data

    def _validate(self) -> None:
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            value = getattr(self, name)
            self._check(name, value is None or value > 0, "must be a positive integer (or left out to derive it)")
        self._check("gradient_clipping", math.isfinite(self.gradient_clipping) and self.gradient_clipping >= 0,
                    "must be a finite number >= 0 (0 turns clipping off)")
        if self.communication_data_type is not None:
            normal = _COMM_DTYPES.get(self.communication_data_type.lower())
            self._check("communication_data_type", normal is not None,
                        f"must be one of {', '.join(_COMM_DTYPES)}")
            self.communication_data_type = normal
        self._check("seed", 0 <= self.seed < 2**64, "must be in 0..2**64-1")
        self._check("nonfinite_grad", self.nonfinite_grad in ("error", "skip"), "must be 'error' or 'skip'")
        self._check("steps_per_print", self.steps_per_print >= 0, "must be >= 0 (0 turns step logging off)")
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "config enables both 'fp16.enabled' and 'bf16.enabled'; pick one compute precision"
            )

    # --- construction -------------------------------------------------------------------------------

    @classmethod
    def from_any(cls, obj: Config | Mapping[str, Any] | str | os.PathLike) -> Config:
        """A Config as is, a dict of DeepSpeed-style keys, or a path to a .json / .yaml / .yml file."""
        if isinstance(obj, Config):
            return obj
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        if isinstance(obj, (str, os.PathLike)):
            return cls.from_dict(_load_file(Path(obj)))
        raise ConfigError(
            f"cannot build a Config from {type(obj).__name__}; pass a Config, a dict, or a path to a "
            ".json/.yaml file"
        )

    # --- derived values -----------------------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def comm_dtype(self) -> torch.dtype:
        """Dtype gradients are reduced in: the explicit setting, else fp32 for accuracy."""
        return _TORCH_DTYPES[self.communication_data_type or "fp32"]

    def resolve_batch(self, world_size: int) -> BatchPlan:
        """Fill in whichever of the three batch keys are missing for this world size (see module doc)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        return _resolve_batch(
            self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps,
            world_size,
        )


def _load_file(path: Path) -> Any:
    if not path.exists():
        raise ConfigError(f"config file '{path}' does not exist")
    if not path.is_file():
        raise ConfigError(f"config path '{path}' is not a file")
    suffix = path.suffix.lower()
    text = path.read_text()
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file '{path}' is not valid JSON: {exc}") from exc
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from exc
        return {} if data is None else data
    raise ConfigError(f"config file '{path}' has suffix '{path.suffix}'; use .json, .yaml or .yml")


_TBS, _MBS, _GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def _resolve_batch(tbs: int | None, mbs: int | None, gas: int | None, world: int) -> BatchPlan:
    def divide(total: int, parts: list[tuple[str, int]], derived: str) -> int:
        product = math.prod(v for _, v in parts)
        if total % product:
            expr = " * ".join(f"{name} {v}" for name, v in parts)
            lower = (total // product) * product
            fixes = f"{lower} or {lower + product}" if lower else f"{product}"
            raise ConfigError(
                f"cannot derive {derived}: {_TBS} {total} is not divisible by {expr} = {product} "
                f"({total} / {product} = {total / product:g}); set {_TBS} to a multiple of {product} "
                f"(e.g. {fixes}) or change the other values"
            )
        return total // product

    if tbs is not None and mbs is not None and gas is not None:
        product = mbs * gas * world
        if tbs != product:
            hint = f"set {_TBS} to {product}"
            if tbs % (mbs * world) == 0:
                hint += f", or {_GAS} to {tbs // (mbs * world)}"
            if tbs % (gas * world) == 0:
                hint += f", or {_MBS} to {tbs // (gas * world)}"
            raise ConfigError(
                f"{_TBS} {tbs} != {_MBS} {mbs} * {_GAS} {gas} * world_size {world} = {product}; {hint}; "
                "or give only two of the three so the third follows the world size"
            )
    elif tbs is not None and mbs is not None:
        gas = divide(tbs, [(_MBS, mbs), ("world_size", world)], _GAS)
    elif tbs is not None and gas is not None:
        mbs = divide(tbs, [(_GAS, gas), ("world_size", world)], _MBS)
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * world
    elif tbs is not None:
        gas = 1
        mbs = divide(tbs, [("world_size", world)], _MBS)
    elif mbs is not None:
        gas = 1
        tbs = mbs * world
    elif gas is not None:
        mbs = 1
        tbs = gas * world
    else:
        mbs, gas = 1, 1
        tbs = world
    return BatchPlan(train_batch_size=tbs, micro_batch_size=mbs, gradient_accumulation_steps=gas, world_size=world)
