"""One rank of the multi-turn RL world (tests/test_agents_rl.py): a batch of episodes through
vLLM, with every token the engine sampled recorded, then one update."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mcore_rl.config import load_config
from mcore_rl.rl import Trainer

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart",
                      "agents_grpo.yaml")


def countdown_job(folder) -> list[str]:
    """Overrides of a tiny random model on the agents example's tokenizer and questions, whose
    episodes have up to three turns (agent_environments:Countdown answers whatever the model
    writes); writes the tokenizer and data into `folder`."""
    from mcore_rl.quickstart.agents_example import VOCABULARY, questions, write_tokenizer
    from mcore_rl.quickstart.task import write_jsonl

    tokenizer = write_tokenizer(str(folder / "tokenizer"))
    data = write_jsonl(str(folder / "questions.jsonl"), questions(64, seed=1))
    return [
        "init.checkpoint=null", f"data.tokenizer={tokenizer}", f"data.train_files=[{data}]",
        f"data.val_files=[{data}]", "data.toy.size=0", "data.toy.val_size=0",
        "data.max_prompt_tokens=8",
        "rollout.multi_turn.environment=agent_environments:Countdown",
        "rollout.prompts_per_step=4", "rollout.sampling.n=4", "actor.micro_batch_size=8",
        # a random model ends its turn (samples <eos>) within 12 tokens about a third of the time
        "rollout.sampling.max_new_tokens=12", "rollout.multi_turn.max_episode_tokens=60",
        "rollout.eval_sampling.max_new_tokens=12",
        "model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256",
        "model.num_attention_heads=2", "model.num_kv_heads=2",
        f"model.vocab_size={len(VOCABULARY)}", "model.max_position_embeddings=64"]


def collect_and_update(out_path: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(CONFIG, overrides))
    engine = trainer.scheduler.generator.engine
    sampled, step = [], engine.step

    def recording_step():
        finished = step()
        sampled.extend((sample.key, sample.token_ids, sample.logprobs) for sample in finished)
        return finished

    engine.step = recording_step
    experience = trainer.collect_data()
    metrics = trainer.update_policy(experience)
    batch = experience.batch
    mask = batch["response_mask"].bool()
    episodes = {}  # "p<prompt>/s<sample>" -> its turns' tokens in order
    for key, token_ids, _ in sorted(sampled, key=lambda item: _turn_order(item[0])):
        episodes.setdefault(key.split("/", 1)[1].rpartition("/t")[0], []).extend(token_ids)
    engine_order = [episodes[key] for key in sorted(episodes, key=_row_order)]
    fed = batch["attention_mask"].sum(dim=1) - 1  # every real token but a row's last
    routes = batch.get("routed_experts")
    result = {"trained": [row[m].tolist() for row, m in zip(batch["input_ids"], mask)],
              "routes_expected": int(fed.sum()),
              "routes_given": 0 if routes is None else int((routes[:, :, 0, 0] >= 0).sum()),
              "sampled": engine_order,
              "mismatch": float((batch["engine_logprobs"] - batch["old_logprobs"])[mask]
                                .abs().max()),
              "metrics": metrics}
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    trainer.close()


def _turn_order(key: str) -> tuple[int, int, int]:
    """"e1/p3/s2/t1" -> (3, 2, 1)."""
    _, prompt, sample, turn = key.split("/")
    return int(prompt[1:]), int(sample[1:]), int(turn[1:])


def _row_order(key: str) -> tuple[int, int]:
    """"p3/s2" -> (3, 2): the order of the batch's rows."""
    prompt, sample = key.split("/")
    return int(prompt[1:]), int(sample[1:])
