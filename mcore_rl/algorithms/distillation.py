"""On-policy distillation's advantage: the teacher's verdict on each token the student sampled.

For a response y sampled from the student, the reverse KL to the teacher is
E_y[sum_t log p_s(y_t | y_<t) - log p_T(y_t | y_<t)], and its sampled-token estimate gives each
token the advantage -(log p_s - log p_T): positive where the teacher finds the token likelier
than the student did. Both log-probs are held fixed (the student's are the sampling policy's),
so the policy-gradient loss around it minimises the reverse KL (Agarwal et al. 2024; Thinking
Machines' "On-Policy Distillation", 2025; slime's on-policy distillation).
"""

from __future__ import annotations

import torch


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """[n, s] -(log p_student - log p_teacher) on the sampled tokens `mask` marks, 0
    elsewhere."""
    return (teacher_logprobs - student_logprobs) * mask


def distilled_advantages(task_advantages: torch.Tensor, teacher_advantages: torch.Tensor,
                         reward_weight: float, kl_coef: float) -> torch.Tensor:
    """The advantage the policy trains on: reward_weight x the task's (its estimator's, from
    the reward) + kl_coef x the teacher's."""
    return reward_weight * task_advantages + kl_coef * teacher_advantages
