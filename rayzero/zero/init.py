"""``rayzero.zero_init()``: build a model for ZeRO stage 3 without any rank ever holding it whole.

Inside the context, every ``nn.Module``'s own parameters are sharded the moment that module's constructor
returns: the rank keeps only its fp32 shard (see ``zero/layout.py``) and the parameter keeps its shape over
a one-element stand-in storage.  The constructor itself runs for real on real tensors, consuming the random
number generator exactly as a plain construction does, so the shards are exactly the slices of the weights
a full construction from the same RNG state would produce.  Peak memory is the largest single module's
parameters, not the model's.

Code that touches an already-sharded parameter later in construction (a parent re-initialising its
children, ``model.apply(init_weights)``, weight tying followed by an in-place init) is handled too: any
torch operation on a sharded parameter inside the context gathers it, runs, and re-shards the result.
All ranks must build the model with the same code and the same RNG state (``seed`` does that for you).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from rayzero.comm import Communicator, init_distributed
from rayzero.zero.layout import ceil_div


class _ShardFiles:
    """A swap store of zero_init's own under the config's NVMe path (``<nvme_path>/rayzero-swap/<host>-<pid>-
    rank<r>-zero-init-*``): one file per shard until the engine has read it into the master (the file goes
    with its handle), the directory once the context has exited and the last shard is gone (or at process
    exit)."""

    def __init__(self, path: str, rank: int):
        import tempfile

        from rayzero.offload.swap_dirs import hostname, prepare_root, remove_stale, write_owner
        from rayzero.offload.swap_store import SwapStore

        # beside the engines' swap directories, with the same owner record: a run killed before its engine
        # read the shards leaves a directory that the next run on this host removes (swap_dirs.remove_stale)
        root = prepare_root(path)
        remove_stale(root)
        self.directory = tempfile.mkdtemp(prefix=f"{hostname()}-{os.getpid()}-rank{rank}-zero-init-", dir=root)
        write_owner(Path(self.directory), rank=rank)
        self.store = SwapStore(self.directory)
        self.count = 0
        self.live = 0
        self.sealed = False  # the zero_init context has exited: no more shards
        self._closer = weakref.finalize(self, _close_shard_files, self.store, self.directory)

    def write(self, shard: torch.Tensor) -> "SwappedShard":
        self.count += 1
        self.live += 1
        key = f"shard{self.count}"
        self.store.write(key, shard).result()
        return SwappedShard(self, key, shard.numel())

    def dropped(self, key: str) -> None:
        self.live -= 1
        try:
            self.store.remove(key)
        except Exception:  # the store was closed first (process exit): its files went with it
            pass
        self._close_if_done()

    def seal(self) -> None:
        self.sealed = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.sealed and self.live == 0:
            self._closer()


def _close_shard_files(store, directory: str) -> None:
    import shutil

    store.close(remove_files=True)
    shutil.rmtree(directory, ignore_errors=True)  # (its owner record)
    try:  # leave nvme_path as it was when this was the last directory in it
        os.rmdir(os.path.dirname(directory))
    except OSError:
        pass


class SwappedShard:
    """A zero_init shard kept in a file (``zero_init(config=...)`` with NVMe offload), not in memory: what
    ``p._rayzero_shard`` holds then.  ``read_into`` fills a tensor with it; the file goes with the handle."""

    def __init__(self, files: _ShardFiles, key: str, numel: int):
        self._files, self._key, self._numel = files, key, numel
        weakref.finalize(self, files.dropped, key)

    def numel(self) -> int:
        return self._numel

    def read_into(self, out: torch.Tensor) -> None:
        self._files.store.read(self._key, out).result()

    def load(self, device: torch.device) -> torch.Tensor:
        from rayzero.offload.swap_store import aligned_empty

        out = aligned_empty(self._numel, torch.float32)
        self.read_into(out)
        return out.to(device)


def _nvme_path(config: Any) -> str | None:
    """Where zero_init keeps its shards: the config's NVMe path, when it offloads parameters or the
    optimizer to NVMe (parameters first, as the engine's swap does), else None (in memory)."""
    if config is None:
        return None
    from rayzero.config import Config, ConfigError

    try:
        z = Config.from_any(config).zero_optimization
    except ConfigError:  # initialize reads the same config and says what is wrong with it
        return None
    if z.offload_param.device == "nvme":
        return z.offload_param.nvme_path
    if z.offload_optimizer.device == "nvme":
        return z.offload_optimizer.nvme_path
    return None


class _ShardState:
    def __init__(self, comm: Communicator, nvme_path: str | None = None):
        from rayzero.accelerator import get_accelerator

        self.comm = comm
        self.world = comm.world
        self.rank = comm.rank
        acc = get_accelerator()
        # shards live where the engine's partitions and the group's collectives will want them
        self.device = torch.device("cpu") if acc.name == "cpu" else acc.device()
        # with NVMe offload, in files until the engine reads them (the rank never holds them all)
        self.files = _ShardFiles(nvme_path, self.rank) if nvme_path else None

    @torch.no_grad()
    def shard(self, p: torch.nn.Parameter) -> None:
        numel = p.numel()
        chunk = ceil_div(numel, self.world)
        flat = p.detach().reshape(-1)
        start = min(self.rank * chunk, numel)
        end = min(start + chunk, numel)
        if self.files is not None:
            from rayzero.offload.swap_store import aligned_empty

            buf = aligned_empty(chunk, torch.float32)  # zero-filled by the kernel: the padding is zero
            buf[: end - start].copy_(flat[start:end])
            shard = self.files.write(buf)
            del buf
        else:
            shard = torch.zeros(chunk, dtype=torch.float32, device=self.device)
            shard[: end - start].copy_(flat[start:end])
        # A one-element stand-in keeps the shape; writing to it raises instead of corrupting anything.
        # (Mark the parameter only afterwards: the assignment is itself a torch call the mode sees.)
        p.data = torch.zeros(1, dtype=p.dtype).expand(p.shape)
        p._rayzero_shard = shard

    @torch.no_grad()
    def materialize(self, p: torch.nn.Parameter) -> None:
        shard = p._rayzero_shard
        if isinstance(shard, SwappedShard):
            shard = shard.load(self.device)
        chunk = shard.numel()
        rows = torch.empty((self.world, chunk), dtype=torch.float32, device=shard.device)
        self.comm.all_gather(rows, shard).wait()
        # rank r's shard is elements [r * chunk, (r + 1) * chunk): the rows, read in order, are the whole
        # parameter plus under `world` elements of padding, so it is a view of them (no second copy)
        p.data = rows.view(-1)[: p.numel()].view(p.shape).to(p.dtype)
        del p._rayzero_shard


def materialize_frozen(p: torch.nn.Parameter, comm: Communicator) -> None:
    """Make a parameter sharded by zero_init whole again (frozen parameters are not partitioned)."""
    _ShardState(comm).materialize(p)


class _GatherOnUse(TorchFunctionMode):
    """Any torch call that touches a sharded parameter sees it whole, and re-shards it after."""

    def __init__(self, state: _ShardState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        sharded = list(
            dict.fromkeys(t for t in leaves if isinstance(t, torch.nn.Parameter) and hasattr(t, "_rayzero_shard"))
        )
        # Attribute reads (shape, dtype, ...) need no gathering.
        if not sharded or getattr(func, "__name__", "") in ("__get__", "size", "dim", "numel"):
            return func(*args, **kwargs)
        for p in sharded:
            self.state.materialize(p)
        try:
            return func(*args, **kwargs)
        finally:
            for p in sharded:
                self.state.shard(p)


@contextlib.contextmanager
def zero_init(seed: int | None = None, config: Any = None) -> Iterator[None]:
    """Construct modules inside this context to shard their parameters as they are built (stage 3).

    ``config``: the training config (a dict, a path to a JSON file, or a ``Config``), as DeepSpeed's
    ``zero.Init(config_dict_or_path=...)`` takes it.  Where it offloads the optimizer or the parameters, the
    host allocator gives freed memory back from here on (rayzero/accelerator/host_allocator.py), so the
    full-size weights each module builds before it is sharded do not stay in the heap.  Where it offloads
    the parameters or the optimizer to NVMe, each shard is written to a file under that ``nvme_path`` as
    it is made (as DeepSpeed's ``zero.Init(remote_device="nvme")`` keeps them there), so the rank never holds
    its shards: the engine reads each into its master and the file goes.
    """
    if config is not None:
        from rayzero.accelerator.host_allocator import configure_host_allocator
        from rayzero.config import Config, ConfigError

        try:
            z = Config.from_any(config).zero_optimization
        except ConfigError:  # initialize reads the same config and says what is wrong with it
            z = None
        if z is not None and (z.offload_optimizer.device in ("cpu", "nvme") or z.offload_param.device != "none"):
            configure_host_allocator(True)
    init_distributed()
    state = _ShardState(Communicator.for_group(None), _nvme_path(config))
    if seed is not None:
        torch.manual_seed(seed)

    depth: dict[int, int] = {}
    wrapped: dict[type, object] = {}

    def wrap(cls: type) -> None:
        if "__init__" not in cls.__dict__ or cls in wrapped:
            return
        original = cls.__dict__["__init__"]
        wrapped[cls] = original

        def __init__(self, *args, **kwargs):
            key = id(self)
            depth[key] = depth.get(key, 0) + 1
            try:
                original(self, *args, **kwargs)
            finally:
                depth[key] -= 1
                if depth[key] == 0:
                    del depth[key]
                    for p in self._parameters.values():
                        if p is not None and not hasattr(p, "_rayzero_shard") and p.numel() > 0:
                            state.shard(p)

        __init__.__wrapped__ = original
        cls.__init__ = __init__

    def all_subclasses(cls: type) -> list[type]:
        out, todo = [], [cls]
        while todo:
            c = todo.pop()
            out.append(c)
            todo.extend(c.__subclasses__())
        return out

    for cls in all_subclasses(torch.nn.Module):
        wrap(cls)
    original_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        super(torch.nn.Module, cls).__init_subclass__(**kwargs)
        wrap(cls)

    torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
    try:
        with _GatherOnUse(state):
            yield
    finally:
        if state.files is not None:
            state.files.seal()  # its directory goes once the engine has read the last shard
        for cls, original in wrapped.items():
            cls.__init__ = original
        if original_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = original_init_subclass
