"""The one place where third-party behaviour is patched: Megatron-Core on machines without CUDA.

Why this exists: Megatron-Core assumes a GPU in a handful of places that have nothing to do with the
math (device="cuda" defaults, `torch.cuda.current_device()` as an allocation device, stream and
synchronize calls, the CUDA RNG tracker, and `Tensor.type()` checks for 'torch.cuda.*Tensor').
Redirecting exactly those to the CPU lets the *same* model, schedule, DDP and optimizer code run
on gloo with fp32 tiny models, so CI exercises the real code paths instead of mocks.

Rules kept here:
- `apply()` is called once at start-up by `runtime.distributed` and only when CUDA is absent;
  with CUDA present it refuses, so no GPU run can ever be altered by this module.
- Every patch is listed in `PATCHES` with the Megatron call site that needs it; `is_applied()`
  and the tests use that list.
- Nothing else in the project may patch torch, megatron or any other library.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from torch.overrides import TorchFunctionMode

PATCHES = {
    "torch.cuda.current_device": "allocation device in p2p_communication, param_and_grad_buffer",
    "torch.cuda.synchronize": "p2p_communication, DDP buffer start/free",
    "torch.cuda.empty_cache": "optimizer and DDP buffer release",
    "torch.cuda.Stream / stream / default_stream": "DDP overlapped grad reduce",
    "torch.cuda.Event": "timers and inference engine",
    "torch.cuda.memory_stats / memory_allocated / max_memory_allocated": "memory reports",
    "torch.cuda.get_rng_state / set_rng_state / manual_seed": "CudaRNGStatesTracker.add, seeding",
    "megatron tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state": "tracker fork",
    "device='cuda' arguments and Tensor.cuda()": "causal masks, loss counters (TorchFunctionMode)",
    "Tensor.type() -> 'torch.cuda.*Tensor'": "optimizer dtype checks (TorchFunctionMode)",
    "vllm _CPUSHMDistributed.make_group_name": "per-job /dev/shm names (vllm_engine, CPU only)",
    "megatron moe maybe_move_tensor_to_cpu(as_numpy=True)": "alltoall token dispatcher's split "
    "sizes: host tensors were left as tensors, which all_to_all_single refuses",
    "torch.cuda stand-ins again after vLLM's CPU worker started": "vLLM replaces them with "
    "placeholders whose record_event returns None, on which the MoE token dispatcher waits",
    "vllm CPUUnquantizedExperts.apply with an expert_map": "vLLM's expert parallelism on CPUs "
    "(vllm_engine, CPU only): the CPU kernel indexes its local experts by global expert ids "
    "and reads past them (SIGSEGV); ids become local slots, other experts' weights 0",
    "vllm CpuCommunicator.all_gatherv / reduce_scatterv": "vLLM's expert parallelism over "
    "data-parallel instances on CPUs (vllm_engine, CPU only): its naive all-to-all gathers "
    "each instance's tokens and sums the outputs back with these, which the CPU communicator "
    "lacks (NotImplementedError)",
    "glibc malloc: freed memory kept in the process (mallopt)": "every CPU forward and backward "
    "(activations, logits): returned to the system at each free, the next step's tensors "
    "page-faulted fresh zeroed pages, 20-25% of a SmolLM2-135M step in the kernel",
    "torch._dynamo.config.disable (torch.compile'd functions run as written)": "vLLM's sampler "
    "ops (batched_count_greater_than for every log-prob): inductor builds them with the C++ "
    "compiler in every process, about 7 s at each engine's first generate",
}

_applied = False
_mode: "_CudaToCpuMode | None" = None


def is_applied() -> bool:
    """Whether the CPU compatibility layer is active in this process."""
    return _applied


def apply() -> None:
    """Redirect Megatron-Core's CUDA-only calls to the CPU. Idempotent; refuses with CUDA present."""
    global _applied, _mode
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("mcore_rl.runtime.cpu_compat.apply() called with CUDA available; "
                           "the CPU compatibility layer is only for machines without a GPU")
    _patch_torch_cuda()
    _patch_megatron_rng()
    _patch_megatron_moe_splits()
    _run_compiled_functions_as_written()
    _keep_freed_memory_in_the_process()
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    _applied = True


class _NoOpStream:
    """Stands in for torch.cuda.Stream: on the CPU all work is already ordered."""

    device = torch.device("cpu")

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()


class _CpuEvent:
    """Stands in for torch.cuda.Event, measuring wall time on the CPU."""

    def __init__(self, enable_timing: bool = False, **kwargs):
        self._time = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._time - self._time) * 1000.0


def reclaim_cuda_stand_ins() -> None:
    """Put this module's torch.cuda stand-ins back after a vLLM CPU engine started: importing
    vLLM's CPU worker replaces torch.cuda.Stream, Event, current_stream and stream with
    placeholders of its own, whose ``record_event()`` returns None, and Megatron's MoE alltoall
    dispatcher then fails synchronizing on that event. Ours do everything vLLM's do."""
    if _applied:
        _patch_torch_cuda()


def name_vllm_cpu_segments_per_job(job: str) -> None:
    """vLLM's CPU tensor-parallel communicator names its /dev/shm segments after the init
    method's tail, which is "//" for every job started with env:// (external_launcher), so two
    jobs on one machine - or a job and the segments a killed one left - collide
    (`create shm in SHMManager failed. errno: 17`). Give them the job's name instead. `job`:
    identical on every rank of the job, unique among the jobs of one machine, no '/'."""
    if torch.cuda.is_available():
        raise RuntimeError("name_vllm_cpu_segments_per_job is for vLLM's CPU backend only")
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    original = getattr(shm.make_group_name, "_vllm_original", shm.make_group_name)

    def make_group_name(communicator):
        os.environ["VLLM_DIST_IDENT"] = job
        return original(communicator)

    make_group_name._vllm_original = original
    shm.make_group_name = staticmethod(make_group_name)


def serve_local_experts_in_vllm_cpu_kernel() -> None:
    """vLLM's CPU fused-MoE kernel ignores the expert map of expert parallelism: it takes the
    routers' global expert ids as indices into the rank's local experts (out of bounds for
    every expert another rank serves). Map them to local slots first and give the experts this
    rank does not serve weight 0: each rank then adds its own experts' share, and vLLM's
    all-reduce over the expert-parallel ranks sums them, as the GPU kernels do."""
    if torch.cuda.is_available():
        raise RuntimeError("serve_local_experts_in_vllm_cpu_kernel is for vLLM's CPU backend only")
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    original = getattr(CPUUnquantizedExperts.apply, "_vllm_original",
                       CPUUnquantizedExperts.apply)

    def apply(self, *, topk_weights, topk_ids, expert_map, **kwargs):
        if expert_map is not None:
            local = expert_map[topk_ids.long()]
            topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = local.clamp(min=0).to(topk_ids.dtype)
        return original(self, topk_weights=topk_weights, topk_ids=topk_ids,
                        expert_map=expert_map, **kwargs)

    apply._vllm_original = original
    CPUUnquantizedExperts.apply = apply


def exchange_variable_sizes_in_vllm_cpu_communicator() -> None:
    """vLLM's expert parallelism over data-parallel instances gathers every instance's tokens
    before the expert layer (`all_gatherv`, a different count from each) and sums the experts'
    outputs back to their instances after it (`reduce_scatterv`); its CPU communicator has
    neither. Give it both, over its process group, along dim 0 (the only one the all-to-all
    uses): the gather pads each part to the largest and trims it after; the reduce-scatter
    all-reduces the whole and keeps this rank's rows (more bytes than a reduce-scatter, the
    same sums)."""
    if torch.cuda.is_available():
        raise RuntimeError("exchange_variable_sizes_in_vllm_cpu_communicator is for vLLM's CPU "
                           "backend only")
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    def all_gatherv(self, input_, dim: int = 0, sizes=None):
        if dim != 0:
            raise NotImplementedError("only dim 0 all-gatherv is supported")
        tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
        sizes = sizes or [tensors[0].shape[0]] * self.world_size
        gathered = []
        for tensor in tensors:
            padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
            padded[:tensor.shape[0]] = tensor
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded, group=self.device_group)
            gathered.append(torch.cat([part[:size] for part, size in zip(parts, sizes)]))
        return gathered[0] if isinstance(input_, torch.Tensor) else gathered

    def reduce_scatterv(self, input_, dim: int = -1, sizes=None):
        if dim not in (0, -input_.dim()):
            raise NotImplementedError("only dim 0 reduce-scatterv is supported")
        sizes = sizes or [input_.shape[0] // self.world_size] * self.world_size
        total = input_.clone()
        dist.all_reduce(total, group=self.device_group)
        start = sum(sizes[:self.rank_in_group])
        return total[start:start + sizes[self.rank_in_group]].contiguous()

    def reduce_scatterv_into_output(self, input_, output, dim: int = -1, sizes=None):
        return output.copy_(reduce_scatterv(self, input_, dim, sizes))

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv
    CpuCommunicator.reduce_scatterv_into_output = reduce_scatterv_into_output


# mallopt parameters (malloc.h) and the values set: blocks up to glibc's largest mmap threshold
# come from the heap, and the heap is not trimmed back to the system while a run lives.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TOP_PAD_BYTES = 512 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 2 ** 31 - 1  # mallopt takes an int: its largest
SYSTEM_MALLOC_VARIABLE = "MCORE_RL_CPU_MALLOC"
"""Set to "system" to keep glibc's defaults (a smaller resident set, slower steps)."""


def _keep_freed_memory_in_the_process() -> None:
    """glibc's default returns a freed block above 128 KiB to the system, and the next step's
    tensor of the same size faults in zeroed pages again; keeping them made a SmolLM2-135M
    SFT step 1.20x faster (bench/cpu_allocator.py, docs/training.md). No-op on a C library
    without mallopt (musl) and with MCORE_RL_CPU_MALLOC=system."""
    import ctypes
    import ctypes.util

    if os.environ.get(SYSTEM_MALLOC_VARIABLE) == "system":
        return
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError):
        return
    for parameter, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                             (M_TOP_PAD, TOP_PAD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        mallopt(ctypes.c_int(parameter), ctypes.c_int(value))


def _run_compiled_functions_as_written() -> None:
    """A torch.compile'd function runs as plain PyTorch (the same operations): on a CPU its
    compiled form is C++ code built per process, seconds of compiler for microseconds of work."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NoOpStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _NoOpStream()
    cuda.default_stream = lambda device=None: _NoOpStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.memory_stats = lambda device=None: {}
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = get_state
    mcore_random._set_cuda_rng_state = set_state


def _patch_megatron_moe_splits() -> None:
    """The alltoall token dispatcher turns its per-rank token counts into split sizes with
    `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors: on the CPU
    the counts stay tensors and torch's all_to_all_single refuses them. Host tensors asked for
    as numpy now become numpy, as GPU ones do."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites device='cuda' (or a CUDA index) to the CPU, makes Tensor.cuda() a no-op,
    drops pin_memory, and answers Tensor.type() with the CUDA type names Megatron checks for."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype, args[0].type())
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)

