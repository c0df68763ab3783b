"""The teacher: a frozen model, in its own layout, that scores the student's samples.

The teacher may be larger than the student and split differently (its own TP and PP over the
same ranks: the `ModelRank` its stage carries, runtime/model_rank.py). The ranks that hold one
copy of the teacher together must score the same rows, but they may hold different rows of the
student's batch (different student data-parallel ranks). So the rows of the ranks of one
teacher copy are pooled first, each student data-parallel shard once, scored together, and
every rank keeps its own rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.runtime.devices import collective_device
from mcore_rl.runtime.regroup import gather_ints, gather_tensor_shares, one_share_per_key
from mcore_rl.models.weights import model_rank_of
from mcore_rl.training import compute_outputs

from .actor import scoring_inputs


class Teacher:
    """A frozen Megatron LM in its own layout; optionally parked in host memory between uses."""

    batch_key = "teacher_logprobs"
    """Where its scores of a batch go (`score`)."""

    def __init__(self, module: torch.nn.Module, vocab_size: int, micro_batch_size: int,
                 temperature: float, offload: bool, student_shard: int):
        """module: this rank's stage of the teacher, built in the teacher's layout; vocab_size:
        the teacher's real vocabulary; temperature: the student's sampling temperature (both
        models' log-probs are of logits / temperature, so a teacher equal to the student is at
        KL 0); student_shard: this rank's data-parallel rank in the student's layout (which
        rows of the batch it holds). Collective over the teacher's model-parallel group: each
        rank learns the student shards of the others once."""
        self.module = module
        self.place = model_rank_of(module)
        """This rank in the teacher's layout."""
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature if temperature > 0 else 1.0
        self.student_shard = student_shard
        self.group_shards = gather_ints(student_shard, self.place.group("mp"))
        """The student shard of each rank holding this copy of the teacher."""
        self.device = next(module.parameters()).device
        self.offload = offload and self.device.type != "cpu"
        if self.offload:
            module.to("cpu")

    def score(self, batch: dict) -> torch.Tensor:
        """The batch's `batch_key`: its log-probs."""
        return self.logprobs(batch)

    def logprobs(self, batch: dict) -> torch.Tensor:
        """[n, s] log-probs of this rank's rows of `batch` under the teacher (collective over
        every rank: each teacher copy scores the rows of its ranks)."""
        inputs = scoring_inputs(batch)
        pooled, rows = pool_rows(inputs, self.student_shard, self.group_shards,
                                 self.place.group("mp"))
        if self.offload:
            self.module.to(self.device)
        scored = whole_micro_batches(pooled, self.micro_batch_size, self._expert_group_rows(
            pooled["input_ids"].shape[0]))
        logprobs = compute_outputs([self.module], scored, self.micro_batch_size, "lm",
                                   self.vocab_size, self.temperature)["logprobs"]
        if self.offload:
            self.module.to("cpu")
        return logprobs[rows, :inputs["input_ids"].shape[1]]


    def _expert_group_rows(self, rows: int) -> int:
        """The most rows any rank of this rank's expert group scores: with experts split
        (a Mixture-of-Experts teacher at EP > 1) every forward exchanges tokens among the
        group, so its ranks must run equally many micro-batches."""
        if self.place.ep_size == 1:
            return rows
        group = self.place.group("ep")
        most = torch.tensor([rows], device=collective_device(group))
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        return int(most.item())


def whole_micro_batches(inputs: dict[str, torch.Tensor], micro_batch_size: int,
                        at_least: int = 0) -> dict[str, torch.Tensor]:
    """`inputs` with copies of its first row appended until the rows fill whole micro-batches
    and number at least `at_least` (pooled rows need not; the copies' outputs are dropped with
    everything after the rows asked for)."""
    rows = inputs["input_ids"].shape[0]
    missing = max(at_least - rows, 0)
    missing += -(rows + missing) % micro_batch_size
    if not missing:
        return inputs
    return {name: torch.cat([tensor, tensor[:1].expand(missing, *tensor.shape[1:])])
            for name, tensor in inputs.items()}


def pool_rows(inputs: dict[str, torch.Tensor], shard: int, shards: list[int], group
              ) -> tuple[dict[str, torch.Tensor], slice]:
    """The rows the ranks of `group` hold, each shard once in shard order (right-padded with
    zeros to the longest), and where this rank's rows (of `shard`) lie among them; `shards`:
    the shard of each rank of the group. Ranks of one shard hold the same rows. Without other
    shards in the group the rows are this rank's own (no collective). The rows travel by tensor
    collectives on the group's device (runtime/regroup.py), not pickled."""
    if len(set(shards)) == 1:
        return inputs, slice(0, inputs["input_ids"].shape[0])
    by_shard = one_share_per_key(gather_tensor_shares(shard, inputs, group))
    width = max(rows["input_ids"].shape[1] for rows in by_shard.values())
    order = sorted(by_shard)
    pooled = {name: torch.cat([torch.nn.functional.pad(
        by_shard[each][name], (0, width - by_shard[each][name].shape[1])) for each in order])
        .to(inputs[name].device) for name in inputs}
    start = sum(by_shard[each]["input_ids"].shape[0] for each in order if each < shard)
    return pooled, slice(start, start + inputs["input_ids"].shape[0])
