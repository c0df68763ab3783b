"""Park a trained model's parameters, gradients and optimizer state in host memory.

On a colocated node the rollout engine and the trained roles take turns on the same GPUs: while
vLLM generates, the actor's and critic's weights, fp32 master weights and Adam moments would
otherwise sit in GPU memory next to the engine's weights and KV cache.

The unit moved is the tensor *storage*, not the tensor. Megatron's DDP keeps parameters and
gradients as views into contiguous buffers and the distributed optimizer's fp32 shards can be
views of those again, so moving `param.data` one tensor at a time would break the views (and
copy shared memory twice). Instead every distinct storage is copied once into a host buffer kept
for the next time, then resized to zero bytes, which frees its device memory while every view
keeps pointing at it; `restore` resizes it back and copies the bytes in. Gradient buffers are
not copied: Megatron zeroes them before each step, so they come back zeroed.

The host copies share one arena per model, sized to the bytes parked. On a GPU machine it is
page-locked by registering ordinary host memory with CUDA (so copies are asynchronous DMA), not
taken from the pinned caching allocator, which rounds every allocation up to a power of two
and would reserve up to twice the model's state in host memory per rank.

The same code runs on CPU (the "device" storage is then host memory), which is how the tests
check that a parked and restored model trains bitwise like one that never moved.
"""

from __future__ import annotations

import contextlib

import torch

from .optimizer import TrainableModel, inner_optimizers

_ALIGNMENT = 512
"""Byte alignment of each storage's copy in the arena (whole DMA-friendly blocks)."""


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Master parameters and per-parameter state (Adam moments) of every inner optimizer."""
    tensors = []
    for inner in inner_optimizers(optimizer):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            tensors += group["params"]
        for state in torch_optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


def _distinct_storages(tensors) -> dict[int, torch.UntypedStorage]:
    """Storages by data pointer; empty and already-parked storages are left out."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            storages.setdefault(storage.data_ptr(), storage)
    return storages


class HostParking:
    """Moves one TrainableModel's device memory to host memory and back."""

    def __init__(self, trainable: TrainableModel):
        self.trainable = trainable
        self.kept: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        """(device storage, its bytes in the arena) of what is parked now."""
        self.discarded: list[tuple[torch.UntypedStorage, int]] = []
        """(device storage, its size in bytes) of parked gradient buffers."""
        self._arena: HostArena | None = None
        """Host memory for the copies, kept for the next park (grown when the optimizer's
        state appears after the first step)."""

    @property
    def parked(self) -> bool:
        return bool(self.kept or self.discarded)

    def _gradient_tensors(self) -> list[torch.Tensor]:
        return [buffer.grad_data for chunk in self.trainable.chunks
                for buffer in chunk.buffers + chunk.expert_parallel_buffers]

    def _kept_tensors(self) -> list[torch.Tensor]:
        parameters = [param.data for chunk in self.trainable.chunks for param in chunk.parameters()]
        buffers = [buffer.param_data for chunk in self.trainable.chunks
                   for buffer in chunk.buffers + chunk.expert_parallel_buffers
                   if buffer.param_data is not None]
        return buffers + parameters + _optimizer_tensors(self.trainable.optimizer)

    def park(self) -> int:
        """Free the model's device memory; returns the bytes freed."""
        if self.parked:
            raise RuntimeError("HostParking.park: the model is already parked")
        gradients = _distinct_storages(self._gradient_tensors())
        kept = [storage for ptr, storage in _distinct_storages(self._kept_tensors()).items()
                if ptr not in gradients]
        offsets = _aligned_offsets([storage.nbytes() for storage in kept])
        arena = self._arena_of(offsets[-1])
        for storage, start in zip(kept, offsets):
            host = arena.bytes[start:start + storage.nbytes()]
            host.copy_(_as_bytes(storage), non_blocking=True)
            self.kept.append((storage, host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        freed = 0
        for storage, _ in self.kept:
            freed += storage.nbytes()
            storage.resize_(0)
        for storage in gradients.values():
            self.discarded.append((storage, storage.nbytes()))
            freed += storage.nbytes()
            storage.resize_(0)
        return freed

    def restore(self) -> None:
        """Bring everything back where it was (gradient buffers zeroed)."""
        for storage, host in self.kept:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=True)
        for storage, size in self.discarded:
            storage.resize_(size)
            storage.fill_(0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.kept, self.discarded = [], []

    def _arena_of(self, nbytes: int) -> "HostArena":
        if self._arena is None or self._arena.bytes.numel() < nbytes:
            self._arena = HostArena(nbytes)
        return self._arena


class HostArena:
    """`nbytes` of host memory, page-locked for the GPU where there is one."""

    def __init__(self, nbytes: int):
        self.bytes = torch.empty(nbytes, dtype=torch.uint8)
        self._registered = False
        if torch.cuda.is_available() and nbytes:
            status = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), nbytes, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister of a {nbytes / 2 ** 30:.1f} GiB parking "
                                   f"arena failed (error {int(status)}): not enough lockable "
                                   "host memory (ulimit -l, or the node's RAM)")
            self._registered = True

    def __del__(self):
        if self._registered:
            with contextlib.suppress(Exception):  # the CUDA runtime may be gone at exit
                torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (made anew after each resize)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _aligned_offsets(sizes: list[int]) -> list[int]:
    """Start of each size in an arena (aligned), then the arena's total size."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // _ALIGNMENT) * _ALIGNMENT)
    return offsets
