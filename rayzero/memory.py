"""The memory model: what one rank holds, in bytes, for a config (docs/design.md "Memory per rank").

The only place rayzero computes these numbers.  Everything that decides from them reads them here: the
engine's start-up check and ``offload_optimizer.device: "auto"`` (rayzero/offload/optimizer.py),
``rayzero.fit``'s pre-launch plan check and its "auto" on the driver (rayzero/train/state_memory.py,
rayzero/train/offload_check.py), the swap-space check before launch, and ``rayzero tune`` (through the
plan check).

Pure arithmetic over the model's parameters (the model may be on the meta device): no process group, no
Ray.  Three levels:

* per trainable parameter: :func:`state_bytes_per_param` (weights, fp32 master, fp32 gradients, optimizer
  state for a stage, a partition size ``W``, the compute dtype and the offload settings), the table of
  docs/design.md; :func:`ram_bytes_per_param` and :func:`device_and_host_bytes_per_param` are its total and
  its split between an accelerator and the host;
* per rank for a list of parameters (:class:`Share`: the elements a rank holds of a parameter and how many
  ranks its partition is split over): :func:`states_bytes`, which the engine (its own, already sliced
  parameters: :func:`engine_shares`) and the driver (the whole model cut by tp / ep: :func:`model_shares`)
  both call;
* one rank's whole memory for a config: :func:`rank_memory` -> :class:`RankMemory` (model states, stage 3's
  gathers, buckets, autograd's gradient in flight, the NVMe swap pools, activations given by the caller, and
  for ranks that share a host the weights it keeps once for them and the shared-memory transport's segment):
  what a rank's peak RSS is compared with.

``W`` below is the number of ranks a parameter's ZeRO partition is split over (its domain: data-parallel
ranks for dense parameters, expert-data-parallel ones for experts).  Padding (under ``W`` elements per
parameter) is ignored by the per-parameter figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

GIB = 1 << 30
FP32 = 4


# ---- the config's figures ------------------------------------------------------------------------------
def optimizer_state_bytes(cfg) -> int:
    """fp32 optimizer state per parameter: AdamW/Adam 8 (12 with amsgrad), SGD 4 with momentum, else 0."""
    opt = cfg.optimizer
    kind = (opt.type if opt is not None else "AdamW").lower()
    params = opt.params if opt is not None else {}
    if kind == "sgd":
        return 4 if params.get("momentum") else 0
    return 8 + (4 if params.get("amsgrad") else 0)


def sub_group_size(cfg, partition_elements: int, nvme: bool) -> int:
    """``zero_optimization.sub_group_size``, or when it is left out: 1e9 elements (one sub-group per param
    group in practice), and with the optimizer on NVMe the size at which the swap pools (``pool_slots``
    slots of the master and each optimizer state tensor, and the gradient pool) hold at most 1/8 of the
    rank's partition, within 1e6..1e8 elements: the pools are what stays in memory of what offload moves
    out, so they must stay a small part of it (``swap_pool_bytes``)."""
    chosen = cfg.zero_optimization.sub_group_size
    if chosen is not None:
        return chosen
    if not nvme:
        return 1_000_000_000
    return min(100_000_000, max(1_000_000, -(-partition_elements // (8 * pool_sub_groups(cfg)))))


def pool_sub_groups(cfg) -> int:
    """Sub-groups' worth of fp32 tensors the NVMe pools hold at once: ``pool_slots`` slots of the master and
    each optimizer state tensor, and the gradient pool's buffers (AdamW, the default buffer_count: 2 x 3 + 3)."""
    from rayzero.offload.gradients import BUFFERS

    opt = optimizer_state_bytes(cfg)
    tensors = 1 + math.ceil(opt / FP32)
    return pool_slots(cfg.zero_optimization.offload_optimizer.buffer_count, opt) * tensors + BUFFERS


def _compute_bytes(mixed_precision: bool) -> int:
    return 2 if mixed_precision else FP32


# ---- per trainable parameter ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes per trainable parameter, by kind (docs/design.md "Memory per rank")."""

    weights: float  # the compute-dtype weights a rank keeps (whole at stages 1-2, a partition copy otherwise)
    master: float  # fp32 master partition in memory
    grads: float  # fp32 gradient partition (+ stage 1's whole local gradient buffer)
    optimizer: float  # optimizer state in memory

    @property
    def total(self) -> float:
        return self.weights + self.master + self.grads + self.optimizer


def state_bytes_per_param(
    stage: int,
    world: int,
    mixed_precision: bool,
    optimizer_bytes: int = 8,
    offload_device: str = "none",
    *,
    offload_param: str = "none",
) -> StateBytes:
    """Model-state bytes one rank holds in memory per trainable parameter, ``w`` the compute dtype's size.

    * no offload (``none``; ``auto`` counts as ``none``) and ``cpu`` (the same bytes, in host memory):

      ======  =====================================  ===================
      stage   fp32 compute                           bf16/fp16 compute
      ======  =====================================  ===================
      0       16 (the weights are views of the       18
              master)
      1       8 + 16/W (+ the fp32 local gradient    6 + 16/W
              buffer, the whole gradient)
      2       4 + 16/W                               2 + 16/W
      3       16/W                                   16/W
      ======  =====================================  ===================

      (16 = the fp32 master, gradient and AdamW's two moments, ``4 + 4 + optimizer_bytes``.)  With ``cpu``
      stage 1 keeps no local gradient buffer: offloaded, it reduces into its partition every backward, as
      stage 2 does.
    * ``nvme``: the fp32 master, the optimizer states and the fp32 gradient partition are on disk (the
      gradients go there sub-group by sub-group as they are reduced; the pools that hold the sub-groups in
      use are ``swap_pool_bytes``, a constant per rank).  What stays is a compute-dtype copy of the rank's
      weight partition (``w/W``), which stage 3 gathers from and stages 1 and 2 publish from: stages 1 and 2
      ``w + w/W``, stage 3 ``w/W``; with ``offload_param="nvme"`` (stage 3) that copy is on disk too.
    * ``offload_param="cpu"`` (stage 3) keeps the weight partition in the compute dtype in host memory: + w/W.
    """
    w = _compute_bytes(mixed_precision)
    ranks = max(1, world)
    if offload_device in ("none", "cpu", "auto"):
        if stage == 0:  # nothing partitioned; in fp32 the model's parameters are views of the master
            return StateBytes(w if mixed_precision else 0, FP32, FP32, optimizer_bytes)
        master, grads, opt = FP32 / ranks, FP32 / ranks, optimizer_bytes / ranks
        if stage == 1 and offload_device != "cpu":
            return StateBytes(w, master, FP32 + grads, opt)  # + the persistent fp32 local gradient buffer
        if stage in (1, 2):
            return StateBytes(w, master, grads, opt)
        return StateBytes(w / ranks if offload_param == "cpu" else 0.0, master, grads, opt)
    if offload_device != "nvme":
        raise ValueError(f"offload_device must be 'none', 'cpu' or 'nvme', got {offload_device!r}")
    if stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
    copy = 0.0 if stage == 3 and offload_param == "nvme" else w / ranks
    return StateBytes((w if stage in (1, 2) else 0) + copy, 0.0, 0.0, 0.0)


def model_state_bytes_per_param(stage: int, world: int, mixed_precision: bool, optimizer_bytes: int = 8) -> float:
    """The table's total without offload: stage 0 16 (18), stage 1 8 + 16/W (6 + 16/W), stage 2 4 + 16/W
    (2 + 16/W), stage 3 16/W, for fp32 (bf16/fp16) compute; stage 3's persistent parameters come on top."""
    return state_bytes_per_param(stage, world, mixed_precision, optimizer_bytes).total


def ram_bytes_per_param(
    stage: int,
    world: int,
    mixed_precision: bool,
    optimizer_bytes: int = 8,
    offload_device: str = "none",
    *,
    offload_param: str = "none",
) -> float:
    """Model-state bytes one rank holds in memory per trainable parameter with the optimizer offloaded to
    ``offload_device`` (``state_bytes_per_param``'s total)."""
    return state_bytes_per_param(stage, world, mixed_precision, optimizer_bytes, offload_device,
                                 offload_param=offload_param).total


def device_and_host_bytes_per_param(
    stage: int,
    world: int,
    mixed_precision: bool,
    optimizer_bytes: int = 8,
    offload_device: str = "none",
    *,
    offload_param: str = "none",
) -> tuple[float, float]:
    """On an accelerator: ``ram_bytes_per_param``'s model-state bytes split into ``(device memory, host
    memory)``.  Without optimizer offload everything is on the device but stage 3's weight partition under
    ``offload_param="cpu"``; offloaded (``cpu`` or ``nvme``), the device keeps only the compute-dtype weights
    of stages 1-2 (stage 3 gathers its weights per unit from the host), and the rest (the fp32 partitions, or
    with ``nvme`` the gradient partition and the weight copy) is host memory."""
    b = state_bytes_per_param(stage, world, mixed_precision, optimizer_bytes, offload_device,
                              offload_param=offload_param)
    if offload_device in ("none", "auto"):
        host = b.weights if stage == 3 else 0.0  # (stage 3: only offload_param's host copy)
        return b.total - host, host
    on_device = float(_compute_bytes(mixed_precision)) if stage in (1, 2) else 0.0
    return on_device, b.total - on_device


def model_state_bytes_per_worker(
    num_params: int,
    stage: int,
    world: int,
    mixed_precision: bool,
    *,
    persistent_params: int = 0,
    frozen_params: int = 0,
    optimizer_bytes: int = 8,
) -> int:
    """ZeRO model-state memory of one worker: ``num_params`` trainable parameters partitioned over ``world``
    ranks (``model_state_bytes_per_param``), plus the compute-dtype copies every rank keeps whole: stage 3's
    persistent parameters (at most ``stage3_param_persistence_threshold`` elements) and frozen parameters.
    The plan's memory floor: activations and transient buffers come on top."""
    w = _compute_bytes(mixed_precision)
    need = model_state_bytes_per_param(stage, world, mixed_precision, optimizer_bytes) * num_params
    if stage == 3:
        need += w * persistent_params
    return int(round(need + w * frozen_params))


# ---- NVMe swap -----------------------------------------------------------------------------------------
def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block if block > 1 else n


def swap_bytes_per_rank(
    num_params: int,
    stage: int,
    world: int,
    optimizer_bytes: int = 8,
    block: int = 1 << 20,
    *,
    sub_group_size: int = 1_000_000_000,
    param_bytes: int = 0,
    offload_optimizer: bool = True,
) -> int:
    """Bytes one rank keeps in its swap directory with NVMe offload.

    With optimizer offload: the rank's fp32 master partition, its fp32 gradient partition and each fp32
    optimizer state tensor (``optimizer_bytes / 4`` of them: AdamW 2), one file per sub-group of ``sub_group_size`` elements, each
    rounded up to whole ``block``s (the O_DIRECT unit).  ``param_bytes`` > 0 adds the rank's parameter
    partition in that many bytes per element (``offload_param`` with ``nvme``: the compute dtype's size),
    sub-grouped and rounded the same way.

    Approximate: the partition is taken as ``ceil(num_params / world)`` elements (stage 0 is not partitioned),
    without the per-parameter padding of the real layout (at most ``world - 1`` elements per parameter) and
    with one set of sub-groups for the whole partition (the engine rounds per param group).
    """
    if num_params <= 0:
        return 0
    ranks = 1 if stage == 0 else max(1, world)
    part = -(-num_params // ranks)
    sub = max(1, sub_group_size)
    full, rest = divmod(part, sub)

    def files(bytes_per_element: int) -> int:  # one tensor's files over the sub-groups
        size = full * _round_up(sub * bytes_per_element, block)
        return size + (_round_up(rest * bytes_per_element, block) if rest else 0)

    total = 0
    if offload_optimizer:
        tensors = 2 + math.ceil(optimizer_bytes / FP32)  # the master, its gradient, each optimizer state tensor
        total += tensors * files(FP32)
    if param_bytes:
        total += files(param_bytes)
    return total


def pool_slots(buffer_count: int, optimizer_bytes: int = 8) -> int:
    """Sub-groups the NVMe optimizer swap pool holds at once.  ``offload_optimizer.buffer_count`` counts
    tensor buffers, as DeepSpeed's does ("at least the number of states maintained per parameter"); a slot
    holds one sub-group's master and each of its fp32 optimizer state tensors (AdamW: 3 buffers), and there
    are at least two slots (one sub-group stepped while the next is read).  DeepSpeed's default of 4 makes 2
    slots with AdamW."""
    tensors = 1 + math.ceil(optimizer_bytes / FP32)
    return max(2, buffer_count // tensors)


def swap_pool_bytes(partition_elements: int, sub_group_elements: int, buffer_count: int,
                    optimizer_bytes: int = 8) -> int:
    """Host memory of the NVMe optimizer swap pools of one rank: ``pool_slots`` slots (never more than there
    are sub-groups), each holding one sub-group's fp32 master and fp32 optimizer state tensors, and the
    gradient pool (``offload/gradients.BUFFERS`` sub-groups' fp32 gradients, never more than there are
    sub-groups).  A constant per rank, on top of ``ram_bytes_per_param``."""
    from rayzero.offload.gradients import BUFFERS

    if partition_elements <= 0:
        return 0
    sub = max(1, min(sub_group_elements, partition_elements))
    groups = -(-partition_elements // sub)
    slots = min(pool_slots(buffer_count, optimizer_bytes), groups)
    tensors = 1 + math.ceil(optimizer_bytes / FP32)
    return slots * sub * tensors * FP32 + min(BUFFERS, groups) * sub * FP32


def pool_bytes(cfg, params: list[torch.Tensor], world_of) -> int:
    """The NVMe swap pool this rank keeps in memory (``swap_pool_bytes``) for ``params`` partitioned over
    ``world_of(p)`` ranks each, with the sub-groups the engine will cut."""
    return _pool_of_chunks(cfg, [-(-p.numel() // world_of(p)) for p in params])


def _pool_of_chunks(cfg, chunks: list[float]) -> int:
    if not chunks:
        return 0
    partition = math.ceil(sum(chunks))
    largest = math.ceil(max(chunks))
    sub = max(sub_group_size(cfg, partition, nvme=True), largest)  # a larger parameter is its own sub-group
    return swap_pool_bytes(partition, sub, cfg.zero_optimization.offload_optimizer.buffer_count,
                           optimizer_state_bytes(cfg))


# ---- per rank, over a list of parameters ---------------------------------------------------------------
@dataclass(frozen=True)
class Share:
    """One parameter as one rank holds it: ``elements`` of it (its tp / ep slice), partitioned over ``ranks``
    ranks (its ZeRO domain), trainable or frozen (frozen: whole on every rank, in the compute dtype)."""

    elements: float
    ranks: int
    trainable: bool = True


def expert_params(model: torch.nn.Module) -> set:
    """The parameters AutoEP splits over ep: rayzero MoE experts (marked) and transformers experts modules."""
    from rayzero.moe.experts import looks_like_experts

    out = {p for p in model.parameters() if getattr(p, "_rayzero_expert", False)}
    for module in model.modules():
        if looks_like_experts(module):
            out.update(module.parameters())
    return out


def model_shares(model: torch.nn.Module, cfg, world: int) -> list[Share]:
    """The whole model's parameters (tied ones once) as one of ``world`` ranks holds them: with tensor
    parallelism every parameter counts 1/tp (AutoTP leaves embeddings and norms whole, so this can only
    under-count), partitioned over the ``world // tp`` data shards; with expert parallelism the experts
    count 1/ep more, partitioned over the ``dp // ep`` expert-data-parallel ranks."""
    tp, ep = cfg.tensor_parallel.autotp_size, cfg.expert_parallel.size
    dp = max(1, world // tp)
    edp = max(1, dp // ep)
    experts = expert_params(model) if ep > 1 else set()
    out = []
    for p in dict.fromkeys(model.parameters()):
        expert = p in experts
        out.append(Share(p.numel() / (tp * ep if expert else tp), edp if expert else dp, p.requires_grad))
    return out


def engine_shares(params: Iterable[torch.Tensor], world_of: Callable[[torch.Tensor], int]) -> list[Share]:
    """An engine's trainable parameters (already its tp / ep slices) over their domains' sizes."""
    return [Share(p.numel(), world_of(p)) for p in params]


def _offload_of(cfg, offload: str | None) -> str:
    offload = offload or cfg.zero_optimization.offload_optimizer.device
    return "none" if offload == "auto" else offload


def states_bytes(shares: list[Share], cfg, offload: str | None = None, where: str = "all",
                 stage: int | None = None) -> int:
    """Model-state bytes one rank holds of ``shares`` (``offload``: the optimizer's offload device, default
    the config's; ``auto`` counts as ``none``): ``state_bytes_per_param`` per trainable parameter, stage 3's
    persistent parameters whole (at most ``stage3_param_persistence_threshold`` elements) and frozen ones
    whole, in the compute dtype, and with ``nvme`` the swap pool (``swap_pool_bytes``).  ``where`` ("device"
    or "host") counts only the part that lives there on an accelerator (``device_and_host_bytes_per_param``;
    the swap pool is host memory); "all" counts both."""
    if where not in ("all", "device", "host"):
        raise ValueError(f"where must be 'all', 'device' or 'host', got {where!r}")
    on_device, on_host = where != "host", where != "device"
    z = cfg.zero_optimization
    offload = _offload_of(cfg, offload)
    stage = z.stage if stage is None else stage
    mixed = cfg.compute_dtype != torch.float32
    w = _compute_bytes(mixed)
    opt = optimizer_state_bytes(cfg)
    threshold = z.stage3_param_persistence_threshold
    need = 0.0
    chunks: list[float] = []  # elements of this rank's optimizer partition, per parameter
    for s in shares:
        if not s.trainable:  # frozen: whole on every rank, in the compute dtype
            need += w * s.elements if on_device else 0
            continue
        chunks.append(math.ceil(s.elements / (s.ranks if stage else 1)))
        d, h = device_and_host_bytes_per_param(stage, s.ranks, mixed, opt, offload,
                                               offload_param=z.offload_param.device)
        need += ((d if on_device else 0) + (h if on_host else 0)) * s.elements
        if stage == 3 and s.elements <= threshold and on_device:  # persistent: whole between steps too
            need += w * s.elements
    if offload == "nvme" and on_host:
        need += _pool_of_chunks(cfg, chunks)
    return int(round(need))


def model_state_bytes(model: torch.nn.Module, cfg, world: int, offload: str | None = None,
                      where: str = "all") -> tuple[int, int]:
    """``(bytes, parameters)``: the model-state bytes one of ``world`` workers holds of the whole ``model``
    (``states_bytes`` over ``model_shares``) and the model's parameter count."""
    return states_bytes(model_shares(model, cfg, world), cfg, offload, where), \
        sum(p.numel() for p in dict.fromkeys(model.parameters()))


def swap_bytes(model: torch.nn.Module, cfg, world: int) -> int:
    """Bytes one of ``world`` ranks keeps in its swap directory (``swap_bytes_per_rank``): the trainable
    parameters it holds (1/tp, experts 1/ep more) partitioned over dp (experts over edp)."""
    z = cfg.zero_optimization
    tp, ep = cfg.tensor_parallel.autotp_size, cfg.expert_parallel.size
    dp = max(1, world // tp)
    experts = expert_params(model) if ep > 1 else set()
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    dense = sum(p.numel() for p in params if p not in experts) // tp
    expert = sum(p.numel() for p in params if p in experts) // (tp * ep)
    kwargs = dict(
        block=cfg.aio.block_size,
        sub_group_size=z.sub_group_size or 1_000_000_000,  # unset: the engine's NVMe sub-groups are smaller
        param_bytes=_compute_bytes(cfg.compute_dtype != torch.float32) if z.offload_param.device == "nvme" else 0,
        offload_optimizer=z.offload_optimizer.device == "nvme",
    )
    opt = optimizer_state_bytes(cfg)
    return (swap_bytes_per_rank(dense, z.stage, dp, opt, **kwargs)
            + swap_bytes_per_rank(expert, z.stage, max(1, dp // ep), opt, **kwargs))


# ---- one rank's whole memory ---------------------------------------------------------------------------
@dataclass
class RankMemory:
    """One rank's memory for a config, in bytes (:func:`rank_memory`)."""

    weights: int  # compute-dtype parameters kept whole (stages 0-2's model parameters, stage 3's persistent
    #               ones, frozen ones) and stage 3's weight partition copy (offload_param cpu, or nvme offload)
    master: int  # fp32 master partition held in memory (0 when on NVMe)
    grads: int  # fp32 gradient partition (+ stage 1's whole local gradient buffer; 0 when on NVMe)
    optimizer: int  # optimizer state held in memory (0 when on NVMe)
    gathered: int  # stage 3: parameters gathered at once (the running unit + those gathered ahead), compute dtype
    buckets: int  # reduce buckets in flight, and stages 1-2's all-gather buckets in flight
    swap_pool: int  # NVMe optimizer swap pool and gradient pool + offload_param's read pool and max_in_cpu cache
    activations: int  # given by the caller (unknown: 0)
    device: str  # "cpu" or the accelerator kind
    reduce_bucket_size: int = 0  # the bucket sizes counted (the config's, or derived as the engine derives them)
    allgather_bucket_size: int = 0
    # the full-size gradient autograd makes for the largest parameter, alive until the reducer has moved it
    # into a bucket (stages 2-3, and 1 under offload; stages 0-1 accumulate into their gradient buffers)
    grads_in_flight: int = 0
    # weights the ranks of one host keep once for all of them (shared-memory transport, ``local_ranks`` > 1),
    # whole: each rank maps all of it, so all of it shows in each rank's RSS (VmHWM), but the host holds it
    # once, and a cgroup bills each page to the rank that touched it first (:meth:`charged`)
    host_shared: int = 0
    # the shared-memory transport's segment of the data-parallel group (comm/shm.py: SLOTS chunks per rank of
    # the host), mapped whole by each of them like ``host_shared``
    transport: int = 0
    local_ranks: int = 1

    def model_states(self) -> int:
        return self.weights + self.master + self.grads + self.optimizer

    def transient(self) -> int:
        return self.gathered + self.buckets + self.activations + self.grads_in_flight

    def total(self) -> int:
        """Everything the rank maps: what its peak RSS (VmHWM) is compared with."""
        return self.model_states() + self.swap_pool + self.transient() + self.host_shared + self.transport

    def charged(self) -> int:
        """The rank's share of its host's memory: the host-shared weights once per host.  What a memory limit
        on the ranks of a host together is checked against."""
        shared = self.host_shared + self.transport
        return self.total() - shared + shared // max(1, self.local_ranks)


def _backend_for(device: str, dp: int) -> str:
    """The data-parallel group's backend as the engine sees it: none on one rank, gloo on the CPU, nccl on CUDA."""
    if dp <= 1:
        return "none"
    return {"cpu": "gloo", "cuda": "nccl"}.get(device, "gloo")


def _largest_bucket(sizes: list[int], max_elements: int) -> int:
    """The largest bucket ``zero/reducer.make_buckets`` cuts from entries of these padded sizes (one group)."""
    largest = size = 0
    for n in sizes:
        if size and size + n > max_elements:
            largest, size = max(largest, size), 0
        size += n
    return max(largest, size)


def gather_units(model: torch.nn.Module, managed: dict, rule: str, numel: Callable,
                 auto_blocks: bool = True) -> list[int]:
    """Elements of each stage-3 gather unit (the sum of its managed parameters' padded sizes), cut as
    ``ParamGatherer`` cuts them (``zero/stage3.unit_modules``: ``rule`` is ``stage3_gather_unit``,
    ``auto_blocks`` ``zero/stage3.auto_units_are_blocks``); ``managed`` maps each managed parameter to its
    padded elements."""
    from rayzero.zero.stage3 import unit_modules

    blocks = unit_modules(model, rule, numel, auto_blocks)
    in_block = {id(sub) for b in blocks for sub in b.modules()}
    owners = [b.parameters() for b in blocks]
    owners += [m._parameters.values() for m in model.modules() if id(m) not in in_block]
    units = []
    for params_of in owners:
        own = list(dict.fromkeys(p for p in params_of if p is not None and p in managed))
        if own:
            units.append(sum(managed[p] for p in own))
    return units


def gathered_elements(units: list[int], prefetch: bool, prefetch_elements: int | None) -> int:
    """The most elements stage 3 holds gathered at once: the running unit plus the units gathered ahead
    (``stage3_prefetch_bucket_size`` elements of them, None: two of the largest unit, as ``ParamGatherer``
    derives it; always the next unit, so one unit when one is larger), never more than all units."""
    if not units:
        return 0
    largest = max(units)
    budget = 2 * largest if prefetch_elements is None else prefetch_elements
    ahead = max(budget, largest) if prefetch and len(units) > 1 else 0
    return min(sum(units), largest + ahead)


def rank_memory(model_or_params: Any, cfg, world: int, *, offload: str | None = None, activations: int = 0,
                device: str = "cpu", backend: str | None = None, local_ranks: int = 1) -> RankMemory:
    """One of ``world`` ranks' memory for ``cfg``: the model states (``state_bytes_per_param`` per trainable
    parameter, docs/design.md "Memory per rank"), stage 3's gathered parameters, the buckets in flight, the
    NVMe swap pools, and ``activations`` (the caller's figure).

    ``model_or_params``: the whole model (may be on the meta device; tp / ep slices counted as
    ``model_shares`` counts them) or a list of one rank's parameters (each then its own gather unit).
    ``offload``: the optimizer's offload device (default the config's; ``auto`` counts as ``none``).
    ``device``: where the rank computes (``cpu`` or an accelerator kind); ``backend``: the data-parallel
    group's backend, which the derived bucket sizes depend on (default: gloo on the CPU, nccl on CUDA, none
    on one rank).  Bucket sizes the config leaves out are derived with ``zero/buckets.derive_bucket_sizes``,
    as the engine derives them.

    ``local_ranks``: ranks of one host that share memory through the shared-memory transport (1: none, as
    with ``RAYZERO_SHM=0`` or one rank per host).  With more, on a CPU device, stages 1-2 keep one copy of the
    model's weights per host, and stage 3 keeps one where ``stage3_share_weights`` (or its default: always in
    16-bit, in fp32 where the rank's part is no more than what gathers hold at once) says so, and then
    gathers nothing; that copy is ``host_shared``.  Not modelled: stages 1-2 in fp32 make a large parameter's
    master the rank's row of that copy (the model counts the master separately, a little more than is held).
    """
    from rayzero.zero.buckets import derive_bucket_sizes
    from rayzero.zero.reducer import GradientReducer
    from rayzero.zero.stage3 import auto_units_are_blocks

    z = cfg.zero_optimization
    offload = _offload_of(cfg, offload)
    stage = z.stage
    mixed = cfg.compute_dtype != torch.float32
    w = _compute_bytes(mixed)
    opt = optimizer_state_bytes(cfg)
    if isinstance(model_or_params, torch.nn.Module):
        model = model_or_params
        params = list(dict.fromkeys(model.parameters()))
        shares = model_shares(model, cfg, world)
    else:
        params = list(dict.fromkeys(model_or_params))
        model = torch.nn.Module()
        for i, p in enumerate(params):  # each parameter its own module: its own gather unit
            holder = torch.nn.Module()
            holder.register_parameter("p", p if isinstance(p, torch.nn.Parameter) else torch.nn.Parameter(p))
            model.add_module(str(i), holder)
        params = list(model.parameters())
        tp = cfg.tensor_parallel.autotp_size
        shares = [Share(p.numel(), max(1, world // tp), p.requires_grad) for p in params]
    threshold = z.stage3_param_persistence_threshold

    weights = master = grads = optim = 0.0
    chunks: list[float] = []
    padded: dict = {}  # trainable parameter -> its padded elements in the layout
    for p, s in zip(params, shares):
        if not s.trainable:
            weights += w * s.elements
            continue
        ranks = s.ranks if stage else 1
        chunk = math.ceil(s.elements / ranks)
        chunks.append(chunk)
        padded[p] = chunk * ranks
        b = state_bytes_per_param(stage, s.ranks, mixed, opt, offload, offload_param=z.offload_param.device)
        weights += b.weights * s.elements
        master += b.master * s.elements
        grads += b.grads * s.elements
        optim += b.optimizer * s.elements
        if stage == 3 and s.elements <= threshold:
            weights += w * s.elements

    # stage 3's gathers
    gathered = 0
    units: list[int] = []
    managed: dict = {}
    elements: dict = {}
    if stage == 3:
        elements = {p: s.elements for p, s in zip(params, shares)}
        managed = {p: n for p, n in padded.items() if elements[p] > threshold}
        units = gather_units(model, managed, z.stage3_gather_unit, lambda p: int(elements.get(p, p.numel())),
                             auto_units_are_blocks(z))
        prefetch = z.overlap_comm and z.stage3_prefetch_bucket_size != 0
        gathered = gathered_elements(units, prefetch, z.stage3_prefetch_bucket_size) * w

    # weights one copy per host holds for its ranks (zero/publish.py, zero/stage3.py)
    host_shared = transport = 0
    if local_ranks > 1 and stage:
        from rayzero.comm.shm import CHUNK_BYTES, SLOTS

        transport = SLOTS * CHUNK_BYTES * local_ranks
    shares_host = local_ranks > 1 and device == "cpu"  # as the engine decides it (engine.py, share=)
    if shares_host and stage in (1, 2):
        whole = sum(s.elements for s in shares if s.trainable)
        weights -= w * whole
        host_shared = w * whole
    elif shares_host and stage == 3 and managed and z.offload_param.device == "none":
        budget = 2 * max(units) if z.stage3_prefetch_bucket_size is None else z.stage3_prefetch_bucket_size
        mine = sum(-(-n // (world // cfg.tensor_parallel.autotp_size)) for n in managed.values())
        share = (z.stage3_share_weights if z.stage3_share_weights is not None
                 else mixed or mine <= max(units) + budget)
        if share:
            gathered = 0  # the units' parameters are views of the host's copy: nothing is gathered
            host_shared = w * sum(elements[p] for p in managed)

    # buckets, sized as the engine sizes them
    dp = max(1, world // cfg.tensor_parallel.autotp_size)
    plan = derive_bucket_sizes(model, list(padded), lambda p: padded.get(p, 0), backend or _backend_for(device, dp),
                               cfg.comm_dtype.itemsize, z.reduce_bucket_size, z.allgather_bucket_size)
    buckets = 0
    reduces_in_buckets = stage >= 2 or (stage == 1 and offload != "none")  # stages 0-1: the rows are the grads
    if reduces_in_buckets and padded:
        largest = _largest_bucket(list(padded.values()), plan.reduce_bucket_size)
        buckets += (GradientReducer.inflight_for(z) + 1) * largest * cfg.comm_dtype.itemsize
    if stage in (1, 2) and padded:  # publishing: two all-gather buckets in flight
        buckets += 2 * min(plan.allgather_bucket_size, sum(padded.values())) * w

    swap = _pool_of_chunks(cfg, chunks) if offload == "nvme" else 0
    if stage == 3 and z.offload_param.device == "nvme":
        from rayzero.offload.params import cache_elements, read_pool_shape

        partition = sum(chunks)
        unit_shards = [max(units, default=0) // max(1, world // cfg.tensor_parallel.autotp_size)]
        count, size = read_pool_shape(z.offload_param.buffer_count, z.offload_param.buffer_size, unit_shards,
                                      cfg.compute_dtype)
        pool = count * min(max(size, max(chunks, default=0)), partition)
        swap += (pool + min(cache_elements(z.offload_param.max_in_cpu), partition)) * w

    # autograd's gradient of the largest parameter, before the reducer moves it into a bucket
    in_flight = 0
    if chunks and (stage >= 2 or (stage == 1 and offload != "none")):
        in_flight = w * max(s.elements for s in shares if s.trainable)
    return RankMemory(
        weights=int(round(weights)), master=int(round(master)), grads=int(round(grads)),
        optimizer=int(round(optim)), gathered=int(gathered), buckets=int(buckets), swap_pool=int(swap),
        activations=int(activations), device=device,
        reduce_bucket_size=plan.reduce_bucket_size, allgather_bucket_size=plan.allgather_bucket_size,
        grads_in_flight=int(in_flight), host_shared=int(host_shared), transport=int(transport),
        local_ranks=max(1, local_ranks),
    )
