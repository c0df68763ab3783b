"""Spawned-world body of test_distillation: one RL step of the toy task distilled from a
teacher, its batch from every trainer rank, and the teacher's log-probs of a fixed batch."""

import torch
import torch.distributed as dist

FIXED_ROWS, FIXED_LENGTH = 6, 10


def fixed_batch() -> dict:
    """Random toy-vocabulary rows, the same on every rank; the last 5 positions scored."""
    input_ids = torch.randint(0, 16, (FIXED_ROWS, FIXED_LENGTH),
                              generator=torch.Generator().manual_seed(0))
    response_mask = torch.zeros_like(input_ids)
    response_mask[:, -5:] = 1
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "response_mask": response_mask}


def distill_step(out_path: str, overrides: list[str]) -> None:
    """On a rollout rank of split placement: the rollout loop, until the trainers end it."""
    from mcore_rl.config import load_config
    from mcore_rl.rl import Trainer
    from mcore_rl.rl.split.rollout_worker import run_rollout_ranks
    from mcore_rl.runtime import read_launch_env
    from rl_worker import TOY_CONFIG

    config = load_config(TOY_CONFIG, overrides)
    launch = read_launch_env()
    if config.placement.side_of(launch.rank, launch.world_size) == "rollout":
        run_rollout_ranks(config)
        return
    trainer = Trainer(config)
    experience = trainer.collect_data()
    kept = ("input_ids", "attention_mask", "response_mask", "old_logprobs",
            "teacher_logprobs", "advantages")
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {name: experience.batch[name] for name in kept})
    fixed = trainer.roles.teacher.logprobs(fixed_batch())
    metrics = trainer.update_policy(experience)
    if dist.get_rank() == 0:
        torch.save({"rows": rows, "fixed": fixed, "metrics": metrics}, out_path)
    trainer.close()


def check_with_little_memory_on_rank_one(out_path: str, overrides: list[str]) -> None:
    """The teacher's checks with only rank 1's device too small: every rank saves the error it
    raised (before, rank 1 raised alone and rank 0 went on into the teacher's collectives)."""
    from transformers import AutoTokenizer

    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.conversion.model_source import model_of_init
    from mcore_rl.rl.distillation import check_teacher
    from rl_worker import TOY_CONFIG

    dist.init_process_group("gloo")
    config = load_config(TOY_CONFIG, overrides)
    tokenizer = AutoTokenizer.from_pretrained(config.data.tokenizer)
    available = 1 if dist.get_rank() == 1 else 2 ** 40
    try:
        check_teacher(config, model_of_init(config.teacher.init, "teacher.init"), tokenizer,
                      available)
        raised = None
    except ConfigError as error:
        raised = str(error)
    torch.save(raised, f"{out_path}.{dist.get_rank()}")
    dist.destroy_process_group()
