"""tqdm progress bars for long phases, shown by global rank 0 only.

Every rank of an SPMD job runs the same loops; if each drew its bar, a terminal would show one
bar per rank fighting over the same line, and batch logs would fill with carriage returns. So
`progress(...)` gives a real tqdm bar on global rank 0 when bars are enabled, and everywhere
else a `NullProgress` with the same interface (iteration, `update`, `close`, `with`,
`set_postfix`, `set_description`), so callers never branch on the rank.

Enabled when, on global rank 0:

    MCORE_RL_PROGRESS=1   always (also into a log file or pipe)
    MCORE_RL_PROGRESS=0   never
    unset                 only when the bar's stream (stderr by default) is a terminal

so SLURM logs and CI output stay free of bars unless asked for. Usage:

    for name in progress(names, desc="hf->mcore", unit="tensor"):
        ...
    with progress(total=len(rows), desc="generate", unit="resp", leave=False) as bar:
        bar.update(len(chunk))
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Iterator, TextIO

import torch.distributed as dist

ENV_VAR = "MCORE_RL_PROGRESS"
"""0: no bars; 1: bars on rank 0 even when stderr is not a terminal; unset: bars on a terminal."""


def _global_rank() -> int:
    """The process group's rank, or the launcher's before the group exists (every torchrun
    process would otherwise believe it is rank 0)."""
    if dist.is_initialized():
        return dist.get_rank()
    from .launch_env import read_launch_env

    try:
        return read_launch_env().rank
    except ValueError:  # malformed launcher variables: the start-up code reports them
        return 0


def progress_enabled(file: TextIO | None = None) -> bool:
    """Whether `progress` draws a real bar here: global rank 0, and MCORE_RL_PROGRESS=1, or the
    variable unset and `file` (default: stderr) a terminal."""
    if _global_rank() != 0:
        return False
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting:
        return setting not in ("0", "false", "False", "no")
    stream = file if file is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


class NullProgress:
    """What `progress` returns where no bar is drawn: counts like tqdm, prints nothing."""

    def __init__(self, iterable: Iterable | None = None, total: float | None = None):
        self.iterable = iterable
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.n = 0

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.n += 1

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(iterable: Iterable | None = None, total: float | None = None,
             desc: str | None = None, unit: str = "it", file: TextIO | None = None,
             **tqdm_kwargs):
    """A tqdm bar over `iterable` (or to be advanced with `update`) on global rank 0 when
    enabled (see the module docstring), else a NullProgress. `total` defaults to
    len(iterable) where it has one; `file` (default stderr) is where the bar is drawn;
    other keywords go to tqdm (e.g. leave=False for a bar drawn once per step)."""
    if not progress_enabled(file):
        return NullProgress(iterable, total)
    from tqdm import tqdm

    tqdm_kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, **tqdm_kwargs)
