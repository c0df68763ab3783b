"""The two forms in which resharded weights reach an engine.

(a) HF-named full tensors: the ``full`` rollout layout delivers canonical full tensors, and
    `hf_named` renames and unfuses them (QKV into q/k/v, fc1 into gate/up) with the same
    architecture mapping the HF converter uses, so any engine's ``load_weights`` accepts them.
(b) Rollout-TP shards in the engine's own layout (``vllm`` or ``megatron``), already named as the
    engine's parameters: no rank materializes a full tensor it does not need. The engine adapter
    states which form it takes.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.conversion.architectures import Architecture


def hf_named(full_tensors: Iterable[tuple[str, torch.Tensor]], architecture: Architecture,
             model: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every HF tensor held in the canonical (name, full tensor) pairs."""
    for name, tensor in full_tensors:
        yield from architecture.from_canonical(name, tensor, model).items()
