"""All prompt sources of one split (train or val), loaded and checked in one call.

Order is fixed so record indices are stable for a given config: the files in the order listed,
then the reasoning-gym tasks in the order listed, then the toy task. Validation prompts come from
the val files and from the generators at seed + VAL_SEED_OFFSET, so they never repeat training
entries.
"""

from __future__ import annotations

from mcore_rl.config.data import VAL_SEED_OFFSET, DataConfig

from .files import read_prompt_file
from .reasoning_gym_source import reasoning_gym_records
from .records import DataError, PromptRecord
from .toy import toy_copy_records

SPLITS = ("train", "val")


def load_records(config: DataConfig, split: str = "train") -> tuple[list[PromptRecord], int]:
    """The records of `split` and the number of bad rows skipped (0 unless
    data.on_bad_row=skip). Raises DataError on an invalid config, an unreadable file, a bad row
    (naming the file and row) or a training split with no prompts. A val split with no sources
    gives no records."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    errors = config.errors()
    if errors:
        raise DataError("invalid data configuration:\n  - " + "\n  - ".join(errors))
    train = split == "train"
    records, skipped = [], 0
    for path in config.train_files if train else config.val_files:
        file_records, file_skipped = read_prompt_file(path, config.prompt_key,
                                                      config.on_bad_row, len(records))
        records += file_records
        skipped += file_skipped
    seed_offset = 0 if train else VAL_SEED_OFFSET
    gym = config.reasoning_gym
    gym_size = gym.size if train else gym.val_size
    if gym.tasks and gym_size:
        records += reasoning_gym_records(gym, gym_size, gym.seed + seed_offset, len(records))
    toy_size = config.toy.size if train else config.toy.val_size
    if toy_size:
        records += toy_copy_records(toy_size, config.toy.seed + seed_offset, len(records))
    if train and not records:
        raise DataError(f"no training prompts: all {skipped} rows were skipped as bad")
    return records, skipped
