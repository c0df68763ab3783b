"""What on-policy distillation adds to an RL job's build: the teacher, checked before it is
built (tokenizer, layout, memory) on every rank (docs/distillation.md). The rewards of pure
distillation: rl/job_rewards.py.
"""

from __future__ import annotations

import torch.distributed as dist

from mcore_rl.config import ConfigError, InitConfig, JobConfig
from mcore_rl.conversion.model_source import model_of_init
from mcore_rl.data.tokenizer import tokenizer_folder, vocabulary_differences
from mcore_rl.models import DTYPES
from mcore_rl.models.pretrained import build_frozen_from_init
from mcore_rl.roles import Teacher
from mcore_rl.runtime import Runtime, print0
from mcore_rl.runtime.agreement import raise_on_any_rank
from mcore_rl.runtime.devices import device_memory_bytes
from mcore_rl.runtime.layout import ParallelLayout
from mcore_rl.runtime.model_rank import build_model_rank
from mcore_rl.training.memory_plan import scoring_memory, training_memory


def build_teacher(config: JobConfig, tokenizer, runtime: Runtime) -> Teacher:
    """The frozen teacher in its own layout (teacher.parallel), after checking on every rank,
    before anything is built, that it shares the student's tokenizer, fits that layout and
    fits the device's memory beside the student's training state."""
    if tokenizer is None:
        raise ValueError("a teacher needs the student's tokenizer to be checked against")
    settings = config.teacher
    model = model_of_init(settings.init, "teacher.init")
    check_teacher(config, model, tokenizer, device_memory_bytes(runtime.device))
    parallel = settings.parallel_config(config.parallel, model.moe.enabled)
    place = build_model_rank(ParallelLayout.of(parallel, dist.get_world_size()),
                             config.runtime.collective_timeout_minutes)
    module = build_frozen_from_init(settings.init, model, parallel, config.runtime.precision,
                                    place, runtime.device)
    return Teacher(module, model.vocab_size, _micro_batch_size(config),
                   config.rollout.sampling.temperature, settings.offload,
                   runtime.training.dp_rank)


def check_teacher(config: JobConfig, model, tokenizer, available: int) -> None:
    """Raise on every trainer rank if any rank finds the teacher (`model`) unfit: its layout, its
    tokenizer against the student's, its memory against this rank's `available` device bytes.
    A problem one rank alone sees (its device's memory, a file it cannot read) must not leave
    the others waiting in the teacher's first collective."""
    settings = config.teacher
    parallel = settings.parallel_config(config.parallel, model.moe.enabled)
    micro_batch_size = _micro_batch_size(config)
    problems = [f"the teacher's {problem}" for problem in
                model.check(parallel.tensor_model_parallel_size,
                            parallel.pipeline_model_parallel_size,
                            parallel.expert_model_parallel_size)]
    problems += teacher_tokenizer_problems(settings.init, tokenizer)
    trainers = dist.get_world_size()  # the default group: the trainers, also in split placement
    problems += teacher_memory_problems(config, model, micro_batch_size, available, trainers)
    source = settings.init.hf_path or settings.init.checkpoint
    raise_on_any_rank(problems, ConfigError, f"teacher.init={source}: ")


def _micro_batch_size(config: JobConfig) -> int:
    return config.teacher.micro_batch_size or config.actor.micro_batch_size


def teacher_tokenizer_problems(init: InitConfig, tokenizer) -> list[str]:
    """Why the teacher's tokenizer is not the student's `tokenizer` (the same token ids), if it
    is not: the teacher scores the student's token ids as its own."""
    folder = tokenizer_folder(init)
    if folder is None:
        return ["it has no tokenizer (an mcore_rl checkpoint keeps one in tokenizer/) to check "
                "against the student's"]
    from transformers import AutoTokenizer
    try:
        theirs = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        return [f"its tokenizer in {folder} cannot be loaded ({error})"]
    differences = vocabulary_differences(tokenizer, theirs, ("the student's tokenizer",
                                                             "the teacher's"))
    if not differences:
        return []
    return ["its vocabulary is not the student's (the teacher must use the student's "
            "tokenizer): " + ", ".join(differences)]


def teacher_memory_problems(config: JobConfig, model, micro_batch_size: int,
                            available: int, trainers: int) -> list[str]:
    """The teacher's (`model`'s) weights and one micro-batch's logits per device, beside the
    student's training state over `trainers` ranks (resident while the teacher scores),
    against the `available` bytes of one device; said on rank 0 either way."""
    parallel = config.parallel
    teacher = config.teacher.parallel_config(parallel, model.moe.enabled)
    tp, pp = teacher.tensor_model_parallel_size, teacher.pipeline_model_parallel_size
    weight_bytes = DTYPES[config.runtime.precision].itemsize
    need = scoring_memory(model, tp, pp, weight_bytes, micro_batch_size,
                          config.sequence_length())
    student = training_memory(config.model, config.actor.lora, parallel.model_parallel_size,
                              trainers // parallel.model_parallel_size, weight_bytes,
                              config.algorithm.needs_reference).total
    summary = (f"teacher: {_gib(need.weights)} of weights per device (TP {tp} x PP {pp}) + "
               f"{_gib(need.logits)} of logits per micro-batch of {micro_batch_size}, beside "
               f"the student's {_gib(student)} of training state, of the device's "
               f"{_gib(available)}")
    print0(summary)
    if need.total + student <= available:
        return []
    return [f"it does not fit: {summary}; raise teacher.parallel.tensor_model_parallel_size "
            f"or pipeline_model_parallel_size, or lower teacher.micro_batch_size"]


def _gib(size: float) -> str:
    return f"{size / 2 ** 30:.3g} GiB"
