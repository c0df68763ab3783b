"""One rank of a parking world (run by tests/test_offload.py): train three steps, parking the
model's parameters, gradients and optimizer state in host memory before each step (when asked)
and restoring them, and record what parking freed and the final parameters."""

from __future__ import annotations

import torch

from mcore_rl.config import BatchConfig, JobConfig, ModelConfig, OptimizerConfig, ParallelConfig
from mcore_rl.models import build_gpt_model
from mcore_rl.runtime import initialize, seed_everything, shutdown
from mcore_rl.smoke import next_token_loss, random_batch
from mcore_rl.training import make_trainable, train_step
from mcore_rl.training.offload import HostParking

STEPS = 3


def compare_parked_and_unmoved() -> dict:
    """Both optimizers, each trained parked and unmoved from the same seed, in one world; this
    rank's results."""
    place = initialize(_config(True)).training
    results = {(distributed, park): _train(_config(distributed), park, place)
               for distributed in (True, False) for park in (True, False)}
    shutdown()
    return results


def _config(distributed_optimizer: bool) -> JobConfig:
    return JobConfig(model=ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                         num_attention_heads=4, num_kv_heads=2, vocab_size=64,
                                         max_position_embeddings=32),
                       parallel=ParallelConfig(),
                       optimizer=OptimizerConfig(lr=1e-2,
                                                 use_distributed_optimizer=distributed_optimizer),
                       batch=BatchConfig(global_batch_size=4, micro_batch_size=2, seq_length=16))


def _train(config: JobConfig, park: bool, place) -> dict:
    seed_everything(config.runtime.seed)
    trainable = make_trainable(build_gpt_model(config.model, config.parallel, place=place),
                               config.optimizer, "fp32")
    parking = HostParking(trainable)
    optimizer_tensors = []
    freed, left_on_device = [], []
    for step in range(STEPS):
        if park:
            freed.append(parking.park())
            left_on_device.append(_bytes_still_held(trainable))
            parking.restore()
        train_step(trainable, random_batch(config, step), 2, next_token_loss, vocab_size=64)
    for inner in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        for state in inner.optimizer.state.values():
            optimizer_tensors += [v for v in state.values() if v.dim() > 0]
    return {"parameters": [p.detach().clone() for p in trainable.chunks[0].parameters()],
              "optimizer_state": [t.clone() for t in optimizer_tensors],
              "freed": freed, "left_on_device": left_on_device,
              "parameter_bytes": sum(p.numel() * 4 for p in trainable.chunks[0].parameters())}


def _bytes_still_held(trainable) -> int:
    """Bytes of parameters, gradients and Adam state still allocated (0 when all parked)."""
    tensors = [p for p in trainable.chunks[0].parameters()]
    tensors += [p.main_grad for p in trainable.chunks[0].parameters()]
    for inner in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        for state in inner.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(t.untyped_storage().nbytes() for t in tensors)
