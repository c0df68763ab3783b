"""What every job on a fixed dataset (sft, rm, dpo) does around its own loss: start the world
and the run folder, visit the examples epoch by epoch in a seeded, DP-sharded order, evaluate
when due, and sum held-out statistics over the data-parallel ranks.

    job   = start_dataset_job(config, "rm", "reward-model", markers)     (collective)
    steps = run_epochs(job.place, config.rm, num_examples, job.logger, "rm", train_on,
                       evaluate)
    ...save the model...; job.close()
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mcore_rl.config import JobConfig, to_yaml
from mcore_rl.config.job import validate_dataset_job
from mcore_rl.conversion.model_source import with_model_from_init
from mcore_rl.data import load_tokenizer
from mcore_rl.data.example_order import epoch_order, rank_rows
from mcore_rl.observability import refuse_earlier_run
from mcore_rl.observability.step_metrics import MetricsLogger
from mcore_rl.runtime import initialize, read_launch_env, shutdown
from mcore_rl.runtime.devices import collective_device
from mcore_rl.runtime.files import write_text_atomically
from mcore_rl.runtime.model_rank import ModelRank
from mcore_rl.runtime.progress import progress

StepFn = Callable[[list[int], list[int]], tuple[dict, int]]
"""(this DP rank's example indices, the whole step's) -> (metrics, tokens in the step)."""


@dataclass
class DatasetJob:
    """A started job: its validated config, devices, tokenizer and metrics logger."""

    config: JobConfig
    runtime: object
    tokenizer: object
    logger: MetricsLogger

    @property
    def place(self) -> ModelRank:
        """This rank in the trained model's layout."""
        return self.runtime.training

    def close(self) -> None:
        """Flush the logs and tear the world down (collective)."""
        self.logger.close()
        shutdown()


def start_dataset_job(config: JobConfig, section: str, what: str, markers: tuple[str, ...],
                      a_run: str) -> DatasetJob:
    """Validate config.<section> (errors headed "invalid <what> configuration"), start the
    world, refuse an output_dir holding an earlier run (any of `markers`; "already holds
    <a_run>"), load the tokenizer and record config.yaml (collective)."""
    launch = read_launch_env()
    config = validate_dataset_job(with_model_from_init(config), launch.world_size, section, what)
    runtime = initialize(config, launch)
    output_dir = config.runtime.output_dir
    # A dataset job does not resume: any earlier run in output_dir is refused.
    refuse_earlier_run(output_dir, markers, f"already holds {a_run}")
    tokenizer = load_tokenizer(config)
    logger = MetricsLogger.for_job(config)
    if dist.get_rank() == 0:
        write_text_atomically(os.path.join(output_dir, "config.yaml"), to_yaml(config))
    return DatasetJob(config, runtime, tokenizer, logger)


def run_epochs(here: ModelRank, section_config, num_examples: int, logger: MetricsLogger,
               section: str, train_on: StepFn, evaluate: Optional[Callable[[], dict]]) -> int:
    """section_config.epochs passes of whole batches of section_config.batch_size examples,
    each split over the data-parallel ranks of `here`, logging each step, and `evaluate()`
    (None: no held-out data) every eval_every steps, or after each epoch, and after the last
    step. Returns the number of steps."""
    dp_rank, dp_size = here.dp_rank, here.dp_size
    batch_size = section_config.batch_size
    steps_per_epoch = num_examples // batch_size
    step = 0
    with progress(total=section_config.epochs * steps_per_epoch, desc=section,
                  unit="step") as bar:
        for epoch in range(section_config.epochs):
            order = epoch_order(num_examples, section_config.seed, epoch)
            for index in range(steps_per_epoch):
                started = time.perf_counter()
                metrics, tokens = train_on(rank_rows(order, index, batch_size, dp_rank, dp_size),
                                           order[index * batch_size:(index + 1) * batch_size])
                step += 1
                bar.update(1)
                seconds = time.perf_counter() - started
                logger.log(step, dict(metrics, **{f"{section}/epoch": epoch + 1,
                                                  "time/step": seconds,
                                                  "throughput/tokens_per_second":
                                                      tokens / seconds}))
                epoch_done = index == steps_per_epoch - 1
                every = section_config.eval_every
                due = step % every == 0 if every else epoch_done
                if evaluate and (due or (epoch_done and epoch == section_config.epochs - 1)):
                    logger.log(step, evaluate(), prefix="eval")
    return step


def data_parallel_sums(here: ModelRank, count: int, micro_batch_size: int, width: int,
                       sums_of: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
    """Sum over micro-batches and data-parallel ranks of `sums_of(indices)` (a vector of
    `width` numbers), each DP rank taking every dp_size-th of the `count` examples
    (collective). Every rank runs the same number of micro-batches (a Mixture-of-Experts
    layer with experts split over ranks exchanges tokens in each forward pass): a rank out of
    examples scores its first ones again and adds nothing."""
    dp_rank, dp_size = here.dp_rank, here.dp_size
    group = here.group("dp")
    device = collective_device(group)
    rows = list(range(dp_rank, count, dp_size))
    totals = torch.zeros(width, dtype=torch.float64, device=device)
    most_rows = -(-count // dp_size)
    for start in range(0, most_rows, micro_batch_size):
        mine = rows[start:start + micro_batch_size]
        sums = sums_of(mine or rows[:micro_batch_size] or [0]).double().to(device)
        totals += sums if mine else 0 * sums
    dist.all_reduce(totals, group=group)
    return totals
