"""Settings of the RL loop: how many steps, how each batch is reused, when to evaluate, save,
export and log, and what an evaluation watches for.

Why this module exists
----------------------
The trainer section and the two sections it nests (the reward-hacking warning and model
selection) describe what happens around the step, not how a step generates or updates; they
change with the loop (evaluation, checkpoints, loggers), apart from the rollout (rl.py) and the
roles (roles.py).
"""

from __future__ import annotations

import importlib.util
import signal
from dataclasses import dataclass, field
from typing import Optional

WANDB_MISSING = ("trainer.wandb_project is set but wandb is not installed: pip install wandb "
                 "(or unset trainer.wandb_project)")


@dataclass(frozen=True)
class RewardHackingConfig:
    """When an evaluation warns of reward hacking (evaluation/reward_hacking.py): the reward
    rose since the first evaluation and at least one of these signs shows. Each sign is logged
    as warnings/<sign> in eval.jsonl; a warning line is printed."""

    accuracy_drop: float = 0.05
    """Sign accuracy_down: eval/accuracy (a ground-truth check) fell by more than this since
    the first evaluation (absolute). Where it rose by more than this beside a reward model's
    score, the other signs do not warn (the policy got better at the task); beside rule
    rewards it is the same rule's verdict and clears nothing (evaluation/reward_hacking.py)."""

    distinct_fraction: float = 0.1
    """Sign diversity_collapse: eval/distinct_1 fell below this fraction of its first value
    (one answer to every question; on the quickstart's one-token answers a healthy GRPO run
    keeps 0.21 of it, a reward model's policy that collapsed 0.09)."""

    kl_bound: float = 3.0
    """Sign kl_exceeded: the KL to the reference (eval/kl_to_reference, else the last step's
    actor/kl_to_reference) is above this (the quickstart's GRPO ends near 1.1)."""

    def errors(self) -> list[str]:
        errors = []
        if not 0 <= self.accuracy_drop <= 1:
            errors.append(f"trainer.reward_hacking.accuracy_drop={self.accuracy_drop} must be "
                          "in [0, 1]")
        if not 0 <= self.distinct_fraction <= 1:
            errors.append(f"trainer.reward_hacking.distinct_fraction={self.distinct_fraction} "
                          "must be in [0, 1]")
        if not self.kl_bound > 0:
            errors.append(f"trainer.reward_hacking.kl_bound={self.kl_bound} must be positive")
        return errors


@dataclass(frozen=True)
class ModelSelectionConfig:
    """Which evaluated policy to keep, and when to stop (evaluation/model_selection.py): the
    best evaluation so far by `metric` is exported as an HF folder output_dir/hf/best (its
    step and value in output_dir/hf/best.json), next to the latest checkpoint; training stops
    early after `patience` evaluations without improvement. Named as in HF/TRL
    (metric_for_best_model, greater_is_better, EarlyStoppingCallback) and NeMo-RL
    (checkpointing.metric_name, higher_is_better)."""

    metric: Optional[str] = None
    """An evaluation metric as logged, e.g. eval/accuracy (a ground-truth check; select on
    validation prompts you do not report on); None: no selection, no early stopping."""

    higher_is_better: bool = True
    """Whether a larger value of `metric` is better."""

    patience: int = 0
    """Stop after this many evaluations in a row that did not improve on the best by more
    than min_delta (that step is then the last: saved and exported as such, and a rerun does
    not continue it); 0: never."""

    min_delta: float = 0.0
    """How much better than the best an evaluation must be to count as an improvement."""

    def errors(self) -> list[str]:
        errors = []
        if self.patience < 0 or self.min_delta < 0:
            errors.append(f"trainer.selection.patience={self.patience} and min_delta="
                          f"{self.min_delta} must be >= 0")
        if self.patience and self.metric is None:
            errors.append(f"trainer.selection.patience={self.patience} needs "
                          "trainer.selection.metric (e.g. eval/accuracy)")
        if self.metric is not None and not self.metric.startswith("eval/"):
            errors.append(f"trainer.selection.metric={self.metric!r} must be an evaluation "
                          "metric (eval/...)")
        return errors


@dataclass(frozen=True)
class TrainerConfig:
    """The loop: how many steps, how each batch is reused, when to evaluate and save."""

    total_steps: int = 20
    """RL steps (generate + update) to run; a resumed run continues up to this number."""

    ppo_epochs: int = 1
    """Passes over each step's batch."""

    mini_batches: int = 1
    """Optimizer steps per epoch: the batch is cut into this many mini-batches."""

    balance_data_parallel: bool = False
    """Before the update, move rows between data-parallel ranks so that each holds about the
    same number of tokens (long-tail response lengths otherwise leave all ranks waiting for
    the one with the longest responses); rows per rank stay equal (verl's balance_batch)."""

    save_every: int = 0
    """Save a checkpoint every this many steps (and at the end); 0: never."""

    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a save."""

    export_hf_every: int = 0
    """Write the actor as an HF folder (safetensors, config.json, tokenizer) to
    output_dir/hf/step_<N> every this many steps and after the last; 0: never. Exports are
    kept."""

    resume: bool = True
    """Continue from the newest complete checkpoint in output_dir/checkpoints if there is one."""

    eval_every: int = 0
    """Evaluate on the validation prompts every this many steps (and before the first and
    after the last); 0: never."""

    val_only: bool = False
    """Evaluate the starting weights on the validation prompts (a resumed run's: its
    checkpoint's) and stop before training (verl's trainer.val_only): a baseline's figures in
    eval.jsonl at the step it starts from."""

    reward_hacking: RewardHackingConfig = field(default_factory=RewardHackingConfig)
    """Thresholds of the reward-hacking warning checked at each evaluation."""

    selection: ModelSelectionConfig = field(default_factory=ModelSelectionConfig)
    """Best-so-far HF export and early stopping by an evaluation metric (needs eval_every)."""

    eval_kl_to_reference: bool = True
    """With a reference model, each evaluation also logs eval/kl_to_reference, the policy's KL
    to the reference on the validation responses. It costs an actor and a reference forward
    pass over them: 4.4 of 6.9 s per evaluation for SmolLM2-135M answering 64 questions on 2
    CPU ranks (docs/benchmark_trl.md)."""

    max_bad_steps: int = 3
    """Stop after this many consecutive steps with a non-finite loss or gradient norm (their
    updates are skipped; the last checkpoint stays intact)."""

    tensorboard: bool = True
    """Write metrics to output_dir/tensorboard (rank 0)."""

    console_every: int = 1
    """Print the first step's line and every this-many-th on the console (RL and SFT; the
    metrics files, TensorBoard and W&B get every step; evaluations are always printed)."""

    wandb_project: Optional[str] = None
    """Weights & Biases project: when set, rank 0 also logs every step and evaluation metric
    there, with the job's config (runs go under output_dir/wandb). Needs `pip install wandb`
    (checked at start-up) and `wandb login` or WANDB_API_KEY; WANDB_MODE=offline logs locally
    for a later `wandb sync`; WANDB_ENTITY picks the team. None: no W&B."""

    wandb_run_name: Optional[str] = None
    """Name of the W&B run; None: the last component of runtime.output_dir."""

    plots: bool = True
    """At the end of fit(), PNG plots of reward, accuracy and KL over steps into
    output_dir/plots (rank 0; also `mcore-rl plot RUN_DIR`)."""

    save_signal: Optional[str] = "SIGUSR1"
    """On this signal (SLURM's `--signal=USR1@120` before preemption or the time limit) every
    rank finishes its step, a checkpoint is saved and `mcore-rl train` exits with status 75 for
    the sbatch script to requeue; None: the signal keeps its default action."""

    @property
    def evaluates(self) -> bool:
        """Whether the job evaluates at all."""
        return self.eval_every > 0 or self.val_only

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        errors = []
        for name in ("total_steps", "ppo_epochs", "mini_batches", "keep_last", "max_bad_steps"):
            if getattr(self, name) < 1:
                errors.append(f"trainer.{name}={getattr(self, name)} must be >= 1")
        for name in ("save_every", "eval_every", "export_hf_every"):
            if getattr(self, name) < 0:
                errors.append(f"trainer.{name}={getattr(self, name)} must be >= 0")
        errors += self.reward_hacking.errors() + self.selection.errors()
        if self.selection.metric is not None and not self.eval_every:
            errors.append(f"trainer.selection.metric={self.selection.metric!r} needs "
                          "trainer.eval_every > 0")
        errors += self._wandb_errors()
        if self.save_signal is not None:
            try:
                signal_from_name(self.save_signal)
            except ValueError as error:
                errors.append(f"trainer.save_signal: {error}")
        return errors

    def _wandb_errors(self) -> list[str]:
        if self.wandb_project is None:
            return (["trainer.wandb_run_name is set but trainer.wandb_project is not"]
                    if self.wandb_run_name is not None else [])
        if not self.wandb_project:
            return ["trainer.wandb_project must not be empty (leave it unset for no W&B)"]
        return [] if importlib.util.find_spec("wandb") else [WANDB_MISSING]


def signal_from_name(name: str) -> signal.Signals:
    """signal.Signals for 'SIGUSR1' or 'USR1' (ValueError naming the valid names otherwise)."""
    full_name = name if name.startswith("SIG") else f"SIG{name}"
    if full_name not in signal.Signals.__members__:
        raise ValueError(f"unknown signal {name!r}; valid names: "
                         f"{', '.join(sorted(signal.Signals.__members__))}")
    return signal.Signals[full_name]
