"""On-policy distillation: a frozen teacher scores every token the student samples.

The student (the actor) samples as in RL; the teacher's log-probs of the sampled tokens turn
into a per-token advantage, -(log p_student - log p_teacher): the sampled-token estimate of the
reverse KL to the teacher (Agarwal et al. 2024, GKD; Thinking Machines' and slime's on-policy
distillation). It is added to the task's advantage after the estimator, so the usual PPO /
importance-sampling loss trains on it (docs/distillation.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import InitConfig
from .parallel import ParallelConfig, expert_grid_errors


@dataclass(frozen=True)
class TeacherParallelConfig:
    """The teacher's own layout over the same ranks as the student (the trainer ranks in split
    placement); its data-parallel size is what the ranks leave."""

    tensor_model_parallel_size: int = 0
    """Ranks that split each of the teacher's layers; 0: the student's
    parallel.tensor_model_parallel_size."""

    pipeline_model_parallel_size: int = 0
    """Ranks that split the teacher's layers into stages; 0: the student's
    parallel.pipeline_model_parallel_size."""

    expert_model_parallel_size: int = 1
    """Ranks that split a Mixture-of-Experts teacher's experts (its own EP, whatever the
    student's; its experts' tensor-parallel size is the teacher's TP). Must divide the teacher's
    data-parallel size and its number of experts."""


@dataclass(frozen=True)
class TeacherConfig:
    """The frozen model the student is distilled from (RL jobs; off when `init` names none)."""

    init: InitConfig = field(default_factory=InitConfig)
    """The teacher's weights and architecture: an HF folder (hf_path) or an mcore_rl checkpoint
    (checkpoint), with the student's tokenizer; unset: no teacher."""

    parallel: TeacherParallelConfig = field(default_factory=TeacherParallelConfig)
    """The teacher's tensor and pipeline parallel sizes, independent of the student's."""

    kl_coef: float = 1.0
    """Weight of the distillation advantage -(log p_student - log p_teacher) per sampled token
    (the reverse-KL coefficient; 1.0 in the published recipe)."""

    reward_weight: float = 0.0
    """Weight of the task's advantage (the estimator's, from the reward) beside the teacher's:
    0 is pure distillation (rewards are still scored and logged where the data has a rule,
    but do not train), 1 adds the two advantages."""

    micro_batch_size: int = 0
    """Sequences per teacher forward micro-batch; 0: actor.micro_batch_size."""

    offload: bool = False
    """Keep the teacher's parameters in host memory between its passes, so the GPU holds them
    only while it scores (GPU only; a no-op on CPU)."""

    @property
    def enabled(self) -> bool:
        """Whether the job distils from a teacher."""
        return bool(self.init.hf_path or self.init.checkpoint)

    def parallel_config(self, student: ParallelConfig, moe: bool) -> ParallelConfig:
        """The teacher's own layout over the trainer ranks, 0s replaced by the `student`'s
        sizes; a Mixture-of-Experts teacher (`moe`) split over TP runs sequence parallel, as
        Megatron requires there."""
        tp, pp = self._sizes(student.tensor_model_parallel_size,
                             student.pipeline_model_parallel_size)
        return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=self.parallel.expert_model_parallel_size,
                              sequence_parallel=moe and tp > 1)

    def _sizes(self, student_tp: int, student_pp: int) -> tuple[int, int]:
        """(TP, PP) of the teacher, 0s replaced by the student's sizes."""
        return (self.parallel.tensor_model_parallel_size or student_tp,
                self.parallel.pipeline_model_parallel_size or student_pp)

    def errors(self, student_tp: int, student_pp: int, ranks: int, where: str) -> list[str]:
        """Broken rules of the teacher over `ranks` trainer ranks (`where` says which ranks,
        for the message)."""
        errors = []
        if self.init.hf_path and self.init.checkpoint:
            errors.append("teacher.init: set hf_path or checkpoint, not both")
        if self.kl_coef < 0 or self.reward_weight < 0:
            errors.append(f"teacher.kl_coef={self.kl_coef} and teacher.reward_weight="
                          f"{self.reward_weight} must be >= 0")
        if self.micro_batch_size < 0:
            errors.append(f"teacher.micro_batch_size={self.micro_batch_size} must be >= 0")
        tp, pp = self._sizes(student_tp, student_pp)
        ep = self.parallel.expert_model_parallel_size
        if tp < 1 or pp < 1 or ranks % (tp * pp):
            errors.append(f"teacher.parallel: TP {tp} x PP {pp} must divide the {ranks} {where} "
                          f"(the teacher lives on the ranks that train)")
        elif ep < 1:
            errors.append(f"teacher.parallel.expert_model_parallel_size={ep} must be >= 1")
        else:
            errors += [f"teacher.{error}" for error in expert_grid_errors(ep, tp, ranks // pp)]
        return errors
