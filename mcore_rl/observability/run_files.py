"""The run directory as a contract between `mcore-rl train` (the writer) and the readers here
(`mcore-rl compare`, `mcore-rl plot`, notebooks).

    <runtime.output_dir>/
        config.yaml      the resolved job config
        metrics.jsonl    one line per training step: {"step": 3, "wall_time": 1.7e9, "reward/mean": ...}
        eval.jsonl       one line per evaluation:    {"step": 0, "wall_time": ..., "eval/accuracy": ...}
        checkpoints/  tensorboard/  plots/

Why JSON lines next to TensorBoard: event files need TensorBoard's reader to get the numbers
back, while a line of JSON per step can be read by anything, appended to without rewriting, and
survives a kill: only rank 0 writes, each line is written whole and flushed, so a SIGKILL loses
at most the line being written.

Resume: a resumed run appends to the same files. It restarts from its newest checkpoint, which
can be older than the last line written (a run killed after logging step k but before saving
it logs step k again), so readers keep the LAST line for each step. A line cut short by a kill
is dropped: the writer truncates an unterminated tail before appending, and the reader ignores
an unterminated final line it cannot parse (the run may be writing it right now).

Non-finite values are written as Python's json writes them (NaN, Infinity) and read back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Mapping

import yaml

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
PLOTS_DIR = "plots"
RESERVED_KEYS = ("step", "wall_time")
"""Keys every line carries; no metric may use them as its name."""


class RunDirectoryError(ValueError):
    """A directory that is not a readable mcore_rl run (missing files, malformed lines)."""


class JsonlWriter:
    """Appends one JSON object per line ({"step", "wall_time", **metrics}) and flushes it.
    Rank 0 only. Opening an existing file continues it (resume) after dropping a torn tail."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        """The file appended to."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_unterminated_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append the line for `step` (wall_time: now, unix seconds) and flush it."""
        clash = [name for name in RESERVED_KEYS if name in metrics]
        if clash:
            raise ValueError(f"{self.path}: metric names {clash} are reserved")
        record = {"step": int(step), "wall_time": time.time()}
        record.update((name, float(value)) for name, value in metrics.items())
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (lines already written are flushed)."""
        self._file.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def drop_unterminated_tail(path: Path, block: int = 1 << 16) -> None:
    """Truncate a final line without a newline (a write cut short by a kill), so the next line
    does not glue onto it. Reads only the file's tail."""
    if not path.exists():
        return
    with open(path, "r+b") as handle:
        end = handle.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - block)
            handle.seek(start)
            newline = handle.read(position - start).rfind(b"\n")
            if newline >= 0:
                position = start + newline + 1
                break
            position = start
        if position != end:
            handle.truncate(position)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every line of a metrics file in file order, as dicts with an int "step". Blank lines are
    skipped; an unterminated last line that does not parse is ignored (being written, or cut by
    a kill); any other bad line raises RunDirectoryError naming the file and line number."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # no newline after it: a torn or in-progress write
                continue
            raise RunDirectoryError(f"{path}: line {number}: malformed JSON ({error.msg})") \
                from None
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise RunDirectoryError(f"{path}: line {number}: expected an object with an integer "
                                    f"\"step\", got {line[:80]!r}")
        records.append(record)
    return records


def last_line_per_step(records: list[dict]) -> list[dict]:
    """One record per step, the last one written for it (a resumed run repeats the steps after
    its checkpoint), sorted by step."""
    by_step = {record["step"]: record for record in records}
    return [by_step[step] for step in sorted(by_step)]


@dataclasses.dataclass
class Run:
    """One run directory, parsed."""

    directory: Path
    """The run directory (runtime.output_dir)."""
    name: str
    """How tables and legends call it: the directory as given."""
    metrics: list[dict]
    """metrics.jsonl: one record per step (the last line written for it), sorted by step."""
    evals: list[dict]
    """eval.jsonl: one record per evaluated step, same rule; empty without evaluations."""
    config_text: str
    """config.yaml as written."""
    config: dict
    """config.yaml parsed."""

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a metric over the steps that logged it: eval/ names from
        eval.jsonl, the rest from metrics.jsonl."""
        records = self.evals if name.startswith("eval/") else self.metrics
        pairs = [(record["step"], float(record[name])) for record in records
                 if record.get(name) is not None]
        return [step for step, _ in pairs], [value for _, value in pairs]

    def has(self, name: str) -> bool:
        """Whether any step logged `name` with a value that is not nan."""
        return any(not math.isnan(value) for value in self.series(name)[1])


def load_run(run_dir: str | os.PathLike) -> Run:
    """Parse a run directory; RunDirectoryError for a directory that is not one, or a bad
    line (file and line number in the message)."""
    directory = Path(run_dir)
    for required in (METRICS_FILE, CONFIG_FILE):
        if not (directory / required).is_file():
            raise RunDirectoryError(f"{run_dir} is not an mcore_rl run directory: no {required} "
                                    "(written by mcore-rl train)")
    config_text = (directory / CONFIG_FILE).read_text(encoding="utf-8")
    try:
        config = yaml.safe_load(config_text) or {}
    except yaml.YAMLError as error:
        raise RunDirectoryError(f"{directory / CONFIG_FILE}: malformed YAML ({error})") from None
    evals_path = directory / EVAL_FILE
    evals = read_jsonl(evals_path) if evals_path.is_file() else []
    return Run(directory=directory, name=os.path.normpath(run_dir),
               metrics=last_line_per_step(read_jsonl(directory / METRICS_FILE)),
               evals=last_line_per_step(evals), config_text=config_text, config=config)


def refuse_earlier_run(output_dir: str, markers: tuple[str, ...], what: str,
                       because: str = "") -> None:
    """A job must not append to another run's files: every rank raises FileExistsError when
    rank 0 finds one of `markers` (a non-empty file or a folder) in output_dir. Collective."""
    import torch.distributed as dist

    from mcore_rl.runtime.agreement import raise_on_any_rank

    problems = []
    if dist.get_rank() == 0:
        found = [os.path.join(output_dir, name) for name in markers
                 if os.path.isdir(os.path.join(output_dir, name))
                 or (os.path.isfile(os.path.join(output_dir, name))
                     and os.path.getsize(os.path.join(output_dir, name)))]
        if found:
            problems.append(f"runtime.output_dir={output_dir} {what} ({found[0]}){because}; "
                            "choose another runtime.output_dir or delete it")
    raise_on_any_rank(problems, FileExistsError, "")
