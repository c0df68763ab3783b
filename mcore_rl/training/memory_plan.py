"""How much GPU memory an RL job's training state takes per GPU, full fine-tuning against LoRA.

The static state, counted exactly from the model's shapes, as this package holds it: weights in
the run's dtype, gradients in fp32 (Megatron DDP's grad_reduce_in_fp32), fp32 master weights and
Adam's two moments sharded over data-parallel ranks (the distributed optimizer), and a
reference model in the run's dtype when a KL term needs one. With LoRA the base's weights are
frozen (no gradient, no optimizer state), the adapters train, and the reference is the actor with
its adapters off (no second model). Activations, the engine's KV cache and framework overheads
come on top; docs/lora.md prints the table with its assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config import ModelConfig
from mcore_rl.config.lora import LoraConfig
from mcore_rl.param_layout import sharding

TRAINED_BYTES = 4 + 4 + 8
"""Per trained parameter beyond its weight: fp32 gradient, fp32 master weight, Adam m and v."""


def adapter_parameters(model: ModelConfig, lora: LoraConfig) -> int:
    """Elements of every adapter (A [r, in] and B [out, r] on each targeted linear)."""
    total = 0
    for layer in range(model.num_layers):
        for weight in sharding.adapted_weights(model, layer, lora.megatron_targets()):
            out_features, in_features = sharding.full_shape(weight, model)
            total += lora.rank * (in_features + out_features)
    return total


def model_parameters(model: ModelConfig) -> int:
    """Elements of the model's canonical weights (LM head)."""
    total = 0
    for shape in sharding.canonical_param_shapes(model, "lm").values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes per GPU of the static training state."""

    weights: float
    gradients_and_optimizer: float
    reference: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients_and_optimizer + self.reference


def training_memory(model: ModelConfig, lora: LoraConfig | None, model_parallel: int,
                    data_parallel: int, weight_bytes: int = 2,
                    with_reference: bool = True) -> TrainingMemory:
    """Per-GPU bytes with the model split over `model_parallel` (TP x PP) GPUs and the optimizer
    state over `data_parallel` replicas; weight_bytes: 2 for bf16."""
    base = model_parameters(model) / model_parallel
    if lora is None or not lora.enabled:
        trained = base
        weights = base * weight_bytes
        reference = base * weight_bytes if with_reference else 0.0
    else:
        trained = adapter_parameters(model, lora) / model_parallel
        weights = (base + trained) * weight_bytes
        reference = 0.0
    state = trained * 4 + trained * (TRAINED_BYTES - 4) / data_parallel
    return TrainingMemory(weights, state, reference)


LOGIT_COPIES = 3
"""fp32 [tokens, vocabulary / TP] tensors a scoring micro-batch holds at once: the logits, their
exponentials and the log-softmax (models/logprobs.py)."""


@dataclass(frozen=True)
class ScoringMemory:
    """Bytes per GPU a frozen scoring model (a teacher) needs while it scores."""

    weights: float
    logits: float

    @property
    def total(self) -> float:
        return self.weights + self.logits


def scoring_memory(model: ModelConfig, tp: int, pp: int, weight_bytes: int,
                   micro_batch_size: int, sequence_length: int) -> ScoringMemory:
    """A frozen LM split over TP x PP GPUs scoring micro-batches of `micro_batch_size`
    sequences of `sequence_length` tokens (activations of one layer are small beside the
    vocabulary's logits and not counted)."""
    weights = model_parameters(model) * weight_bytes / (tp * pp)
    logits = (micro_batch_size * sequence_length * model.padded_vocab_size(tp) / tp
              * 4 * LOGIT_COPIES)
    return ScoringMemory(weights, logits)
