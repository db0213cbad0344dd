"""The Engine: one rank's view of a ZeRO-partitioned model.  Forward, backward, step.

The engine only composes: the layout and partitions (``zero/``), the gradient reducer and weight publisher
(``zero/reducer.py``, ``zero/publish.py``), the stage-3 parameter gatherer (``zero/stage3.py``), the fp32 global norm and loss
scaler (``optim/``), and torch's own optimizer running on the fp32 master partitions.
"""

from __future__ import annotations

import atexit
import logging
import math
import time
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from rayzero.accelerator import bind_rank_device, get_accelerator
from rayzero.accelerator.host_allocator import configure_host_allocator, end_of_set_up, give_back_now
from rayzero.checkpoint.engine_io import CheckpointIO
from rayzero.checkpoint.engine_io import load as checkpoint_load
from rayzero.checkpoint.format import CheckpointError
from rayzero.comm import init_distributed
from rayzero.config import Config, ConfigError, OptimizerConfig
from rayzero.determinism import apply_deterministic_policy
from rayzero.model_setup import apply_model_parallelism, broadcast_from_rank0, param_groups, place_on_device
from rayzero.optim.clip import clip_coefficient, global_grad_norm
from rayzero.optim.factory import build_optimizer
from rayzero.optim.schedulers import build_scheduler
from rayzero.monitor import build_monitor
from rayzero.optim.loss_scaler import LossScaler
from rayzero.parallel.slicing import canonical_to_full
from rayzero.parallel.state import ParallelState
from rayzero.topology import ParallelDims
from rayzero.zero.buckets import engine_bucket_plan
from rayzero.zero.grad_pool import GradientPool, pool_linear_gradients, unpool_linear_gradients
from rayzero.zero.partition import Partitions
from rayzero.zero.publish import ALIAS_ALONE_FROM, WaitForWeights, WeightPublisher
from rayzero.zero.reducer import GradientReducer
from rayzero.zero.init import materialize_frozen
from rayzero.zero.update import update, weights_can_be_shared
from rayzero.zero.stage3 import ParamGatherer, auto_units_are_blocks, freed_by_destroy
from rayzero.memory import sub_group_size
from rayzero.offload.optimizer import NvmeOptimizerSwap, check_model_states_fit, resolve_offload_device


logger = logging.getLogger("rayzero")
_live_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _finish_saves_at_exit() -> None:
    """A save still writing in the background completes before the process exits; swap files go."""
    for engine in list(_live_engines):
        engine._checkpoint.wait_local()
        engine._close_swap()


class NonFiniteGradientError(FloatingPointError):
    pass


class Engine:
    """Wraps ``model`` for ZeRO training.  Build it with :func:`rayzero.initialize`."""

    def __init__(self, model: torch.nn.Module, config: Any = None, model_parameters: Iterable | None = None):
        self.config = Config.from_any(config if config is not None else {})
        cfg = self.config
        self.accelerator = get_accelerator()
        self.host_allocator: dict | None = None  # set once the offload device is known (_build)
        bind_rank_device(self.accelerator)  # before the process group exists (rayzero/accelerator)
        self.rank, self.world_size, self._created_process_group = init_distributed()
        self.topology = self._plan_topology(cfg, self.world_size)
        if cfg.deterministic:
            # ranks of one TP group run the same replicated computation, so they share their random streams
            apply_deterministic_policy(cfg.seed, self.topology.coords(self.rank).dp, self.accelerator)
        self.batch = cfg.resolve_batch(self.topology.dp)
        self.stage = cfg.zero_optimization.stage
        self.compute_dtype = cfg.compute_dtype
        self.module = model
        transport = "ordered" if cfg.deterministic else "auto"
        self.parallel = ParallelState(self.topology, self.rank, transport)
        self.comm = self.parallel.world
        try:
            self._build(model, model_parameters)
        except BaseException:
            self.parallel.destroy()  # the groups made above would otherwise outlive a failed set-up
            unpool_linear_gradients(getattr(self, "_pooled_linears", []))
            blocks = getattr(self, "_checkpointed_blocks", None)
            if blocks:  # (activation checkpointing wraps the blocks' forward early in set-up)
                from rayzero.activation_checkpointing import unwrap_blocks

                unwrap_blocks(blocks)
            raise
        end_of_set_up()  # what set-up freed leaves the process, under either policy (host_allocator.py)
        _live_engines.add(self)

    def _build(self, model: torch.nn.Module, model_parameters: Iterable | None) -> None:
        """Everything past the process groups: slicing, partitions, reducer, optimizer."""
        cfg = self.config
        if cfg.graph_capture.enabled:
            from rayzero.capture import check_capture

            check_capture(self)
        if any(freed_by_destroy(p) for p in model.parameters()):
            raise RuntimeError(
                "the model's parameters were freed by the Engine.destroy() of a ZeRO stage 3 engine; load "
                "the weights back first (model.load_state_dict(state, assign=True) with a state from "
                "engine.full_state_dict() taken before destroy, or a checkpoint) or build a fresh model"
            )

        pre_sharded = any(hasattr(p, "_rayzero_shard") for p in model.parameters())
        if pre_sharded and self.stage != 3:
            raise ConfigError(
                f"the model was built under rayzero.zero_init, which only ZeRO stage 3 can train; "
                f"zero_optimization.stage is {self.stage}: set it to 3 or build the model without zero_init"
            )
        place_on_device(model, self.accelerator)
        broadcast_from_rank0(model, self.comm)
        if model_parameters is not None:
            model_parameters = list(model_parameters)  # read once: it may be a generator
        model_parameters = apply_model_parallelism(
            model, model_parameters, pre_sharded, cfg, self.topology, self.parallel, self.comm
        )
        groups = param_groups(model, model_parameters)
        names = {}
        for n, p in model.named_parameters():
            names.setdefault(p, n)

        params = [p for g in groups for p in g["params"]]
        device = params[0].device if params else self.accelerator.device()
        z = cfg.zero_optimization
        world_of = lambda p: self.parallel.domain_of(p).comm.world if self.stage else 1
        self.offload_device = resolve_offload_device(cfg, params, self.stage, world_of, self.accelerator)
        offload = self.offload_device != "none"
        # freed step buffers kept for reuse on a CPU device; given back where offload is on, whose point is to
        # hold less (rayzero/accelerator/host_allocator.py, which also says when it is left alone)
        self.host_allocator = configure_host_allocator(offload or z.offload_param.device != "none",
                                                       self.accelerator.name)
        # stages 0-2 keep the model's parameters (already allocated); stage 3 frees them after set-up
        kept = 0 if self.stage == 3 else sum(p.numel() * p.element_size() for p in params
                                             if not hasattr(p, "_rayzero_shard"))
        check_model_states_fit(cfg, params, world_of, self.stage, device.type, self.offload_device, kept,
                               accelerator=self.accelerator)
        # Stages 1-2 in fp32 with the ranks of a host sharing one copy of the weights (zero/publish.py): a
        # large parameter gets a partition group of its own, whose master is then the rank's row of the
        # shared weights, so the optimizer updates them in place and publishing copies nothing.
        alias = (self.stage in (1, 2) and self.compute_dtype == torch.float32 and device.type == "cpu"
                 and not offload and z.offload_param.device == "none" and weights_can_be_shared(self.parallel, params))
        deferred = (self.offload_device == "nvme" and self.stage == 3 and z.offload_param.device != "none"
                    and bool(params) and all(hasattr(p, "_rayzero_shard") for p in params))
        self.partitions = Partitions(
            groups, names, self.parallel.domain_of, partitioned=self.stage >= 1, device=device,
            alone_from=ALIAS_ALONE_FROM if alias else None,
            sub_group_size=sub_group_size(
                cfg, sum(-(-p.numel() // world_of(p)) for p in params), self.offload_device == "nvme"),
            state_device=torch.device("cpu") if offload else None,
            # pinned host memory only speeds up copies to an accelerator
            pin_memory=offload and z.offload_optimizer.pin_memory and device.type != "cpu",
            # optimizer on NVMe: the gradient partitions live in the swap store (offload/gradients.py), and at
            # stage 3 with parameter offload, on a model built under zero_init, the masters are built one
            # sub-group at a time straight into it (offload/optimizer.py), from the shards (without parameter
            # offload stage 3 may share its weights on the host, which reads the masters first; a model built
            # whole is in memory anyway, and the gatherer frees its parameters before the swap exists)
            swapped=self.offload_device == "nvme",
            deferred_masters=deferred,
        )
        self.partitions.load_masters_from_params()
        give_back_now()  # with offload: the zero_init shards just freed leave the process
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype.is_floating_point and p.dtype != self.compute_dtype and not hasattr(p, "_rayzero_shard"):
                    p.data = p.data.to(self.compute_dtype)
        for p in model.parameters():
            if hasattr(p, "_rayzero_shard") and not p.requires_grad:
                materialize_frozen(p, self.comm)  # frozen: not partitioned, so whole on every rank
        persistent = cfg.zero_optimization.stage3_param_persistence_threshold
        for p in self.partitions.all_params():
            if hasattr(p, "_rayzero_shard"):
                # The fp32 shard now lives in the master partition.  Only a persistent parameter gets real
                # storage (filled by the publisher); the others keep their one-element stand-in until the
                # gatherer frees them, so no rank ever holds a whole one during set-up.
                if p.numel() <= persistent:
                    p.data = torch.empty(p.shape, dtype=self.compute_dtype, device=device)
                else:
                    p.data = torch.zeros(1, dtype=self.compute_dtype, device=device).expand(p.shape)
                if not deferred:  # (deferred: the optimizer swap reads the shards, below)
                    del p._rayzero_shard

        self.gatherer: ParamGatherer | None = None
        if self.stage == 3:
            self.gatherer = ParamGatherer(
                model,
                self.partitions,
                self.compute_dtype,
                z.stage3_param_persistence_threshold,
                prefetch=z.overlap_comm and z.stage3_prefetch_bucket_size != 0,
                accelerator=self.accelerator,
                unit_rule=z.stage3_gather_unit,
                prefetch_elements=z.stage3_prefetch_bucket_size,
                auto_blocks=auto_units_are_blocks(z),
            )
        self._checkpointed_blocks = self._checkpoint_activations(model)
        self.buckets = engine_bucket_plan(model, self.partitions, self.parallel.dp, cfg, self.rank)
        # under the keep policy, nn.Linear's weight gradients come from buffers the reducer hands back, so
        # the heap is not left with a hole per gradient (zero/grad_pool.py)
        grad_pool = (GradientPool() if self.host_allocator is not None and self.host_allocator["policy"] == "keep"
                     and not cfg.graph_capture.enabled else None)
        self.reducer = GradientReducer(
            self.partitions,
            # with offload, stage 1 reduces every backward into its one host accumulator per group, as
            # stage 2 does, instead of keeping a full-size gradient buffer
            2 if offload and self.stage == 1 else self.stage,
            self.buckets.reduce_bucket_size,
            cfg.comm_dtype,
            self.topology.dp,
            on_param_reduced=self.gatherer.on_param_reduced if self.gatherer else None,
            grad_pool=grad_pool,
            max_inflight=GradientReducer.inflight_for(z),
        )
        self._pooled_linears = (pool_linear_gradients(model, set(self.reducer.bucket_of), grad_pool)
                                if grad_pool is not None else [])
        # stage 3 on one host: the ranks may keep one copy of the weights instead of gathering them
        share3 = (self.gatherer is not None and z.offload_param.device == "none" and device.type == "cpu"
                  and (z.stage3_share_weights if z.stage3_share_weights is not None
                       else self.gatherer.sharing_costs_no_more(self.compute_dtype)))
        self.publisher = WeightPublisher(
            self.partitions,
            self.buckets.allgather_bucket_size,
            self.compute_dtype,
            params=None if share3 else self.gatherer.persistent if self.gatherer is not None else None,
            # stages 1-2 (and stage 3 where chosen): the ranks of a host keep one copy of the weights
            # (zero/publish.py)
            share=self.stage in (1, 2) or share3,
            only_if_shared=set(self.gatherer.managed) if share3 else None,
            alias_masters=alias,
            overlap=z.overlap_param_gather and self.stage in (1, 2),
        )
        if share3:
            self.gatherer.adopt(self.publisher.shared_params)
        if self.gatherer is not None and not offload and z.offload_param.device == "none":
            # gathers copy every rank's shard from where its owner keeps it (ranks on one host); a group
            # whose weights its ranks share is never gathered from
            gathered = [g for g in self.partitions.groups if any(p in self.gatherer.managed_set for p in g.params)]
            self.partitions.expose_weight_sources(self.compute_dtype, gathered)
        # Stage 0 in fp32: the parameters themselves become views of the master, so the optimizer updates
        # them in place and there is nothing to publish (and no second fp32 copy of the weights).
        self._params_alias_master = self.stage == 0 and self.compute_dtype == torch.float32
        if self._params_alias_master:
            with torch.no_grad():
                for g in self.partitions.groups:
                    for p, e in zip(g.params, g.layout.entries):
                        p.data = self.partitions.master_shard(e)[: e.numel].view(e.shape)
        self.optimizer = build_optimizer(
            self._optimizer_config(), [dict(params=[g.master], **g.overrides) for g in self.partitions.groups]
        )
        self.swap: NvmeOptimizerSwap | None = None
        self._rank_swap: RankSwap | None = None
        if "nvme" in (self.offload_device, z.offload_param.device):
            from rayzero.offload.rank_swap import RankSwap

            unit_shards = max(([self.partitions.entry_of[p].chunk for p in u.params]
                               for u in (self.gatherer.units if self.gatherer is not None else [])),
                              key=sum, default=None)
            self._rank_swap = RankSwap(cfg, self.rank, self.partitions, self.optimizer, self.compute_dtype, device,
                                       optimizer_nvme=self.offload_device == "nvme", unit_shards=unit_shards)
            self.swap = self._rank_swap.optimizer_swap
        elif z.offload_param.device == "cpu":
            # stage 3's weight partitions in host memory, in the compute dtype: gathers read them from there
            for g in self.partitions.groups:
                g.weights = g.master.detach().to(device="cpu", dtype=self.compute_dtype, copy=True)
                if z.offload_param.pin_memory and device.type != "cpu":
                    g.weights = self.accelerator.pin_memory(g.weights)
        if self.gatherer is not None:
            # stage 3's persistent parameters, whole in the compute dtype: read where the weights now live
            # (with NVMe offload the masters were only built just above)
            self.publisher.publish()
        for p in params:
            if hasattr(p, "_rayzero_shard"):  # the deferred masters' shards, read by now
                del p._rayzero_shard
        user_groups = len(model_parameters) if model_parameters and isinstance(model_parameters[0], dict) else 1
        self.lr_scheduler = build_scheduler(
            cfg.scheduler, self.optimizer, [g.user_group for g in self.partitions.groups], user_groups
        )
        if cfg.graph_capture.enabled and getattr(self.lr_scheduler, "cycle_momentum", False):
            raise ConfigError(
                "scheduler OneCycle with cycle_momentum sets the optimizer's betas every step, and a captured "
                "step keeps the betas it was recorded with; set 'scheduler.params.cycle_momentum' to false or "
                "'graph_capture.enabled' to false"
            )
        self.loss_scaler = LossScaler.from_fp16_config(cfg.fp16)
        self.monitor = build_monitor(cfg, self.rank)  # tensorboard / wandb / csv_monitor (rank 0)
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0  # samples consumed by optimizer steps, across all ranks
        self.global_grad_norm: float | None = None
        self.load_report: list[str] = []
        self._manual_boundary: bool | None = None
        self._destroyed = False
        # wall_clock_breakdown: seconds spent in forward / backward / step since the last report
        self._timings = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._checkpoint = CheckpointIO(self)
        self._capture = None
        if cfg.graph_capture.enabled:
            from rayzero.capture import setup_capture

            self._capture = setup_capture(self)

    @property
    def _swap_store(self):
        """The rank's swap store (NVMe offload), else None."""
        return self._rank_swap.store if self._rank_swap is not None else None

    def _close_swap(self) -> None:
        if self._rank_swap is not None:
            self._rank_swap.close()
        self._rank_swap = self.swap = None

    # ---- set-up helpers --------------------------------------------------------------------------------
    def _checkpoint_activations(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """With an ``activation_checkpointing`` section: checkpoint the model's blocks (the blocks stage 3
        gathers as units; rayzero/activation_checkpointing.py)."""
        ac = self.config.activation_checkpointing
        if ac is None:
            return []
        from rayzero.activation_checkpointing import checkpoint_blocks

        entry_of = self.partitions.entry_of
        return checkpoint_blocks(
            model, self.config.zero_optimization.stage3_gather_unit,
            lambda p: entry_of[p].numel if p in entry_of else p.numel(),
            self.accelerator.synchronize if ac.synchronize_checkpoint_boundary else None,
        )

    @staticmethod
    def _plan_topology(cfg: Config, world_size: int) -> ParallelDims:
        tp, ep = cfg.tensor_parallel.autotp_size, cfg.expert_parallel.size
        try:
            return ParallelDims(world_size, tp=tp, ep=ep)
        except ValueError as e:
            raise ConfigError(
                f"tensor_parallel.autotp_size={tp} and expert_parallel.autoep_size={ep} do not fit a world of "
                f"{world_size} ranks: {e}"
            ) from None

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank feeds (the ranks of one TP group feed the same batch)."""
        return self.parallel.dp_rank

    @property
    def dp_world_size(self) -> int:
        """How many distinct data shards one step consumes: world size / TP size."""
        return self.parallel.dp_size

    def _optimizer_config(self) -> OptimizerConfig:
        """The configured optimizer, with torch's fused Adam/AdamW kernel unless the config chose an
        implementation: on one flat partition per group the default kernel allocates two partition-sized
        temporaries per step and runs ~5x slower (bench/README.md)."""
        opt = self.config.optimizer or OptimizerConfig()
        chosen = {"fused", "foreach", "capturable", "differentiable"} & set(opt.params)
        if opt.type.lower() in ("adam", "adamw") and not chosen and self.accelerator.supports_fused_optimizer():
            opt = OptimizerConfig(type=opt.type, params={**opt.params, "fused": True})
        if self.config.graph_capture.enabled:  # what a captured step needs (CUDA: no reads of the device)
            from rayzero.capture import capture_optimizer_config

            opt = capture_optimizer_config(opt, self.accelerator.name)
        return opt

    # ---- accumulation boundary -------------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._manual_boundary is not None:
            return self._manual_boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Take manual control of boundaries (``None`` hands it back to ``gradient_accumulation_steps``)."""
        self._manual_boundary = is_boundary

    # ---- forward / backward / step ---------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._check_alive()
        if self.compute_dtype != torch.float32:
            # Floating-point inputs follow the compute dtype so users need not cast batches themselves.
            cast = lambda t: t.to(self.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        start = self._clock()
        if self.publisher.pending:  # overlap_param_gather: the last step's gathers are still running
            with WaitForWeights(self.publisher):
                out = self.module(*args, **kwargs)
            self.publisher.finish()
        else:
            out = self.module(*args, **kwargs)
        self._timings["forward"] += self._clock() - start
        return out

    def wait_for_weights(self) -> None:
        """With ``overlap_param_gather``, the model's parameters fill in during the next forward; this
        completes them now (for reading them outside a forward). Every other engine call does it itself."""
        self._check_alive()
        self.publisher.finish()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale)."""
        self._check_alive()
        self.publisher.finish()
        if self.monitor is not None:
            self.monitor.record_loss(loss, self.gradient_accumulation_steps, self.global_steps)
        self.reducer.reduce_now = self.reducer.stage >= 2 or self.is_gradient_accumulation_boundary()
        scale = self.loss_scaler.scale / self.gradient_accumulation_steps
        scaled = loss.float() * scale if scale != 1.0 else loss
        start = self._clock()
        try:
            scaled.backward()
        finally:
            self.reducer.flush()
            if self.gatherer is not None:
                self.gatherer.release_all()
                self.gatherer.end_first_step()
            self._timings["backward"] += self._clock() - start

    def step(self) -> None:
        """The optimizer step at an accumulation boundary; between boundaries only counts the micro-step."""
        self._check_alive()
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        start = self._clock()
        self.publisher.finish()  # no gather still reads the partitions the update rewrites
        self._checkpoint.before_update()  # an async save has copied the state this step overwrites
        if self.reducer.pending:  # boundary decided after the backward (manual boundaries): reduce now
            self.reducer.reduce_now = True
            self.reducer.flush()
        self.reducer.zero_stale()
        self.partitions.settle_exposed_reads()  # the update rewrites what the others gather from
        unscale = self.reducer.grad_scale() / self.loss_scaler.scale
        # stage 0 without EP/TP: every rank holds the whole reduced gradient, so the local sum is global
        replicated = self.stage == 0 and self.parallel.groups is None
        capture = self._capture if self._capture is not None and self._capture.active() else None
        local = capture.local_sq_sum(replicated) if capture else self.partitions.local_grad_sq_sum(replicated)
        raw = global_grad_norm(local, None if replicated else self.comm)
        norm = raw * unscale
        self.global_grad_norm = norm
        if not math.isfinite(norm):
            self._skip_or_raise(norm)
        else:
            multiplier = unscale * clip_coefficient(norm, self.config.gradient_clipping)
            if capture:
                capture.update(multiplier)
            else:
                self._host_copies_done()
                update(self.optimizer, self.partitions, self.swap, multiplier)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if not self._params_alias_master:
                self.publisher.publish()
            self.loss_scaler.update(overflow=False)
        if self.stage == 0:
            self.partitions.zero_grads()
        else:  # the next window's first reductions overwrite the partitions (zero/reducer.py)
            self.reducer.forget()
        self.global_steps += 1
        self.micro_steps += 1
        self.global_samples += self.batch.train_batch_size
        self._timings["step"] += self._clock() - start
        if self.monitor is not None:
            self.monitor.after_step(self)
        self._report()

    def _clock(self) -> float:
        """Wall-clock time for wall_clock_breakdown: the device's queued work is waited for first, so a
        phase's time is its kernels' and not only their launch (no wait when the breakdown is off)."""
        if self.config.wall_clock_breakdown:
            self.accelerator.synchronize()
        return time.perf_counter()

    def _report(self) -> None:
        """Every ``steps_per_print`` steps, rank 0 logs progress (and timings with wall_clock_breakdown)."""
        every = self.config.steps_per_print
        if not every or self.global_steps % every or self.rank != 0:
            return
        msg = (
            f"step {self.global_steps}: grad norm {self.global_grad_norm:.4g}, "
            f"lr {', '.join(f'{lr:.3g}' for lr in self.get_lr())}, "
            f"skipped {self.skipped_steps}"
        )
        if self.config.fp16.enabled:
            msg += f", loss scale {self.loss_scaler.scale:g}"
        if self.config.wall_clock_breakdown:
            msg += ", ms/step " + ", ".join(f"{k} {1000 * v / every:.1f}" for k, v in self._timings.items())
        logger.info(msg)
        self._timings = dict.fromkeys(self._timings, 0.0)

    def _skip_or_raise(self, norm: float) -> None:
        step = self.global_steps + 1
        if self.config.fp16.enabled or self.config.nonfinite_grad == "skip":
            self.skipped_steps += 1
            self.loss_scaler.update(overflow=True)
            return
        self.partitions.zero_grads()
        # The window is spent: count it, so the next backward starts a fresh accumulation window.
        self.skipped_steps += 1
        self.global_steps += 1
        self.micro_steps += 1
        raise NonFiniteGradientError(
            f"the global gradient norm is {norm} at step {step}; the step was not taken. Lower the learning "
            "rate, check the data and loss for inf/nan, or set \"nonfinite_grad\": \"skip\" to skip such steps"
        )

    def zero_grad(self) -> None:
        """Drop accumulated gradients (the engine zeroes them itself after every step)."""
        self.reducer.zero_local()
        self.partitions.zero_grads()

    # ---- results ---------------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        """The learning rate of each of the user's param groups (a group holding dense parameters and
        experts is two optimizer groups inside, stepped with the same rate)."""
        lrs: dict[int, float] = {}
        # a captured step keeps the lr as a device tensor: the capture knows its value without reading it
        host = self._capture.host_lrs() if self._capture is not None else None
        for i, (g, group) in enumerate(zip(self.partitions.groups, self.optimizer.param_groups)):
            lrs.setdefault(g.user_group, host[i] if host is not None else float(group["lr"]))
        return [lrs[k] for k in sorted(lrs)]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def full_state_dict(self, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights (and buffers) under the model's own names and order, on every rank.

        A collective: call it on every rank.  It gathers one parameter at a time
        (``rayzero.zero.export``): with ``rank0_only`` only global rank 0 keeps the result (the other
        ranks get an empty dict and peak at about one parameter), with ``cpu_offload`` every tensor is
        moved to host memory as soon as it is gathered.
        """
        from rayzero.zero.export import full_state_dict

        self.publisher.finish()
        return full_state_dict(self, rank0_only=rank0_only, cpu_offload=cpu_offload)

    def _unslice(self, local: torch.Tensor, entry) -> torch.Tensor:
        """The model's full tensor from every rank's EP/TP slice of it (all ranks take part)."""
        if not entry.splits:
            return local
        rows = torch.empty((self.world_size, local.numel()), dtype=local.dtype, device=local.device)
        self.comm.all_gather(rows, local.reshape(-1).contiguous()).wait()
        by_slice: dict[int, torch.Tensor] = {}
        for r in range(self.world_size):
            by_slice.setdefault(self.parallel.slice_index_of(r, entry.splits), rows[r])
        canonical = torch.cat([by_slice[i] for i in range(len(by_slice))])
        return canonical_to_full(canonical, entry.shape, entry.splits)

    # ---- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: Any = None, async_save: bool = False
    ) -> str:
        """Save a universal checkpoint under ``save_dir/tag`` (every rank writes its own fragments).

        ``save_dir`` is a local path or a pyarrow.fs URI.  ``async_save`` snapshots the fragments to CPU
        memory and writes them on a background thread; the next save, ``load_checkpoint``, ``destroy`` or
        process exit waits for it, and a failed background write raises there.  Returns the tag.
        """
        self._check_alive()
        self.publisher.finish()
        # (with NVMe offload the optimizer's sub-groups are read one at a time while they are written)
        return self._checkpoint.save(save_dir, tag, client_state, async_save)

    def _host_copies_done(self) -> None:
        """Before host partitions are rewritten (a step, a load): no copy to the device still reads them (stage
        3 copies pinned host shards with non_blocking; a forward without a backward leaves them unfenced)."""
        if self.gatherer is not None:
            self.gatherer.staging.synchronize()

    def load_checkpoint(self, load_dir: str, tag: str | None = None, strict: bool = True) -> Any:
        """Load a universal checkpoint saved at any world size and stage; returns its ``client_state``.

        ``tag`` defaults to the one ``save_dir/latest`` names.  With ``strict=False`` parameters that do
        not match are left as they are and listed in ``self.load_report``.
        """
        self._check_alive()
        self.publisher.finish()
        self._checkpoint.wait()
        self._host_copies_done()
        self.partitions.settle_exposed_reads()
        self.reducer.zero_local()
        self.partitions.zero_grads()
        error = None
        try:
            # (with NVMe offload each sub-group is loaded into a swap buffer and written to its files)
            client_state, self.load_report = checkpoint_load(self, load_dir, tag, strict)
        except Exception as e:  # every rank must agree before anyone continues
            error = e
        failed = self.comm.any_rank(error is not None)
        if error is not None:
            raise error
        if failed:
            raise CheckpointError("loading the checkpoint failed on another rank (see its error)")
        self.partitions.refresh_weights()
        if not self._params_alias_master:
            self.publisher.publish()
        if self._capture is not None:
            self._capture.invalidate()  # the load gave the optimizer new state tensors: record again
        return client_state

    # ---- tear-down -------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this rayzero Engine was destroyed; build a new one with rayzero.initialize")

    def destroy(self) -> None:
        """Free partitions, buckets, hooks and (if the engine created it) the process group.

        No collective gathers the model.  Stages 0-2 leave it whole, holding the latest weights in the
        compute dtype.  At stage 3 only the persistent (small) parameters stay whole; the others were only
        ever shards in the partitions freed here, so each is left as a one-element NaN stand-in of its
        shape, and running a module that owns one raises an error that says so.  To keep the weights, take ``full_state_dict()`` (or stream
        them with ``rayzero.zero.export.iter_full_state_dict``) or save a checkpoint before ``destroy()``.
        """
        if self._destroyed:
            return
        self.publisher.finish()  # stages 1-2 leave the model whole
        self._checkpoint.wait()
        self._checkpoint.release()
        self._close_swap()  # the rank's swap files go with the engine
        if self.monitor is not None:
            self.monitor.close()
        _live_engines.discard(self)
        self.reducer.remove_hooks()
        unpool_linear_gradients(self._pooled_linears)
        if self._checkpointed_blocks:
            from rayzero.activation_checkpointing import unwrap_blocks

            unwrap_blocks(self._checkpointed_blocks)
        # the model outlives the engine: each rank keeps its own weights (stage 3's shared ones become
        # stand-ins below, as gathered ones do)
        self.publisher.unshare(drop=self.gatherer.shared if self.gatherer is not None else ())
        if self.gatherer is not None:
            self.gatherer.close()  # stage 3: frees the gathered parameters, gathers nothing
        self.optimizer.state.clear()
        self.optimizer.param_groups.clear()
        self.lr_scheduler = None
        for g in self.partitions.groups:
            g.master = g.grad = torch.empty(0)
            g.params = []
        self.partitions.entry_of.clear()
        self.reducer = self.publisher = self.gatherer = self._capture = None
        self._destroyed = True
        self.parallel.destroy()
        if self._created_process_group and dist.is_initialized():
            dist.destroy_process_group()


def initialize(model: torch.nn.Module, config: Any = None, model_parameters: Iterable | None = None) -> Engine:
    """Wrap ``model`` in a ZeRO :class:`Engine` (config: dict, JSON/YAML path or :class:`rayzero.Config`)."""
    return Engine(model, config, model_parameters)
