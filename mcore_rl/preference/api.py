"""The short Python entry point of the preference jobs, shaped like the RL one:

    config  = make_preference_config("rm", model="runs/sft/model",
                                     train_files=["pairs.jsonl"], batch_size=32)
    hf_dir  = RewardModelTrainer(config).fit()      # then reward.model_path=hf_dir in RL
    config  = make_preference_config("dpo", model="/models/Qwen3-0.6B", beta=0.1,
                                     train_files=["pairs.parquet"], overrides=["dpo.epochs=2"])
    hf_dir  = DpoTrainer(config).fit()

Every keyword maps onto one field of the job's section (rm or dpo; documented there); anything
else goes in `overrides` as dotted key=value strings, applied after `config_file`.
"""

from __future__ import annotations

from typing import Iterable, Optional

from mcore_rl.config import InitConfig, JobConfig, load_config

JOBS = ("rm", "dpo")
SECTION_KEYWORDS = ("train_files", "val_files", "batch_size", "micro_batch_size", "epochs",
                    "max_length", "beta", "loss_type", "label_smoothing", "margin", "reward_l2")


def make_preference_config(job: str, *, config_file: Optional[str] = None,
                           overrides: Iterable[str] = (), model: Optional[str] = None,
                           lr: Optional[float] = None, **section: object) -> JobConfig:
    """A JobConfig for `job` ("rm" or "dpo"), validated when the trainer starts. model: the
    starting weights (an HF folder or an mcore_rl checkpoint); section keywords: the fields of
    config.<job> named in SECTION_KEYWORDS."""
    if job not in JOBS:
        raise ValueError(f"job={job!r} must be one of {JOBS}")
    unknown = sorted(set(section) - set(SECTION_KEYWORDS))
    if unknown:
        raise ValueError(f"unknown keyword(s) {unknown}; use overrides=['{job}.<field>=...']")
    settings = [f"{job}.{name}={_yaml(value)}" for name, value in section.items()
                if value is not None]
    if lr is not None:
        settings.append(f"{job}.optimizer.lr={lr}")
    if model is not None:
        init = InitConfig.from_path(model)
        settings += [f"init.hf_path={init.hf_path}" if init.hf_path
                     else f"init.checkpoint={init.checkpoint}"]
    return load_config(config_file, settings + list(overrides))


def _yaml(value: object) -> str:
    """A keyword's value as an override's right-hand side."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(item) for item in value) + "]"
    return str(value)
