"""Save an Engine's state as a universal checkpoint, and load one into an Engine of any world size or stage.

What a rank saves: for every partitioned parameter, the element range it owns (stages 1-3: its shard;
stage 0, where every rank holds everything, an even 1/world slice so the writing is still shared) of the
fp32 master and of every optimizer state tensor the optimizer keeps; rank 0 adds buffers and frozen
parameters whole.  What a rank loads: for each of its own ranges, the overlapping pieces of the saved
fragments, whatever world size and stage wrote them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from rayzero.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST,
    STATE_MASTER,
    STATE_WHOLE,
    CheckpointError,
    Deferred,
    Fragment,
    StorageFullError,
    dtype_name,
)
from rayzero.checkpoint.reader import FragmentIndex, read_manifest, resolve_tag
from rayzero.checkpoint.storage import Storage
from rayzero.checkpoint.optimizer_load import (
    STATE_STARTS_AT_ZERO,
    STATE_USED_WHEN,
    check_new_params_can_start_fresh,
    group_hparams,
    warn_hparam_differences,
)
from rayzero.checkpoint.rng import rederive_rng, rng_state, set_rng_state
from rayzero.checkpoint.slices import prod, slice_filler
from rayzero.parallel.slicing import full_shape_of, layout_dicts, slice_index, splits_of
from rayzero.checkpoint.writer import (
    BackgroundSave,
    abort,
    check_shared,
    check_space,
    commit,
    fragment_bytes,
    prepare,
    staging_dir,
    wait_discards,
    write_rank,
)

if TYPE_CHECKING:
    from rayzero.engine import Engine

logger = logging.getLogger("rayzero")


# ---- what a rank holds ---------------------------------------------------------------------------------
def _local_range(engine: "Engine", entry) -> tuple[int, int]:
    return entry.owner_range(engine.partitions.group_of(entry).rank)


def _save_range(engine: "Engine", entry) -> tuple[int, int]:
    """The slice this rank writes: its owned range, split evenly across the ranks of its group where they
    all own all (stage 0).  Only a group's primary ranks write (tensor-parallel replicas are saved once)."""
    lo, hi = _local_range(engine, entry)
    g = engine.partitions.group_of(entry)
    if not g.domain.primary:
        return 0, 0
    if engine.partitions.partitioned:
        return lo, hi
    world, rank = g.comm.world, g.comm.rank
    chunk = -(-entry.numel // world)
    return min(rank * chunk, entry.numel), min((rank + 1) * chunk, entry.numel)


def _swapped(engine: "Engine", gi: int) -> bool:
    """Whether group ``gi``'s master and optimizer state are in the NVMe swap files right now."""
    swap = getattr(engine, "swap", None)
    return swap is not None and swap.swapped_out(gi)


def _tensor_states(engine: "Engine") -> dict[int, dict[str, torch.Tensor]]:
    """Per group: the optimizer's state tensors shaped like the master partition (for a group swapped out
    to NVMe, the optimizer's placeholders under the names its swap files hold)."""
    out = {}
    for gi, g in enumerate(engine.partitions.groups):
        state = engine.optimizer.state.get(g.master, {})
        if _swapped(engine, gi):
            out[gi] = {k: state[k] for k in engine.swap.tensor_state_names(gi) if k in state}
        else:
            out[gi] = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == g.master.shape}
    return out


def _scalar_states(engine: "Engine") -> dict[int, dict[str, dict]]:
    out = {}
    for gi, g in enumerate(engine.partitions.groups):
        found = {}
        for k, v in engine.optimizer.state.get(g.master, {}).items():
            if torch.is_tensor(v) and v.numel() == 1 and v.shape != g.master.shape:
                found[k] = {"kind": "tensor", "value": v.item(), "dtype": dtype_name(v.dtype)}
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                found[k] = {"kind": type(v).__name__, "value": v}
        out[gi] = found
    return out


def snapshot(engine: "Engine", staging: dict | None, later: list | None = None,
             from_device: list | None = None) -> list[Fragment]:
    """This rank's fragments: views of the live tensors, or (``staging`` given, for a save that overlaps
    training) copies in CPU buffers kept from one async save to the next, so that later snapshots are a
    plain memory copy with no allocation or page faults.

    With ``later`` the copies of the masters and optimizer states (all but a few bytes of a checkpoint) are
    not made here: ``(source, buffer)`` pairs go into ``later`` and the save's own thread copies them while
    the forward and backward run (nothing changes those tensors before the next optimizer step, which
    waits for the copies: ``CheckpointIO.before_update``).  Buffers (a forward may update them) and
    offloaded sub-groups (resident only now) are copied here.

    With ``from_device`` (a list) tensors on an accelerator are not copied here either: their buffers are
    pinned, and ``(source, buffer, deferred)`` go into ``from_device`` for :func:`copy_from_device`."""
    frags: list[Fragment] = []

    def take(t: torch.Tensor, key: tuple, defer: bool = False) -> torch.Tensor:
        t = t.detach()
        if staging is None:
            return t.to("cpu")
        buf = staging.get(key)
        on_device = from_device is not None and t.device.type != "cpu"
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            staging[key] = engine.accelerator.pin_memory(buf) if on_device else buf
            buf = staging[key]
        if on_device:
            from_device.append((t, buf, defer and later is not None))
        elif defer and later is not None:
            later.append((t, buf))
        else:
            buf.copy_(t)
        return buf

    names = {gi: list(d) for gi, d in _tensor_states(engine).items()}
    for gi, g in enumerate(engine.partitions.groups):
        if not _swapped(engine, gi):
            frags += _group_fragments(engine, gi, names[gi], lambda t, key: take(t, key, defer=True))
        elif staging is not None:  # a save that overlaps training: copied now, one sub-group at a time
            with engine.swap.group_resident(gi):
                frags += _group_fragments(engine, gi, names[gi], take)
        else:  # read by the writer while the group is resident (write_rank's open_group)
            frags += _group_fragments(engine, gi, names[gi], None)
    for name, t in _whole_tensors(engine).items():
        splits = splits_of(t)
        if splits:  # a frozen EP/TP slice: its first holder writes it at its canonical offset
            if engine.parallel.first_holder(splits):
                at = slice_index(splits) * t.numel()
                frags.append(Fragment(name, STATE_WHOLE, at, at + t.numel(), take(t.reshape(-1), (name, STATE_WHOLE))))
        elif engine.rank == 0:
            frags.append(Fragment(name, STATE_WHOLE, 0, t.numel(), take(t.reshape(-1), (name, STATE_WHOLE))))
    return frags


def copy_from_device(accelerator: Any, stream: Any, pairs: list) -> Any:
    """Queue the copies of ``pairs`` (from :func:`snapshot`'s ``from_device``) into their pinned buffers on
    ``stream``, after an event on the compute stream, ``non_blocking``; returns the event recorded after the
    last copy, which the save's thread waits on before it reads the buffers.  The copies of tensors a forward
    may change (not deferred: buffers) go first, and the compute stream waits on them (a wait on the device,
    not the host); the deferred ones (masters, optimizer state) change only at the step, which waits for the
    save's copies (``CheckpointIO.before_update``)."""
    compute = accelerator.current_stream()
    ready = accelerator.Event()
    ready.record(compute)
    pairs = sorted(pairs, key=lambda x: x[2])  # the tensors a forward may change first
    with torch.no_grad(), accelerator.stream_context(stream):
        stream.wait_event(ready)
        early = None
        for i, (source, buf, deferred) in enumerate(pairs):
            if deferred and early is None and i:
                early = accelerator.Event()
                early.record(stream)
            buf.copy_(source, non_blocking=accelerator.is_pinned(buf))
            accelerator.record_stream(source, stream)
        done = accelerator.Event()
        done.record(stream)
    if not pairs[-1][2]:  # nothing deferred: all of them may change in the next forward
        early = done
    if early is not None:
        compute.wait_event(early)
    return done


def _group_fragments(engine: "Engine", gi: int, names: list[str], take) -> list[Fragment]:
    """Group ``gi``'s fragments: the master and optimizer state slices this rank saves.  Without ``take``
    they are deferred: their data is read when the writer makes the group resident."""
    g = engine.partitions.groups[gi]
    state_of = lambda: engine.optimizer.state[g.master]  # the live tensors, whichever buffers hold them now
    frags = []
    for e in g.layout.entries:
        lo, hi = _local_range(engine, e)
        s0, s1 = _save_range(engine, e)
        if s1 <= s0:
            continue
        a, b = e.partition_offset + s0 - lo, e.partition_offset + s1 - lo
        # fragments address the model's full tensor: an EP/TP slice sits at its canonical offset
        c0, c1 = e.canonical_offset + s0, e.canonical_offset + s1
        if take is None:
            frags.append(Fragment(e.name, STATE_MASTER, c0, c1, Deferred(gi, lambda a=a, b=b: g.master[a:b].detach())))
            for name in names:
                frags.append(Fragment(e.name, name, c0, c1, Deferred(gi, lambda n=name, a=a, b=b: state_of()[n][a:b])))
            continue
        frags.append(Fragment(e.name, STATE_MASTER, c0, c1, take(g.master[a:b], (e.name, STATE_MASTER))))
        for name in names:
            frags.append(Fragment(e.name, name, c0, c1, take(state_of()[name][a:b], (e.name, name))))
    return frags


def _whole_tensors(engine: "Engine") -> dict[str, torch.Tensor]:
    partitioned = set(engine.partitions.entry_of)
    out = {}
    for name, p in engine.module.named_parameters():
        if p not in partitioned:
            out[name] = p
    for name, b in engine.module.named_buffers():
        out[name] = b
    return out


def _jsonable(value: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} must be JSON-serializable (no pickle in checkpoints): {e}") from None


def build_manifest(engine: "Engine", tag: str, client_state: Any) -> dict:
    """Everything but the per-rank parts (``rng``, ``files``), which the commit adds from the markers."""
    names_of: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    params = []
    for gi, g in enumerate(engine.partitions.groups):
        for p, e in zip(g.params, g.layout.entries):
            info = {
                "name": e.name,
                "aliases": [n for n in names_of.get(id(p), []) if n != e.name],
                "shape": list(e.full_shape),
                "dtype": dtype_name(p.dtype),
                "numel": prod(e.full_shape),
                "group": gi,
                "kind": g.domain.kind,
            }
            if e.splits:
                info["splits"] = layout_dicts(e.splits)  # the canonical element order of the fragments
            params.append(info)
    in_state_dict = set(engine.module.state_dict(keep_vars=True))
    whole_names_of: dict[int, list[str]] = {}
    for name, t in list(engine.module.named_parameters(remove_duplicate=False)) + list(
        engine.module.named_buffers(remove_duplicate=False)
    ):
        whole_names_of.setdefault(id(t), []).append(name)
    whole = []
    for n, t in _whole_tensors(engine).items():
        names = whole_names_of.get(id(t), [n])
        splits = splits_of(t)
        info = {
            "name": n,
            "aliases": [a for a in names if a != n],
            "shape": list(full_shape_of(t.shape, splits)),
            "dtype": dtype_name(t.dtype),
            "persistent": n in in_state_dict,  # non-persistent buffers are not part of state_dict()
        }
        if splits:
            info["splits"] = layout_dicts(splits)
        whole.append(info)
    scalar = _scalar_states(engine)
    groups = []
    for gi, (g, group) in enumerate(zip(engine.partitions.groups, engine.optimizer.param_groups)):
        groups.append({"params": [e.name for e in g.layout.entries], **group_hparams(group), "state": scalar[gi]})
    cfg = engine.config
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tag": tag,
        "created_unix": time.time(),
        "world_size": engine.world_size,
        "stage": engine.stage,
        "topology": {"dp": engine.topology.dp, "tp": engine.topology.tp, "ep": engine.topology.ep},
        "compute_dtype": dtype_name(engine.compute_dtype),
        "params": params,
        "whole": whole,
        "optimizer": {
            "type": type(engine.optimizer).__name__,
            "state_names": sorted({k for d in _tensor_states(engine).values() for k in d}),
            "param_groups": groups,
        },
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "global_samples": engine.global_samples,
        "batch": {
            "train_batch_size": engine.batch.train_batch_size,
            "micro_batch_size": engine.batch.micro_batch_size,
            "gradient_accumulation_steps": engine.batch.gradient_accumulation_steps,
        },
        "config": cfg.to_dict(),
        "client_state": client_state,
    }


# ---- save ----------------------------------------------------------------------------------------------
def _sum_ranks(engine: "Engine", nbytes: int) -> int:
    """The whole checkpoint's bytes: every rank's own, summed over the group (float64 holds them exactly)."""
    if engine.comm.world == 1:
        return nbytes
    value = torch.tensor([float(nbytes)], dtype=torch.float64, device=engine.comm.device)
    return int(engine.comm.sum_scalar(value).item())


class CheckpointIO:
    """The engine's checkpoint side: at most one save in flight, and the wait points that settle it."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.pending: BackgroundSave | None = None
        self._copied: threading.Event | None = None  # set once an async save's deferred copies are made
        self.staging: dict = {}  # async saves' CPU copies, reused across saves; freed by release()
        self._copy_stream = None  # async saves copy device tensors on it (made on first use)
        self._target: tuple | None = None  # (storage, tag) of the async save in flight
        self._shared: set = set()  # the storages every rank was seen to share (checked at the first save)

    def wait(self) -> None:
        """Settle an in-flight save on every rank; a failure on any rank raises on all of them."""
        error = self.pending.wait() if self.pending is not None else None
        target, self._target = self._target, None
        self.pending, self._copied = None, None
        wait_discards()  # a replaced copy of a re-saved tag is gone
        failed = self.engine.comm.any_rank(error is not None)
        if failed and target is not None and self.engine.rank == 0:
            abort(*target)  # a failed save leaves no staging directory behind
        if error is not None:
            raise CheckpointError(f"saving the checkpoint failed on rank {self.engine.rank}: {error}") from error
        if failed:
            raise CheckpointError("saving the checkpoint failed on another rank (see its error)")

    def before_update(self) -> None:
        """Before anything overwrites the masters or the optimizer state: an async save has copied them."""
        if self._copied is not None:
            self._copied.wait()
            self._copied = None

    def release(self) -> None:
        self.staging.clear()

    def wait_local(self) -> None:
        """Process exit: finish the local part of a save without collectives."""
        if self.pending is not None:
            self.pending.wait()
            self.pending, self._copied, self._target = None, None, None
        wait_discards()

    def save(self, save_dir: str, tag: str | None, client_state: Any, async_save: bool) -> str:
        engine = self.engine
        self.wait()
        tag = tag or f"global_step{engine.global_steps}"
        if "/" in tag or tag.startswith(".") or tag == LATEST:
            raise CheckpointError(f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.')")
        client_state = _jsonable(client_state, "client_state")
        storage = Storage.resolve(save_dir)
        error = None
        if engine.rank == 0:
            try:
                prepare(storage, tag)
            except Exception as e:  # every rank must hear of it, or the others would wait forever
                error = e
        # also the barrier: the staging directory exists for every rank
        if engine.comm.any_rank(error is not None):
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(
                f"cannot create checkpoint directory under {save_dir!r}: {error or 'failed on rank 0'}; "
                "check the path and its permissions"
            )
        world = engine.comm.world
        if world > 1 and (storage.local, storage.root) not in self._shared:
            check_shared(storage, tag, engine.rank, world, engine.comm.gather_objects)
            self._shared.add((storage.local, storage.root))
        # an async save copies the state on its own thread, unless NVMe offload may move it before the step
        later: list = []
        defer = async_save and getattr(engine, "swap", None) is None and engine.partitions.param_swap is None
        from_device: list = []
        fragments = snapshot(engine, self.staging if async_save else None, later if defer else None,
                             from_device if async_save else None)
        # fail fast, before any byte is written, when the volume cannot hold the checkpoint
        short = check_space(storage, tag, _sum_ranks(engine, fragment_bytes(fragments)))
        if engine.comm.any_rank(short is not None):
            if engine.rank == 0:
                abort(storage, tag)
            raise short or StorageFullError(
                f"not enough free space for checkpoint {tag!r} under {save_dir!r} on another rank's view of the "
                "volume (see its error); nothing was written")
        device_copies = None
        if from_device:  # the host does not wait for them here: the save's thread does
            if self._copy_stream is None:
                self._copy_stream = engine.accelerator.stream()
            device_copies = copy_from_device(engine.accelerator, self._copy_stream, from_device)
        extra = {"rng": rng_state(engine.accelerator)}
        world, rank = engine.comm.world, engine.rank
        meta = {"rank": rank, "world_size": world, "tag": tag, "global_steps": engine.global_steps}
        # The manifest's contents are taken now, so a save that overlaps training records this step.
        manifest_now = build_manifest(engine, tag, client_state) if rank == 0 else {}

        def with_ranks(markers: list[dict]) -> dict:
            return {**manifest_now, "rng": [m.pop("rng") for m in markers], "files": markers}

        # a sync save under NVMe offload reads each optimizer sub-group while writing it (on this thread);
        # an async save's snapshot already copied them
        swap = getattr(engine, "swap", None)
        open_group = swap.group_resident if swap is not None and not async_save else None

        copied = threading.Event()

        def write() -> None:
            try:
                if device_copies is not None:
                    device_copies.synchronize()
                    from_device.clear()
                with torch.no_grad():
                    for source, buf in later:
                        buf.copy_(source)
            finally:
                later.clear()
                copied.set()
            write_rank(storage, staging_dir(storage, tag), rank, fragments, extra, open_group, meta)
            fragments.clear()

        def work() -> None:
            write()
            if rank == 0:
                commit(storage, tag, world, with_ranks)

        if async_save:
            self._copied = copied
            self._target = (storage, tag)
            self.pending = BackgroundSave(work)
        else:
            # every rank's write, then agreement, then rank 0's commit: a rank that fails to write (a full
            # disk may refuse even its error marker) cannot leave rank 0 waiting for its marker
            error = None
            try:
                write()
            except BaseException as e:
                error = e
            failed = engine.comm.any_rank(error is not None)
            if not failed and rank == 0:
                try:
                    commit(storage, tag, world, with_ranks)
                except BaseException as e:
                    error = e
            failed = engine.comm.any_rank(error is not None) if not failed else failed
            if failed and rank == 0:
                abort(storage, tag)  # a failed save leaves no staging directory behind
            if error is not None:
                raise CheckpointError(
                    f"saving checkpoint {tag!r} to {save_dir!r} failed on rank {rank}: {error}. The previous "
                    "checkpoint (if any) is intact; free space or pick another path and save again"
                ) from error
            if failed:
                raise CheckpointError(f"saving checkpoint {tag!r} failed on another rank; the previous one is intact")
        return tag


# ---- load ----------------------------------------------------------------------------------------------
def _check_model(engine: "Engine", manifest: dict, strict: bool) -> tuple[set[str], list[str]]:
    saved = {p["name"]: p for p in manifest["params"]}
    for alias_owner in manifest["params"]:
        for alias in alias_owner.get("aliases", []):
            saved.setdefault(alias, alias_owner)
    mine = {e.name: e for e in engine.partitions.entry_of.values()}
    missing = sorted(n for n in mine if n not in saved)
    unexpected = sorted(p["name"] for p in manifest["params"] if p["name"] not in mine and
                        not any(a in mine for a in p.get("aliases", [])))
    misshaped = sorted(
        f"{n}: checkpoint {saved[n]['shape']} vs model {list(mine[n].full_shape)}"
        for n in mine
        if n in saved and list(mine[n].full_shape) != saved[n]["shape"]
    )
    problems = []
    if missing:
        problems.append(f"missing in the checkpoint: {missing}")
    if unexpected:
        problems.append(f"unexpected (not in the model): {unexpected}")
    if misshaped:
        problems.append(f"shape mismatch: {misshaped}")
    if problems and strict:
        raise CheckpointError(
            "the checkpoint does not match the model; " + "; ".join(problems)
            + ". Load with strict=False to load the parameters that match"
        )
    loadable = {n for n in mine if n in saved and list(mine[n].full_shape) == saved[n]["shape"]}
    return loadable, problems


@torch.no_grad()
def load(engine: "Engine", load_dir: str, tag: str | None, strict: bool) -> tuple[Any, list[str]]:
    storage = Storage.resolve(load_dir)
    tag = resolve_tag(storage, tag)
    manifest = read_manifest(storage, tag)
    # the files' footers against the manifest (files of another save, ranges, coverage), before the model is
    # compared with it or anything changes
    index = FragmentIndex(storage, tag, manifest)
    loadable, problems = _check_model(engine, manifest, strict)
    saved_params = {p["name"]: p for p in manifest["params"]}
    for p in manifest["params"]:
        for alias in p.get("aliases", []):
            saved_params.setdefault(alias, p)
    opt = manifest["optimizer"]
    same_optimizer = opt["type"] == type(engine.optimizer).__name__
    if not same_optimizer and strict:
        raise CheckpointError(
            f"the checkpoint's optimizer is {opt['type']}, this engine's is {type(engine.optimizer).__name__}; "
            "load with strict=False to load weights only"
        )
    state_names = opt["state_names"] if same_optimizer else []
    saved_group_of = {n: g for g in opt["param_groups"] for n in g["params"]}
    if same_optimizer:  # before anything changes: a refused load leaves the engine as it was
        check_new_params_can_start_fresh(engine, loadable, saved_params, saved_group_of, state_names)

    torch_state: dict[int, dict] = {}
    swap = getattr(engine, "swap", None)  # NVMe offload: one sub-group in memory at a time
    for gi, (g, group) in enumerate(zip(engine.partitions.groups, engine.optimizer.param_groups)):
        loaded = [e.name in loadable for e in g.layout.entries]
        complete = all(loaded)  # then every element gets overwritten
        names = [n for n in state_names if STATE_USED_WHEN.get(n, lambda _: True)(group)]
        if swap is not None and swap.swapped_out(gi):
            if not any(loaded):  # nothing of it in the checkpoint: it keeps its master and starts fresh
                if same_optimizer:
                    swap.state_names[gi] = []
                continue
            with swap.loading(gi, names if same_optimizer else None, keep_master=not complete) as flats:
                st = _load_group(engine, index, g, group, flats, loadable, saved_params, saved_group_of,
                                 same_optimizer)
                for k, v in (st or {}).items():  # a state the config turned on since the save: zeros, swapped too
                    if k not in flats and torch.is_tensor(v) and v.shape == g.master.shape:
                        swap.zero_state(gi, k)
            if st is not None:
                torch_state[gi] = {k: swap.placeholder if k in flats else v for k, v in st.items()}
            continue
        flats = {name: _state_buffer(engine, g, name, complete) for name in names}
        st = _load_group(engine, index, g, group, flats, loadable, saved_params, saved_group_of, same_optimizer)
        if st is not None:
            torch_state[gi] = st
    if same_optimizer:
        warn_hparam_differences(engine, loadable, saved_params, saved_group_of)
        # The config wins: only the state comes from the checkpoint; every group keeps the hyper-parameters
        # (and the fused/foreach/capturable choice) the engine was built with, and the scheduler, if any,
        # sets the lr below.
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [gi]}
                  for gi, group in enumerate(engine.optimizer.param_groups)]
        # torch's own loader puts each value where this optimizer keeps it: fused/capturable steps as
        # tensors on the parameter's device, others as CPU tensors; moments in the parameter's dtype.
        engine.optimizer.load_state_dict({"state": torch_state, "param_groups": groups})
    if swap is not None:
        swap.flush()
    _load_whole(engine, index, manifest, strict)
    _load_counters(engine, manifest)
    return manifest.get("client_state"), problems


def _state_buffer(engine: "Engine", g, name: str, complete: bool) -> torch.Tensor:
    """Where group ``g``'s optimizer state ``name`` is read into: the tensor the optimizer already keeps
    for it, when it has one like the master (the load overwrites it in place: no fresh memory to fault in,
    and the optimizer keeps the same tensor), else a new one; zeroed first unless every element is loaded."""
    t = engine.optimizer.state.get(g.master, {}).get(name)
    if not (torch.is_tensor(t) and t.shape == g.master.shape and t.dtype == g.master.dtype
            and t.device == g.master.device and t.is_contiguous()):
        return torch.empty_like(g.master) if complete else torch.zeros_like(g.master)
    return t if complete else t.zero_()


def _load_group(engine: "Engine", index: FragmentIndex, g, group: dict, flats: dict[str, torch.Tensor],
                loadable: set[str], saved_params: dict, saved_group_of: dict, same_optimizer: bool) -> dict | None:
    """Fill group ``g``'s master and the optimizer state tensors ``flats`` from the checkpoint; return the
    group's optimizer state for torch's loader (None: the group starts fresh)."""
    loaded = [e.name in loadable for e in g.layout.entries]
    step_info = None
    for p, e in zip(g.params, g.layout.entries):
        if e.name not in loadable:
            continue
        saved_name = saved_params[e.name]["name"]
        lo, hi = _local_range(engine, e)
        for name, flat in flats.items():  # padding past the owned range stays zero
            flat[e.partition_offset + hi - lo : e.partition_offset + e.chunk].zero_()
        if hi > lo:
            fill = slice_filler(index, saved_params[e.name], e)
            fill(saved_name, STATE_MASTER, lo, hi, g.master[e.partition_offset : e.partition_offset + hi - lo])
            for name, flat in flats.items():
                fill(saved_name, name, lo, hi, flat[e.partition_offset : e.partition_offset + hi - lo])
        if step_info is None and saved_name in saved_group_of:
            step_info = saved_group_of[saved_name].get("state", {})
    # A group of only new parameters (strict=False) gets no state: torch starts it fresh, at step 0.
    if not (same_optimizer and any(loaded) and (flats or step_info)):
        return None
    st: dict[str, Any] = dict(flats)
    for k, info in (step_info or {}).items():
        if info["kind"] == "tensor":
            st[k] = torch.tensor(info["value"], dtype=getattr(torch, info["dtype"]))
        else:
            st[k] = int(info["value"]) if info["kind"] == "int" else float(info["value"])
    for name in STATE_STARTS_AT_ZERO:  # turned on by the config since the save
        if name not in st and STATE_USED_WHEN[name](group) and "step" in st:
            st[name] = torch.zeros_like(g.master)
    return st


def _load_whole(engine: "Engine", index: FragmentIndex, manifest: dict, strict: bool) -> None:
    """Buffers and frozen parameters, saved whole (or as their EP/TP slices)."""
    saved_whole = {w["name"]: w for w in manifest.get("whole", [])}
    for name, t in _whole_tensors(engine).items():
        if (name, STATE_WHOLE) in index.where:
            flat = torch.empty(t.numel(), dtype=t.dtype)
            splits = splits_of(t)
            if splits or saved_whole.get(name, {}).get("splits"):
                saved = dict(saved_whole[name], numel=prod(saved_whole[name]["shape"]))
                here = SimpleNamespace(splits=splits, canonical_offset=slice_index(splits) * t.numel())
                slice_filler(index, saved, here)(name, STATE_WHOLE, 0, t.numel(), flat)
            else:
                index.fill(name, STATE_WHOLE, 0, t.numel(), flat)
            t.data.copy_(flat.view(t.shape))
        elif strict:
            raise CheckpointError(f"the checkpoint has no buffer or frozen parameter {name!r}; load with strict=False")


def _load_counters(engine: "Engine", manifest: dict) -> None:
    """Scheduler, loss scaler, step counters and RNG streams."""
    if manifest.get("scheduler") is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(manifest["scheduler"])
    engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    engine.global_steps = manifest["global_steps"]
    engine.skipped_steps = manifest["skipped_steps"]
    engine.global_samples = manifest["global_samples"]
    # Micro-steps continue in the current accumulation schedule, which may differ after a resize.
    engine.micro_steps = manifest["global_steps"] * engine.gradient_accumulation_steps
    saved_layout = manifest.get("topology", {})
    same_layout = saved_layout.get("tp", 1) == engine.topology.tp and saved_layout.get("ep", 1) == engine.topology.ep
    if manifest["world_size"] == engine.world_size and same_layout:
        set_rng_state(manifest["rng"][engine.rank], engine.accelerator)
    else:
        # new ranks: derive each data shard's streams afresh (the ranks of a TP group share theirs)
        rederive_rng(engine.config.seed, engine.global_steps, engine.dp_rank, engine.accelerator)
