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

The same code runs on CPU (the "device" storage is then host memory), which is how the tests
check that a parked and restored model trains bitwise like one that never moved.
"""

from __future__ import annotations

import torch

from .optimizer import TrainableModel, inner_optimizers


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
        self.kept: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        """(device storage, its host copy) of what is parked now."""
        self.discarded: list[tuple[torch.UntypedStorage, int]] = []
        """(device storage, its size in bytes) of parked gradient buffers."""
        self._host_buffers: list[torch.UntypedStorage] = []
        """Host copies, allocated at the first park and reused (the set of storages and their
        order do not change between parks)."""

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
        kept = {ptr: storage for ptr, storage in _distinct_storages(self._kept_tensors()).items()
                if ptr not in gradients}
        for index, storage in enumerate(kept.values()):
            host = self._host_buffer(index, storage.nbytes())
            host.copy_(storage, non_blocking=True)
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
            storage.resize_(host.nbytes())
            storage.copy_(host, non_blocking=True)
        for storage, size in self.discarded:
            storage.resize_(size)
            storage.fill_(0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.kept, self.discarded = [], []

    def _host_buffer(self, index: int, nbytes: int) -> torch.UntypedStorage:
        """The index-th host buffer (pinned on GPU machines, so copies are asynchronous)."""
        if index == len(self._host_buffers):
            self._host_buffers.append(torch.empty(
                nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).untyped_storage())
        if self._host_buffers[index].nbytes() != nbytes:
            raise RuntimeError(f"HostParking: storage {index} changed size since the last park "
                               f"({self._host_buffers[index].nbytes()} -> {nbytes} bytes)")
        return self._host_buffers[index]
