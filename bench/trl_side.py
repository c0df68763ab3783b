"""TRL's side of bench/trl_grpo.py: GRPOTrainer (TRL 1.16, transformers generate, no vLLM) on
the benchmark's model, prompts and settings, timed per step and per phase.

Runs in ./.venv-trl (bench/setup_trl.sh), never in the project's ./.venv; bench/trl_grpo.py
starts it and reads the JSON it writes. Prompts are text or chat messages (TRL applies the
model's chat template to those); `--task` picks the mcore_rl reward that scores them:

    .venv-trl/bin/python bench/trl_side.py --model DIR --train FILE --val FILE --out FILE ...

Timing: a step is on_step_begin -> on_step_end of transformers' Trainer (generation, rewards,
reference log-probs, loss, backward, clipping, optimizer step); the held-out evaluation runs in
on_step_end after the step's clock stopped, and before the first step (on_train_begin), so it is
excluded like the mcore_rl side's. Phases come from wrapping GRPOTrainer's own methods:
generate (_generate: tokenize + model.generate), reward (_calculate_rewards), logprobs (the
no-grad forward passes: the reference model's), prepare_other (the rest of
_generate_and_score_completions: advantages, padding, metrics), loss_forward (compute_loss),
backward (the rest of training_step) and optimizer (the rest of the step: clipping, AdamW,
scheduler, callbacks). Memory: the process's peak resident memory at the end (`memory`:
ru_maxrss, plus its children's if it started any), measured as mcore_rl's rank is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scorer(module_file: str, function: str):
    """An mcore_rl reward loaded from its file (the package itself is not installed in this
    venv): the exact function the mcore_rl side scores with."""
    spec = importlib.util.spec_from_file_location(f"mcore_rl_reward_{function}", os.path.join(
        REPO, "mcore_rl", "rewards", module_file))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)


SCORERS = {"toy": ("toy.py", "copy_score"),
           "reasoning_gym": ("reasoning_gym_tasks.py", "reasoning_gym_score")}
"""--task -> mcore_rl's reward for it (file under mcore_rl/rewards/, function)."""


def peak_resident_mb() -> dict:
    """This process's peak resident memory (ru_maxrss, as mcore_rl logs its ranks'
    memory/peak_resident_mb) and the largest of its finished children's, in MB; `peak_mb` is
    their sum (an upper bound of what was resident at once: TRL without vLLM starts none)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    return {"self_mb": own, "children_mb": children, "peak_mb": own + children}


def _read_rows(path: str) -> list[dict]:
    """The bench's verl-format rows as the reward below takes them: ground_truth a column,
    extra_info JSON text (its nested entries vary by task, which a datasets column cannot)."""
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [{"prompt": row["prompt"], "data_source": row["data_source"],
             "ground_truth": row["reward_model"]["ground_truth"],
             "extra_info": json.dumps(row["extra_info"])} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True, help="JSONL in verl's row format")
    parser.add_argument("--val", required=True, help="JSONL in verl's row format")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--t0", type=float, required=True, help="launch time (time.time())")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--task", choices=sorted(SCORERS), default="toy",
                        help="which reward scores the rows (their data_source picks the task)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: the Trainer's bf16=True (autocast over fp32 weights)")
    parser.add_argument("--vllm", action="store_true",
                        help="generate with TRL's vLLM colocate mode (vLLM in this venv)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, \
        PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    score = _scorer(*SCORERS[args.task])
    rows, val = _read_rows(args.train), _read_rows(args.val)
    # Built once per task before training, as mcore_rl's reward does at start-up (its rule
    # reward phase), so that neither side's first step imports the task's library.
    for source in {row["data_source"] for row in rows + val}:
        getattr(score, "prepare", lambda _: None)(source)
    train = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    def reward(prompts, completions, ground_truth, data_source, extra_info, **_):
        # Chat prompts give completions as [{"role": "assistant", "content": text}].
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(source, text, truth, json.loads(info))
                for text, truth, source, info in zip(texts, ground_truth, data_source,
                                                     extra_info)]

    config = GRPOConfig(
        output_dir=os.path.join(args.work_dir, "trl_out"), use_cpu=True,
        bf16=args.precision == "bf16", fp16=False,
        use_vllm=args.vllm, vllm_mode="colocate", vllm_enable_sleep_mode=False,
        seed=args.seed, max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.n,
        gradient_accumulation_steps=1, num_generations=args.n, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0,
        top_k=0, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, beta=args.beta, epsilon=args.clip, epsilon_high=args.clip,
        loss_type="dapo", scale_rewards="group", shuffle_dataset=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0)

    phases: dict[str, float] = {}

    def timed(name, function, when=lambda: True):
        def wrapper(*a, **k):
            if not when():
                return function(*a, **k)
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=train, processing_class=tokenizer)
    for name, method, when in (
            ("generate", "_generate", None),
            ("reward", "_calculate_rewards", None),
            ("logprobs", "_get_per_token_logps_and_entropies",
             lambda: not torch.is_grad_enabled()),
            ("prepare", "_generate_and_score_completions", None),
            ("loss_forward", "compute_loss", None),
            ("training_step", "training_step", None)):
        setattr(trainer, method, timed(name, getattr(trainer, method), when or (lambda: True)))

    val_prompts = [row["prompt"] if isinstance(row["prompt"], str) else
                   tokenizer.apply_chat_template(row["prompt"], tokenize=False,
                                                 add_generation_prompt=True) for row in val]
    val_ids = tokenizer(val_prompts, return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False)
    greedy = GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    result = {"steps": [], "evals": [], "first_step_start": None, "t0": args.t0,
              "config": {name: getattr(config, name) for name in (
                  "beta", "loss_type", "scale_rewards", "epsilon", "epsilon_high",
                  "learning_rate", "num_generations", "per_device_train_batch_size",
                  "max_completion_length", "temperature", "top_k", "top_p", "max_grad_norm",
                  "num_iterations", "shuffle_dataset")},
              "threads": torch.get_num_threads()}

    def evaluate(step: int) -> None:
        model = trainer.model
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**val_ids, generation_config=greedy)
        completions = out[:, val_ids["input_ids"].shape[1]:]
        texts = []
        for row in completions.tolist():
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id) + 1]
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
        scores = [score(r["data_source"], text, r["ground_truth"], json.loads(r["extra_info"]))
                  for text, r in zip(texts, val)]
        model.train(was_training)
        result["evals"].append({"step": step, "accuracy": sum(s >= 1.0 for s in scores) /
                                len(scores), "reward_mean": sum(scores) / len(scores),
                                "seconds": time.perf_counter() - start, "wall": time.time()})
        print(f"trl eval {step}: accuracy {result['evals'][-1]['accuracy']:.4g}", flush=True)

    class Bench(TrainerCallback):
        def on_train_begin(self, *_, **__):
            if args.eval_every:
                evaluate(0)

        def on_step_begin(self, *_, **__):
            if result["first_step_start"] is None:
                result["first_step_start"] = time.time()
            phases.clear()
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            seconds = time.perf_counter() - self.start
            step = dict(phases)
            step["backward"] = step["training_step"] - step["prepare"] - step["loss_forward"]
            step["optimizer"] = seconds - step.pop("training_step")
            step["prepare_other"] = step["prepare"] - sum(
                step.get(name, 0.0) for name in ("generate", "reward", "logprobs"))
            step.pop("prepare")
            result["steps"].append({"step": state.global_step, "seconds": seconds,
                                    "phases": step, "wall": time.time()})
            if args.eval_every and (state.global_step % args.eval_every == 0
                                    or state.global_step == args.steps):
                evaluate(state.global_step)

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and result["steps"] and "completions/mean_length" in logs:
                result["steps"][-1].update(
                    {"completion_mean_length": logs["completions/mean_length"],
                     "reward": logs.get("reward"), "kl": logs.get("kl"),
                     "entropy": logs.get("entropy")})

    trainer.add_callback(Bench())
    trainer.remove_callback(PrinterCallback)  # its per-step log dicts would flood the output
    trainer.train()
    result["finished"] = time.time()
    result["memory"] = peak_resident_mb()
    with open(args.out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
