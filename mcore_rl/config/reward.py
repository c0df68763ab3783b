"""How rule-based (verifiable) rewards are computed: which function scores each data_source, the
worker processes that run those functions with a per-call timeout, and the format reward.

A data_source is scored by, in order: reward.functions[data_source]; a built-in function
(mcore_rl.rewards.registry: math answers, reasoning-gym tasks, toy/copy); reward.default_function.
A data_source none of them covers fails the job at start-up, before any rollout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

# DeepSeek-R1's template: reasoning in <think> tags, then the answer in <answer> tags, nothing else.
R1_FORMAT_PATTERN = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


NORMALIZATIONS = ("none", "scale", "standardize")


@dataclass(frozen=True)
class RewardShapingConfig:
    """How scores become the rewards the policy is trained on (algorithms/reward_shaping.py),
    in this order: the missing-EOS penalty, centred, normalised, clipped. Meant for a reward
    model's scores (what TRL's PPO trainer and OpenRLHF offer); they apply to rule scores the
    same way. The logged
    reward/mean is the shaped reward, reward/raw_mean the scores before."""

    missing_eos_penalty: float = 0.0
    """Subtracted from the score of a response that hit rollout.sampling.max_new_tokens
    without ending (TRL's missing_eos_penalty): a reward model was trained on complete answers
    and scores a cut-off one at a position it never learned."""

    center: bool = False
    """Subtract the mean score of the first step's responses, which the starting (SFT) policy
    sampled, from every score of the run (InstructGPT's reward-model bias)."""

    normalize: str = "none"
    """none; scale: divide by the running std of every score seen so far (TRL's
    use_score_scaling); standardize: subtract the running mean too (TRL's use_score_norm,
    OpenRLHF's normalize_reward)."""

    clip: Optional[float] = None
    """Clip the (centred, normalised) rewards to [-clip, clip] (TRL's score_clip, OpenRLHF's
    reward_clip_range); None: no clipping."""

    @property
    def active(self) -> bool:
        """Whether the scores are changed at all."""
        return bool(self.missing_eos_penalty or self.center or self.normalize != "none"
                    or self.clip is not None)

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        errors = []
        if self.normalize not in NORMALIZATIONS:
            errors.append(f"reward.shaping.normalize={self.normalize!r} must be one of "
                          f"{NORMALIZATIONS}")
        if self.missing_eos_penalty < 0:
            errors.append(f"reward.shaping.missing_eos_penalty={self.missing_eos_penalty} "
                          "must be >= 0")
        if self.clip is not None and not self.clip > 0:
            errors.append(f"reward.shaping.clip={self.clip} must be positive (or null)")
        return errors


@dataclass(frozen=True)
class RewardConfig:
    """Rule rewards: functions by data_source, their sandbox, and the format reward; or a
    reward model instead."""

    model_path: Optional[str] = None
    """HF sequence-classification folder (e.g. LlamaForSequenceClassification, num_labels=1)
    used as the reward model instead of rule functions: its score of prompt + response, read at
    the last token. It must share the policy's tokenizer (same vocabulary)."""

    num_workers: int = 4
    """Worker processes (per rank) that run reward functions, each call with a timeout, each
    confined like the agents' tools (mcore_rl/sandbox: no network, writes only to its own
    folder, none of the rank's secrets). 0 scores inline in the calling process, without
    timeout or isolation (for debugging)."""

    timeout_seconds: float = 10.0
    """Longest one reward call may run; a call past it scores 0 and its worker is replaced."""

    startup_timeout_seconds: float = 120.0
    """Longest a worker may take to start and import a data source's function before its first
    call (not counted in timeout_seconds); past it the call scores 0."""

    memory_mb: int = 4096
    """Address-space limit of a worker process (RLIMIT_AS): what the function and the modules
    it imports may map."""

    network: bool = False
    """Whether reward functions may use the network (an LLM judge, a code-execution service);
    false: a private network namespace, or Landlock's TCP rules where namespaces are
    unavailable."""

    environment: tuple[str, ...] = ()
    """Names of the rank's environment variables reward functions see (a judge's API key);
    besides PATH, LANG, LC_ALL, TZ, OMP_NUM_THREADS and LD_LIBRARY_PATH they see none (the
    rank's holds W&B, HF and cloud credentials)."""

    readable: tuple[str, ...] = ()
    """Folders and files reward functions may read besides the system's folders, the Python
    installation and the code on the import path (a test suite a code reward runs); nothing
    else (home, checkpoints, the rank's temporary files) is readable."""

    allow_unconfined: bool = False
    """Whether the reward workers may run where Landlock does not work (an old kernel, a
    container filtering its calls), reading and writing what file permissions allow (the
    network and process limits still hold), logged once at start; false: the job refuses to
    start there."""

    functions: dict[str, str] = field(default_factory=dict)
    """data_source -> reward function as a dotted path, "package.module:function" or
    "package.module.function" (verl's compute_score signature: fn(data_source, solution_str,
    ground_truth, extra_info) -> float or dict with "score"). Overrides built-ins."""

    default_function: Optional[str] = None
    """Dotted path of the function for data sources neither `functions` nor the built-ins know
    (None: such a data source is an error at start-up)."""

    format_weight: float = 0.0
    """Weight w of the format reward, in [0, 1]: score = (1 - w) * correctness + w * format,
    where format is 1 when the whole response matches format_pattern, else 0."""

    format_pattern: str = R1_FORMAT_PATTERN
    """Regular expression the whole response must match (re.fullmatch, DOTALL) to earn the
    format reward; the default is DeepSeek-R1's "<think>...</think> <answer>...</answer>"."""

    max_failed_steps: int = 2
    """Stop the job after this many consecutive steps in which every sample's reward was an
    error (a function that cannot load, read its files, see its variables or reach its service
    in the sandbox); 0: never. Before the first step each data source's function also runs
    once on a real row, and a failure there stops the job at start."""

    shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    """The missing-EOS penalty, centring, running normalisation and clipping of the scores
    before training."""

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        errors = self.shaping.errors()
        if self.num_workers < 0:
            errors.append(f"reward.num_workers={self.num_workers} must be >= 0 (0: inline)")
        if not self.timeout_seconds > 0:
            errors.append(f"reward.timeout_seconds={self.timeout_seconds} must be positive")
        if self.memory_mb <= 0:
            errors.append(f"reward.memory_mb={self.memory_mb} must be positive")
        if self.max_failed_steps < 0:
            errors.append(f"reward.max_failed_steps={self.max_failed_steps} must be >= 0 (0: "
                          "never stop)")
        if not self.startup_timeout_seconds > 0:
            errors.append(f"reward.startup_timeout_seconds={self.startup_timeout_seconds} "
                          "must be positive")
        for data_source, path in self.functions.items():
            if not data_source:
                errors.append(f"reward.functions has an empty data_source (function {path!r})")
            if not looks_like_dotted_path(path):
                errors.append(f"reward.functions.{data_source}={path!r} must be a dotted path "
                              "like package.module:function")
        if self.default_function is not None and not looks_like_dotted_path(
                self.default_function):
            errors.append(f"reward.default_function={self.default_function!r} must be a dotted "
                          "path like package.module:function")
        if not 0 <= self.format_weight <= 1:
            errors.append(f"reward.format_weight={self.format_weight} must be in [0, 1]")
        try:
            re.compile(self.format_pattern)
        except re.error as error:
            errors.append(f"reward.format_pattern={self.format_pattern!r} is not a regular "
                          f"expression: {error}")
        return errors


def looks_like_dotted_path(path: str) -> bool:
    """True for "module:function" or "package.module.function" (whether it imports is checked
    when the rewards are built)."""
    return bool(re.fullmatch(r"[\w.]+:[\w.]+|[\w.]+\.\w+", path or ""))
