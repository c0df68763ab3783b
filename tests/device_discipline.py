"""Device discipline on a CPU-only machine: a pretend host / accelerator split.

On a GPU, a tensor that mcore_rl builds without `device=` lives in host memory; handing it to a
CUDA model, mixing it into an op with CUDA tensors or giving it to an NCCL collective fails. On
the CPU everything is host memory and these bugs pass silently. Inside `discipline()`:

- a tensor that mcore_rl code builds with a factory and no `device=` (`torch.arange(n)`,
  `torch.tensor(x)`, `torch.zeros(shape)`, ...) is a *host* tensor: a wrapper holding CPU data
  that reports the device `meta`, so `.to(t.device)` and `device=t.device` follow it;
- everything else (model parameters, tensors built with an explicit device such as the
  runtime's `cpu`, tensors moved with `.to(device)`, whatever libraries build) is on the
  *accelerator*;
- an op that mixes an accelerator tensor with a host tensor that is not 0-dim raises
  DeviceMismatch (CUDA's rule: only 0-dim CPU tensors may join CUDA ops; copies between the
  two and host index tensors are allowed), and so does a collective handed a host tensor.

Values are computed for real, so whole training steps run with their usual numbers.

`HostSynchronisations` counts the other GPU-only cost a CPU cannot show: reads of a device
value on the host, each of which stalls the stream.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

HOST = torch.device("meta")
"""The device host tensors report."""

PACKAGE = "mcore_rl"
"""Code whose bare factories build host tensors."""

_NOT_CALLERS = ("torch", "mcore_rl.runtime.cpu_compat", __name__)
"""Modules between a factory call and its caller (torch-function modes and their helpers)."""


class DeviceMismatch(RuntimeError):
    """A tensor met an op or a collective on another device than its own."""


class HostTensor(torch.Tensor):
    """CPU data presented as living in host memory (device `meta`)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=HOST, requires_grad=False)

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def __repr__(self):
        return f"HostTensor({self.elem!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _UNWRAPPED_METHODS:
            return _unwrapped_method(func, args, kwargs or {})
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


_UNWRAPPED_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__,
                      torch.Tensor.__reduce_ex__, torch.Tensor.__deepcopy__}
_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye}
_aten = torch.ops.aten
_COPIES = {_aten.copy_.default, _aten._to_copy.default}
"""Ops that move data between the two sides (legal across devices)."""
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
             _aten._index_put_impl_.default}
"""Ops whose index tensors may stay on the host (argument 1)."""


def _unwrap(value):
    return value.elem if isinstance(value, HostTensor) else value


def _unwrapped_method(func, args, kwargs):
    if func is torch.Tensor.__deepcopy__:
        return HostTensor(copy.deepcopy(args[0].elem, *args[1:]))
    return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))


def _is_host(device) -> bool:
    return device is not None and torch.device(device).type == HOST.type


def _describe(tensors) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)


def _refuse_mixed_devices(func, args, kwargs) -> None:
    if func in _COPIES:
        return
    operands = (args[0], args[2:], kwargs) if func in _INDEXING else (args, kwargs)
    tensors = [t for t in tree_flatten(operands)[0] if isinstance(t, torch.Tensor)]
    host = [t for t in tensors if isinstance(t, HostTensor) and t.dim() > 0]
    device = [t for t in tensors if not isinstance(t, HostTensor)]
    if host and device:
        raise DeviceMismatch(f"{func}: host tensors [{_describe(host)}] meet accelerator "
                             f"tensors [{_describe(device)}]; on a GPU this op fails")


def _result_on_host(func, args, kwargs) -> bool:
    if "device" in kwargs and kwargs["device"] is not None:
        return _is_host(kwargs["device"])
    if func in _COPIES or func in _INDEXING:
        return isinstance(args[0], HostTensor)
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(isinstance(t, HostTensor) for t in tensors)


def _dispatch(func, args, kwargs):
    _refuse_mixed_devices(func, args, kwargs)
    on_host = _result_on_host(func, args, kwargs)
    if _is_host(kwargs.get("device")):
        kwargs = dict(kwargs, device=torch.device("cpu"))
    result = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if not on_host:
        return result
    if isinstance(args[0], HostTensor) and result is args[0].elem:  # in place
        return args[0]
    return tree_map(lambda t: HostTensor(t) if isinstance(t, torch.Tensor) else t, result)


class _HostDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


class _BareFactoriesOnHost(TorchFunctionMode):
    """Factories called from mcore_rl without `device=` (or with the host's) build host
    tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _UNWRAPPED_METHODS and args and isinstance(args[0], HostTensor):
            return _unwrapped_method(func, args, kwargs)
        if func in _FACTORIES and _builds_on_host(kwargs.get("device")):
            return HostTensor(func(*args, **dict(kwargs, device=torch.device("cpu"))))
        if func is torch.from_numpy and _called_from_package():
            return HostTensor(func(*args, **kwargs))
        return func(*args, **kwargs)


def _builds_on_host(device) -> bool:
    return _is_host(device) or (device is None and _called_from_package())


def _called_from_package() -> bool:
    """Whether the code calling the factory is mcore_rl's."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_NOT_CALLERS):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith(PACKAGE + ".")


_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "reduce", "send", "recv", "isend", "irecv",
                "all_to_all_single", "batch_isend_irecv")


def _checked_collective(name: str, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        operands = [op.tensor for op in args[0]] if name == "batch_isend_irecv" \
            else tree_flatten((args, kwargs))[0]
        host = [t for t in operands if isinstance(t, HostTensor)]
        if host:
            raise DeviceMismatch(f"torch.distributed.{name} was handed host tensors "
                                 f"[{_describe(host)}]; NCCL needs them on the GPU")
        return original(*args, **kwargs)
    return collective


@contextlib.contextmanager
def discipline():
    """Run the block with the host / accelerator split described above (in a process of
    its own: it patches torch.distributed's collectives while it lasts)."""
    from torch.distributed import distributed_c10d

    from mcore_rl.runtime import cpu_compat

    cpu_compat.apply()  # its torch-function mode first, so ours sees each call before it
    # Both modules: P2POp accepts only the functions distributed_c10d itself calls isend/irecv.
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}
    for name, original in originals.items():
        checked = _checked_collective(name, original)
        for module in (dist, distributed_c10d):
            setattr(module, name, checked)
    try:
        with _BareFactoriesOnHost(), _HostDispatch():
            yield
    finally:
        for name, original in originals.items():
            for module in (dist, distributed_c10d):
                setattr(module, name, original)


class HostSynchronisations(TorchDispatchMode):
    """Counts what stalls a GPU's stream: a tensor's value read on the host (`.item()`,
    `bool()`, `int()` of a tensor all dispatch to aten._local_scalar_dense)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
