"""``rayzero.deepspeed.zero``: DeepSpeed's ``zero.Init`` and ``zero.GatheredParameters``.

``Init`` is :func:`rayzero.zero_init` under DeepSpeed's arguments.  ``GatheredParameters`` gathers
parameters of a live ZeRO stage-3 engine whole on every rank for the duration of a ``with`` block (each
from the fp32 master shards, in the compute dtype); with ``modifier_rank`` the values that rank holds at
the end of the block become every rank's weights (its fp32 masters, and the copies the engine computes
with).  Changes made without ``modifier_rank`` are dropped, as with DeepSpeed.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from rayzero.config import Config, ConfigError, NotSupportedYetError
from rayzero.zero.init import zero_init
from rayzero.zero.layout import shard_of
from rayzero.zero.stage3 import _mark_gathered, _mark_released

__all__ = ["GatheredParameters", "Init"]

logger = logging.getLogger("rayzero")


class Init:
    """``with Init(config_dict_or_path=ds_config): model = MyModel()``: build a model for ZeRO stage 3
    with each module's parameters sharded as its constructor returns (:func:`rayzero.zero_init`).

    ``config_dict_or_path`` (or ``config``) is the training config; its ``offload_param`` /
    ``offload_optimizer`` sections decide where shards are kept, so ``remote_device`` must agree with
    ``offload_param.device`` when given.  ``enabled=False`` builds the model normally.  ``dtype`` is
    accepted: rayzero builds in fp32 and casts to the compute dtype at ``initialize``.  Partitioning an
    already built module (``module=``) and custom process groups are not supported yet."""

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None):
        if module is not None:
            raise NotSupportedYetError(
                "rayzero.deepspeed.zero.Init(module=...) (partitioning a model already built) is not supported "
                "yet; build the model inside `with zero.Init(...)`, or pass it whole to initialize")
        for name, value in (("data_parallel_group", data_parallel_group), ("mpu", mpu),
                            ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group),
                            ("param_swapper", param_swapper)):
            if value is not None:
                raise NotSupportedYetError(f"rayzero.deepspeed.zero.Init({name}=...) is not supported yet; "
                                           "zero.Init shards over the default process group")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise NotSupportedYetError("rayzero.deepspeed.zero.Init: quantized weights are not supported yet")
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.enabled = enabled
        if enabled and remote_device not in (None, "none"):
            configured = Config.from_any(self.config).zero_optimization.offload_param.device if self.config else "none"
            if configured != remote_device:
                raise ConfigError(
                    f"zero.Init(remote_device={remote_device!r}) but the config's zero_optimization.offload_param."
                    f"device is {configured!r}: rayzero keeps the shards where the config says; set "
                    f'"offload_param": {{"device": "{remote_device}"}} in the config (and pass it as '
                    "config_dict_or_path) or leave remote_device out")
        self._context = None

    def __enter__(self):
        if self.enabled:
            self._context = zero_init(config=self.config)
            self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self._context is not None:
            context, self._context = self._context, None
            return context.__exit__(*exc)
        return False


def _engine_of(params: list[torch.nn.Parameter]):
    """The live rayzero engine that trains ``params`` (None when no engine holds any of them)."""
    from rayzero.engine import _live_engines

    for engine in list(_live_engines):
        if not engine._destroyed and any(p in engine.partitions.entry_of for p in params):
            return engine
    return None


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=None, enabled=True): ...``

    Inside the block every parameter in ``params`` (one parameter or an iterable) that ZeRO stage 3
    keeps partitioned is whole on every rank, in the compute dtype.  It is a collective: call it on every
    rank with the same parameters in the same order.  On exit, with ``modifier_rank`` set, the values that
    rank holds are broadcast and written into every rank's fp32 master partition (and the weights the
    engine computes with), at any stage; without it, changes are dropped and stage 3's parameters are
    partitioned again.  Parameters that no engine trains (a model before ``initialize``) are left alone.
    Do not run the model's forward inside the block.  ``fwd_module`` is accepted and not used."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(dict.fromkeys(p for p in (params or []) if isinstance(p, torch.Tensor)))
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.engine = _engine_of(self.params) if enabled and self.params else None
        self._gathered: list[torch.nn.Parameter] = []
        self._before: dict[int, torch.Tensor] = {}

    def __enter__(self):
        engine = self.engine
        if engine is None:
            if self.enabled and any(hasattr(p, "_rayzero_shard") for p in self.params):
                raise NotSupportedYetError(
                    "GatheredParameters on parameters built under zero.Init before initialize is not supported "
                    "yet: their shards are not gathered and a change to them would be lost; set their values in "
                    "the module's constructor, or after initialize inside GatheredParameters(params, "
                    "modifier_rank=0)")
            return self
        engine._check_alive()
        engine.publisher.finish()
        entry_of = engine.partitions.entry_of
        self.params = [p for p in self.params if p in entry_of]
        sliced = [entry_of[p].name for p in self.params if entry_of[p].splits]
        if sliced:
            raise NotSupportedYetError(
                f"GatheredParameters on parameters sliced by tensor or expert parallelism ({', '.join(sliced)}) "
                "is not supported yet; take them whole with engine.full_state_dict()")
        managed = engine.gatherer.managed_set if engine.gatherer is not None else set()
        # a parameter the gatherer holds gathered already (a forward whose backward has not run) stays as it is
        held = engine.gatherer.gathered if engine.gatherer is not None else set()
        with torch.no_grad():
            for p in self.params:
                if p in managed and p not in held:
                    e = entry_of[p]
                    p.data = engine.partitions.gather_full(e).to(engine.compute_dtype)
                    _mark_gathered(p)
                    self._gathered.append(p)
            # with a modifier rank, only the elements it changes are written back: the others keep their fp32
            # master values (the gathered copy is in the compute dtype)
            self._before = ({id(p): p.data.detach().clone() for p in self.params}
                            if self.modifier_rank is not None else {})
        return self

    def __exit__(self, *exc):
        engine = self.engine
        if engine is None:
            return False
        try:
            if self.modifier_rank is not None and exc[0] is None:
                self._write_back(engine)
        finally:
            if engine.gatherer is not None:
                for p in self._gathered:
                    p.data = engine.gatherer._placeholder
                    _mark_released(p)
            self._gathered = []
            self._before = {}
        return False

    @torch.no_grad()
    def _write_back(self, engine) -> None:
        """The modifier rank's values of the parameters become every rank's master shards and weights."""
        parts = engine.partitions
        engine._host_copies_done()
        parts.settle_exposed_reads()
        touched = {}
        gathered = {id(p) for p in self._gathered}
        for p in self.params:
            e = parts.entry_of[p]
            g = parts.group_of(e)
            value = p.data.detach().to(device=parts.device, dtype=torch.float32).reshape(-1).contiguous()
            if value.numel() != e.numel:
                raise RuntimeError(
                    f"GatheredParameters: parameter {e.name!r} holds {value.numel()} elements at the end of the "
                    f"block, {e.numel} expected; keep its shape (and do not run the model's forward in the block)")
            changed = (p.data != self._before[id(p)]).reshape(-1).to(device=parts.device, dtype=torch.float32)
            if engine.world_size > 1:  # the values and which of them changed, in one broadcast
                both = torch.cat([value, changed])
                engine.comm.broadcast(both, src=self.modifier_rank)
                value, changed = both[: e.numel], both[e.numel:]
            if g.master.numel() != g.layout.partition_numel:
                raise NotSupportedYetError(
                    f"GatheredParameters(modifier_rank=...) on {e.name!r}, whose optimizer state is offloaded to "
                    "NVMe, is not supported yet; change the weights before initialize")
            out = parts.master_shard(e)
            new, mask = out.clone(), torch.zeros_like(out)
            if g.world > 1:
                shard_of(value, e, g.rank, new)
                shard_of(changed, e, g.rank, mask)
            else:  # not partitioned (stage 0): the rank holds the whole parameter
                new[: e.numel].copy_(value)
                mask[: e.numel].copy_(changed)
            out.copy_(torch.where(mask.bool(), new, out))
            if id(p) not in gathered and p.data.data_ptr() != out.data_ptr():
                # whole on every rank (stages 0-2, stage 3's persistent ones): every copy takes the value
                p.data.copy_(value.view(e.shape).to(p.dtype))
            touched[e.group_index] = g
        parts.refresh_weights(list(touched.values()))
        if not engine._params_alias_master:
            engine.publisher.publish()
