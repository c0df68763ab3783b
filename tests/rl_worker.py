"""One rank of an RL training world (run by tests/test_rl_learning.py and the resume test).

Builds the job from `configs/grpo_toy.yaml` plus overrides, runs `Trainer.fit()` with held-out
evaluation before the first and after the last step, and rank 0 saves the history.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from mcore_rl.config import load_config
from mcore_rl.evaluation import Evaluator
from mcore_rl.rl import Trainer

TOY_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_toy.yaml")


class SampleCounter(Evaluator):
    """A user evaluator: how many prompts and responses reached it (from every DP rank)."""

    def evaluate(self, trainer, samples):
        return {"prompts_seen": len(samples.prompts), "responses_seen": len(samples.responses)}


def train(out_path: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    trainer.register_evaluator(SampleCounter())
    before = trainer.evaluate()
    history = trainer.fit()
    after = trainer.evaluate()
    config = trainer.evaluator.config
    trainer.evaluator.config = dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, eval_kl_to_reference=False))
    after_without_kl = trainer.evaluate()
    if dist.get_rank() == 0:
        torch.save({"before": before, "after": after, "after_without_kl": after_without_kl,
                    "history": history}, out_path)
    trainer.close()


def train_until_signal(out_path: str, overrides: list[str], signal_after_step: int,
                       signalled_rank: int) -> None:
    """Like a SLURM preemption notice: after step `signal_after_step`, SIGUSR1 reaches one rank
    and every process it started (reward workers, the engine's processes, the checkpoint
    writer's Manager that a save before the first step starts); fit() must save and stop on
    every rank, and the child processes must survive the signal."""
    import signal

    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    trainer.save()
    children = []
    train_step = trainer.train_step

    def step_then_signal():
        metrics = train_step()
        if trainer.step == signal_after_step and dist.get_rank() == signalled_rank:
            children.extend(_child_pids())
            for pid in children + [os.getpid()]:
                os.kill(pid, signal.SIGUSR1)
        return metrics

    trainer.train_step = step_then_signal
    history = trainer.fit()
    result = {"history": history, "preempted": trainer.preempted, "children": len(children),
              "children_alive": all(_is_running(pid) for pid in children)}
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    trainer.close()


def _child_pids() -> list[int]:
    pids = []
    for thread in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{thread}/children") as handle:
            pids += [int(pid) for pid in handle.read().split()]
    return pids


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def nonfinite_update(out_path: str) -> None:
    """A NaN loss must leave the weights and the LR schedule untouched; a finite one must
    not."""
    from mcore_rl.config import BatchConfig, JobConfig, ModelConfig
    from mcore_rl.models import build_gpt_model
    from mcore_rl.runtime import initialize, shutdown
    from mcore_rl.smoke import next_token_loss, random_batch
    from mcore_rl.training import make_trainable, train_step

    config = JobConfig(model=ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128,
                                         num_attention_heads=4, num_kv_heads=2, vocab_size=64,
                                         max_position_embeddings=32),
                       batch=BatchConfig(global_batch_size=4, micro_batch_size=2, seq_length=16))
    place = initialize(config).training
    trainable = make_trainable(build_gpt_model(config.model, config.parallel, place=place),
                               config.optimizer, "fp32")
    batch = random_batch(config, 0)

    def nan_loss(outputs, micro_batch):
        numerator, denominator, metrics = next_token_loss(outputs, micro_batch)
        return numerator * float("nan"), denominator, metrics

    def snapshot():
        return [p.detach().clone() for p in trainable.chunks[0].parameters()]

    before = snapshot()
    skipped = train_step(trainable, batch, 2, nan_loss, vocab_size=64)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    scheduler_steps = trainable.scheduler.num_steps
    taken = train_step(trainable, batch, 2, next_token_loss, vocab_size=64)
    changed = not all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    torch.save({"skipped": skipped, "unchanged": unchanged, "scheduler_steps": scheduler_steps,
                "taken": taken, "changed": changed}, out_path)
    shutdown()


def reward_model_scores(out_path: str, model_path: str, tensor_parallel: int) -> None:
    """Scores of hf_models.reference_batch by the reward model built from an HF classifier."""
    from hf_models import reference_batch

    from mcore_rl.config import JobConfig, ParallelConfig
    from mcore_rl.config.reward import RewardConfig
    from mcore_rl.conversion.sequence_classifier import open_sequence_classifier
    from mcore_rl.runtime import initialize, shutdown
    from mcore_rl.rl.build import build_reward_model

    model = open_sequence_classifier(model_path)[2]
    # 4 rows in micro-batches of 3: the row count need not divide (an evaluation's does not).
    config = JobConfig(model=model,
                       parallel=ParallelConfig(tensor_model_parallel_size=tensor_parallel),
                       reward=RewardConfig(model_path=model_path),
                       actor=dataclasses.replace(JobConfig().actor, micro_batch_size=3))
    runtime = initialize(config)
    ids, mask = reference_batch(model.vocab_size)
    scores = build_reward_model(config, runtime).score(ids, mask)
    if dist.get_rank() == 0:
        torch.save(scores, out_path)
    shutdown()


def train_and_export(out_path: str, overrides: list[str]) -> None:
    """One step, then the actor exported as an HF folder; rank 0 saves the actor's log-probs of
    a fixed batch for the test to compare with transformers on the export."""
    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    trainer.train_step()
    trainer.export_hf()
    hf_dir = trainer.export_hf()  # as after a resume: the step's earlier export is replaced
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 16, (16, 10), generator=generator)  # one micro-batch
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    logprobs = trainer.roles.actor.logprobs(batch)["logprobs"]
    if dist.get_rank() == 0:
        torch.save({"hf_dir": hf_dir, "input_ids": input_ids, "logprobs": logprobs}, out_path)
    trainer.close()


def fit(out_path: str, overrides: list[str]) -> None:
    """Trainer.fit(); rank 0 saves the history and whether it stopped early."""
    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    history = trainer.fit()
    if dist.get_rank() == 0:
        torch.save({"history": history, "stopped": trainer.selection.stopped}, out_path)
    trainer.close()


def train_steps(out_path: str, overrides: list[str], steps: int) -> None:
    """`steps` training steps; rank 0 saves their metrics."""
    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    history = [trainer.train_step() for _ in range(steps)]
    if dist.get_rank() == 0:
        torch.save(history, out_path)
    trainer.close()



def evaluate_then_step(out_path: str, overrides: list[str]) -> None:
    """An evaluation of the initial policy, then one training step; rank 0 saves both."""
    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    evaluation = trainer.evaluate()
    step = trainer.train_step()
    if dist.get_rank() == 0:
        torch.save({"evaluation": evaluation, "step": step}, out_path)
    trainer.close()


def steps_under_device_discipline(out_path: str, overrides: list[str]) -> None:
    """Two RL steps, an evaluation and a resharder sync with host and accelerator tensors told
    apart (tests/device_discipline.py); then rank 0 checks the harness itself: a batch left in
    host memory must not reach the model, nor a host tensor a collective."""
    from device_discipline import DeviceMismatch, discipline

    from mcore_rl.resharding import Resharder, build_plan, make_rollout_layout
    from mcore_rl.resharding.execute import megatron_training_layout

    with discipline():
        trainer = Trainer(load_config(TOY_CONFIG, overrides))
        history = [trainer.train_step() for _ in range(2)]
        evaluation = trainer.evaluate()
        training = megatron_training_layout(trainer.config.model, trainer.runtime.training)
        resharder = Resharder(build_plan(training, make_rollout_layout(training, "full", 1),
                                         torch.float32))
        synced = [name for name, _ in resharder.sync(trainer.roles.actor.parameters_for_sync())]
        caught, rank = [], dist.get_rank()
        if rank == 0:  # holds the first pipeline stage
            host_ids = torch.tensor([[1, 2, 3]], device="meta")
            for attempt in (lambda: trainer.roles.actor.module(host_ids, host_ids, None),
                            lambda: dist.all_reduce(torch.zeros(2, device="meta"))):
                try:
                    attempt()
                    caught.append("no error")
                except DeviceMismatch as error:
                    caught.append(str(error))
        trainer.close()
    if rank == 0:
        torch.save({"history": history, "evaluation": evaluation, "caught": caught,
                    "synced": synced}, out_path)


def weight_sync_steps(out_path: str, overrides: list[str]) -> None:
    """Two GRPO steps through vLLM (the second after an optimizer step and a new sync), then
    vLLM's greedy responses next to the Megatron engine's on the actor itself (the trainer's
    argmax); with a reference model, an evaluation. Rank 0 saves the metrics, the chosen rank
    order, both greedy token lists and the evaluation."""
    from mcore_rl.config.rollout import PromptConfig, SamplingConfig
    from mcore_rl.rollout import MegatronEngine

    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    history = [trainer.train_step() for _ in range(2)]
    _, prompts = trainer.data.next_batch()
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=4)
    config = PromptConfig(max_prompt_tokens=trainer.config.data.max_prompt_tokens)
    vllm_greedy = trainer.scheduler.generator.generate(prompts, greedy)
    megatron_greedy = None
    parallel = trainer.config.parallel
    # EP ranks step together; Megatron's static inference refuses sequence parallelism
    if parallel.expert_model_parallel_size == 1 and not parallel.sequence_parallel:
        megatron = MegatronEngine(trainer.roles.actor.module, trainer.config.model, 16)
        megatron_greedy = [c.token_ids for c in megatron.generate(prompts, greedy,
                                                                  config).completions]
    evaluation = trainer.evaluate() if trainer.config.algorithm.needs_reference else None
    engine, held_routes = trainer.scheduler.generator.engine, None
    if engine._moe_layers:  # episodes' path: streamed, no routes to keep
        held_routes = _stream_and_count_held_routes(trainer.scheduler.generator, prompts,
                                                    greedy)
    vllm_config = engine.llm.llm_engine.vllm_config
    result = {"history": history, "rank_order": trainer.config.parallel.rank_order,
              "vllm": [c.token_ids for c in vllm_greedy.completions],
              "megatron": megatron_greedy, "evaluation": evaluation,
              "held_routes": held_routes,
              "engine": {"prefix_caching": vllm_config.cache_config.enable_prefix_caching,
                         "captures_routes": bool(engine._moe_layers),
                         "logprobs_mode": vllm_config.model_config.logprobs_mode}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        torch.save(everyone, out_path)
    trainer.close()


def _stream_and_count_held_routes(generator, prompts, sampling) -> int:
    """Generate through the engine's streaming interface (as multi-turn episodes and split
    placement do), then the number of engine steps and requests whose MoE routes the engine
    still holds."""
    from mcore_rl.rollout import SampleRequest

    seeded = dataclasses.replace(sampling, seed=1)
    engine = generator.engine
    with generator.awake():  # the trainer puts it to sleep between generations
        engine.add_requests([SampleRequest(f"stream{index}", list(prompt), seeded, index, 0)
                             for index, prompt in enumerate(prompts[:4])])
        while engine.has_unfinished():
            engine.step()
    return engine.llm.collective_rpc(_held_route_steps)[0] + len(engine._stream_routes)


def _held_route_steps(worker) -> int:
    return len(worker.mcore_rl_routes.steps)


def seed_python_loop(out_path: str, overrides: list[str], steps: int) -> None:
    """Seed 000's loop as a newcomer writes it: make_trainer_config, a Trainer with a reward_fn
    that reads the prompt, plain-text prompts to collect_data, update_policy; rank 0 saves each
    step's mean reward."""
    from mcore_rl import Trainer, make_trainer_config
    from mcore_rl.data import toy_copy_records
    from reward_functions import copies_the_prompts_digit

    config = make_trainer_config("grpo", config_file=TOY_CONFIG, overrides=overrides)
    trainer = Trainer(config, reward_fn=copies_the_prompts_digit)
    prompts = [record.prompt for record in toy_copy_records(16 * steps, seed=7)]
    rewards = []
    for step in range(steps):
        data = trainer.collect_data(prompts[16 * step:16 * (step + 1)])
        results = trainer.update_policy(data)
        rewards.append(results["reward"])
    if dist.get_rank() == 0:
        torch.save(rewards, out_path)
    trainer.close()
