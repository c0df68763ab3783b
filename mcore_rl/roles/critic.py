"""The critic: a value model (scalar head) trained on the returns of the advantage estimator."""

from __future__ import annotations

from functools import partial

from mcore_rl.algorithms.objectives import critic_objective
from mcore_rl.config import AlgorithmConfig
from mcore_rl.training import TrainableModel, compute_outputs, train_step

from .actor import role_metrics

CRITIC_INPUTS = ("input_ids", "attention_mask", "loss_mask", "old_values", "returns")


class Critic:
    """A Megatron value model with its own optimizer."""

    batch_key = "old_values"
    """Where its scores of a batch go (`score`)."""

    def __init__(self, trainable: TrainableModel, micro_batch_size: int,
                 algorithm: AlgorithmConfig, max_tokens: int = 0):
        """max_tokens > 0: token-budget micro-batches instead of `micro_batch_size` rows."""
        self.trainable = trainable
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens
        self.algorithm = algorithm

    def score(self, batch: dict) -> torch.Tensor:
        """The batch's `batch_key`: its values."""
        return self.values(batch)

    def values(self, batch: dict):
        """[n, s] value of the state in which each token was chosen."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return compute_outputs(self.trainable.chunks, inputs, self.micro_batch_size,
                               "scalar", max_tokens=self.max_tokens)["values"]

    def update(self, mini_batch: dict) -> dict:
        """One optimizer step of the clipped value loss; metrics identical on every rank."""
        inputs = {name: mini_batch[name] for name in CRITIC_INPUTS}
        objective = partial(critic_objective, config=self.algorithm)
        return role_metrics(train_step(self.trainable, inputs, self.micro_batch_size, objective,
                                    "scalar", max_tokens=self.max_tokens), "critic")
