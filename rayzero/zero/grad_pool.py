"""Weight gradients of ``nn.Linear`` computed into host buffers that rayzero reuses (issue 27).

On a CPU device, every backward allocates one fresh weight gradient per ``nn.Linear`` (4096 x 1024 fp32 is
16 MiB), the gradient reducer copies it into its bucket and drops it, and the next layer allocates the next
one.  torch takes CPU tensors from ``posix_memalign(64, n)``, and glibc frees the alignment slivers on
either side of each block into its per-thread cache of small blocks, where they count as in use: a freed
gradient cannot merge with its neighbours and is 96 bytes short for the next ``posix_memalign(64, n)``.
Each gradient therefore takes fresh heap for the first steps, and the holes stay resident (the host
allocator keeps freed memory for reuse: accelerator/host_allocator.py).  On the bench model at ZeRO-3 that
was ~93 MiB of free heap per rank (bench/README.md, "Where the excess over the model is").

The fix is to not ask the allocator: a managed ``nn.Linear`` runs through :class:`_PooledLinear`, whose
backward computes the weight gradient with the same matrix product autograd uses (``grad_out^T @ input``,
so the values are bit for bit autograd's) into a buffer taken from a :class:`GradientPool`.  Autograd
hands that tensor to the parameter as its ``.grad`` (it is the only reference, so it is not copied); the
reducer copies it into its bucket and gives it back to the pool once nothing reads it any more
(zero/reducer.py).  The pool keeps one buffer per gradient size (given another shape of as many elements
in place), so a backward reuses the same block from one layer to the next.

The pool takes back only a tensor nobody else can see: no other reference to the tensor, no view of its
storage.  A gradient a user's hook kept is simply not reused.  It is used on a CPU device (an accelerator's
caching allocator already reuses its blocks), without graph capture (the captured step has its own
buffers) and outside autocast (where the product would run in another dtype than autograd's); everywhere
else ``nn.Linear`` runs as it always does.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F


class GradientPool:
    """Free gradient buffers by size and dtype, at most ``keep`` of each."""

    def __init__(self, keep: int = 1):
        self.keep = keep
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._wanted: set[tuple] = set()  # what take() is asked for: other gradients are not kept
        self.taken = 0  # buffers handed out (tests)
        self.reused = 0  # of them, ones that came from the pool

    def take(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape``, its content undefined: a kept one of as many elements (given
        the new shape in place, so it is not a view), else a new one."""
        self.taken += 1
        key = (torch.Size(shape).numel(), dtype, device)
        self._wanted.add(key)
        free = self._free.get(key)
        if free:
            self.reused += 1
            return free.pop().resize_(shape)
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> bool:
        """Keep ``t`` for reuse when the caller's one name for it is the only reference anywhere (the
        caller drops that name after the call); returns whether it was kept."""
        # references: the caller's name, this frame's argument and getrefcount's own; in C++ only the Python
        # object; the storage: this tensor and the temporary storage object below
        if (sys.getrefcount(t) != 3 or t._use_count() != 1 or t._base is not None or t.requires_grad
                or torch._C._storage_Use_Count(t.untyped_storage()._cdata) != 2 or not t.is_contiguous()):
            return False
        key = (t.numel(), t.dtype, t.device)
        if key not in self._wanted:
            return False
        free = self._free.setdefault(key, [])
        if len(free) >= self.keep:
            return False
        free.append(t)
        return True

    def clear(self) -> None:
        self._free.clear()


class _PooledLinear(torch.autograd.Function):
    """``F.linear`` whose backward computes the weight gradient into a pooled buffer (module docstring)."""

    @staticmethod
    def forward(ctx, x, bias, weight, pool):
        # (as autograd's own linear: the weight only where the input needs a gradient)
        ctx.save_for_backward(x, weight if x.requires_grad else None)
        ctx.pool = pool
        ctx.weight_shape = weight.shape
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        go = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = go.mm(weight).view(*grad_out.shape[:-1], ctx.weight_shape[1])
        if ctx.needs_input_grad[2]:
            if torch.is_grad_enabled():  # a backward that builds a graph (create_graph): no out= buffer
                grad_w = go.t().mm(x.reshape(-1, x.shape[-1]))
            else:
                grad_w = ctx.pool.take(ctx.weight_shape, grad_out.dtype, grad_out.device)
                torch.mm(go.t(), x.reshape(-1, x.shape[-1]), out=grad_w)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_b = go.sum(0)
        return grad_x, grad_b, grad_w, None


def _pooled_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if (torch.is_grad_enabled() and self.weight.requires_grad and x.dtype == self.weight.dtype
            and not torch.is_autocast_enabled(x.device.type) and x.dim() >= 2):
        # the bias before the weight: autograd's engine then hands their gradients to the reducer in the
        # order its own linear does (the bias's first), which is the order of the reducer's buckets
        return _PooledLinear.apply(x, self.bias, self.weight, self._rayzero_grad_pool)
    return F.linear(x, self.weight, self.bias)


# named as the method it stands in for: a pickled model (torch.save of the module) stores a bound method as
# its object and name, and loads that name's method back (the layer's own forward) instead of failing
_pooled_forward.__name__ = _pooled_forward.__qualname__ = "forward"


def pool_linear_gradients(model: torch.nn.Module, params: set, pool: GradientPool) -> list[torch.nn.Linear]:
    """Route the weight gradients of ``model``'s plain ``nn.Linear`` layers whose weight is in ``params``
    through ``pool``; returns the layers changed (for :func:`unpool_linear_gradients`)."""
    changed = []
    for m in model.modules():
        if type(m) is torch.nn.Linear and m.weight in params and "forward" not in m.__dict__:
            m._rayzero_grad_pool = pool
            m.forward = types.MethodType(_pooled_forward, m)
            changed.append(m)
    return changed


def unpool_linear_gradients(layers: list[torch.nn.Linear]) -> None:
    for m in layers:
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_rayzero_grad_pool", None)
