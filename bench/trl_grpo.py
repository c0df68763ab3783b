"""Benchmark: mcore_rl's GRPO vs TRL's GRPOTrainer on the same tiny HF model, task and settings.

    bash bench/setup_trl.sh                       # once: TRL 1.16 in ./.venv-trl
    OMP_NUM_THREADS=1 .venv/bin/python bench/trl_grpo.py [--rounds 2]

One random-init LlamaForCausalLM (seeded; 8 layers, hidden 256, 4 heads of 64, SwiGLU 1024, the
toy task's 16-word tokenizer: 8.4M parameters, the size TRL was measured at in the issue) is
written once as an HF folder; both trainers start from it. Task: the toy copy task ("copy 7" ->
"7"), the same 512 training prompts in the same order (no shuffling) and 64 held-out ones,
scored by the same function (mcore_rl.rewards.toy.copy_score; accuracy = score 1).

`--model smollm2` runs the real-model regime instead: SmolLM2-135M-Instruct (the packaged GGUF
file converted once to runs/models/smollm2-135m-instruct) on reasoning-gym's basic_arithmetic as
scripts/smollm2_recipe.sh sets it up (2 terms, 1-2 digits, + and -; chat prompts with SmolLM2's
template), both sides scoring with mcore_rl.rewards.reasoning_gym_tasks.reasoning_gym_score:

  * smollm2: 2 prompts x 8 samples, <= 128 new tokens, lr 0 (equal work per step, as `speed`).
  * smollm2-learn: the recipe's GRPO stage (8 prompts x 8 samples, <= 16 new tokens, lr 1e-5)
    from its SFT warm-up (run once per benchmark, on 2 ranks, and converted to HF for both
    sides), held-out accuracy every --eval-every steps, as `learn`.

Each round runs, one process at a time, alternating which side goes first:

  * learn: both sides train `--learn-steps` steps in the shape of configs/grpo_toy.yaml (16
    prompts x 8 samples, <= 4 new tokens, lr 1e-3, KL loss 0.001) with greedy held-out accuracy
    every `--eval-every` steps. Reported: median step time, generated tokens per second of step
    time, the time to reach `--threshold` held-out accuracy (training seconds, and wall seconds
    from launch including start-up and evaluations) and the last accuracy.
  * speed: the issue's shape (2 prompts x 8 samples = 16 completions, <= 64 new tokens) with
    lr 0, so both sides sample from the same fixed policy and do equal work per step (with a
    learning rate the response lengths follow each run's own trajectory). No evaluation.
    Reported: median step time, generated tokens/s and a per-phase profile.

Same on both sides: model and weights, prompts and their order, n, temperature 1 (no top-k/p),
max new tokens, GRPO advantages (group mean, divided by the group std), PPO-clip 0.2 both ways,
one optimizer step per batch (no mini-batches, one epoch), token-mean loss over the batch (TRL's
"dapo"), KL to the reference as a k3 loss term with coefficient --beta, AdamW (0.9, 0.999, 1e-8,
no weight decay), constant LR, gradient clipping at 1.0, fp32 (bf16 on both with --precision
bf16: each framework's own mixed precision), held-out evaluation as greedy generation and
scoring only (mcore_rl's trainer.eval_kl_to_reference is off: TRL has no such metric).
Different by design: TRL generates with transformers' generate on the training model
(use_vllm=False) and, with one iteration per batch, takes the old log-probs as the detached
current ones; mcore_rl generates with vLLM (weights pushed every step), recomputes the old
log-probs in a separate forward pass, scores in a sandboxed worker process, and runs the update
through Megatron-Core's schedule and distributed optimizer. mcore_rl runs on --ours-ranks ranks
of 1 thread each (data parallel), TRL in one process of --trl-threads threads.

The engine's stop-token bug this benchmark found (vLLM also stopped at token id 2, which
shortened our responses and flattered our step time) is fixed in mcore_rl.rollout.vllm_start.write_config_folder.

Step time, mcore_rl: `time/step` in metrics.jsonl (generate .. optimizer step, logging and
evaluation excluded); TRL: on_step_begin -> on_step_end of its Trainer (same span). Ratios are
TRL / mcore_rl: above 1 means mcore_rl is faster. Load averages are recorded around each run: the
machine may be shared, which is why the sides alternate, and why the summary also gives the
median over all steps of all rounds, the per-run 25th percentile (the least disturbed steps) and
each run's CPU seconds (user + system of the whole process tree, start-up included), which
other jobs' load barely changes. `--report results.json` prints the tables again.

Peak memory (`peak MB`): the largest peak resident set (ru_maxrss) of mcore_rl's ranks
(`memory/peak_resident_mb` in metrics.jsonl), and TRL's process's own (plus its children's
if it starts any; trl_side.py), each over its whole run (docs/training.md, "Memory on the TRL
bench", accounts for ours).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from mcore_rl.runtime.files import write_text_atomically  # noqa: E402

TRL_PYTHON = os.path.join(REPO, ".venv-trl", "bin", "python")
OURS_PYTHON = os.path.join(REPO, ".venv", "bin", "python")

TRL_SIDES = {"trl": [], "trl-vllm": ["--vllm"]}
"""TRL sides: a name and trl_side.py's extra arguments (trl-vllm: TRL's vLLM colocate mode,
which needs vLLM in ./.venv-trl: bench/setup_trl.sh --vllm)."""

TOKEN_BUDGET = 1024
"""actor.max_tokens_per_micro_batch of the token-budget variants: a few rows per micro-batch of
SmolLM2's 16 x <= 256 tokens, each micro-batch cut to its own longest row."""

VARIANTS = {
    "ours": {},
    "ours-before": {"rollout": {"old_logprobs": "trainer"},
                    "actor": {"max_tokens_per_micro_batch": 0, "micro_batch_size": 16}},
    "ours-trainer-logp": {"rollout": {"old_logprobs": "trainer"}},
    "ours-engine-logp": {"rollout": {"old_logprobs": "engine"}},
    "ours-token-budget": {"actor": {"max_tokens_per_micro_batch": TOKEN_BUDGET}},
    "ours-one-row-budget": {"actor": {"micro_batch_size": 1}},
    "ours-best": {"rollout": {"old_logprobs": "engine"},
                  "actor": {"max_tokens_per_micro_batch": TOKEN_BUDGET}},
    "ours-best-megatron-engine": {"rollout": {"old_logprobs": "engine", "engine": "megatron"},
                                  "actor": {"max_tokens_per_micro_batch": TOKEN_BUDGET}},
    "ours-lora8": {"actor": {"lora": {"enabled": True, "rank": 8, "alpha": 16}}},
    "ours-lora16": {"actor": {"lora": {"enabled": True, "rank": 16, "alpha": 32}}},
    "ours-best-lora16": {"rollout": {"old_logprobs": "engine"},
                         "actor": {"max_tokens_per_micro_batch": TOKEN_BUDGET,
                                   "lora": {"enabled": True, "rank": 16, "alpha": 32}}},
}
"""mcore_rl sides: a name and the config sections it changes (`--sides ours,ours-engine-logp`
measures one change alone, before/after in one run; `ours` runs the package's defaults (old
log-probs from the update's forward pass, token-budget micro-batches derived from the length
limits); ours-before the defaults before issue 64 (a separate old-log-prob pass, one
micro-batch of all 16 rows of the smollm2 regime at 1 rank); ours-best is every change together;
ours-best-megatron-engine generates with the trainer's own model instead of vLLM;
ours-one-row-budget halves the default token budget (one longest sequence: less activation
memory, more micro-batches); the lora
sides train adapters of that rank on every linear (actor.lora, alpha = 2 x rank), with
--lora-lr as their learning rate where the regime trains)."""

REGIMES = {
    "learn": {"prompts_per_step": 16, "n": 8, "max_new_tokens": 4, "learns": True},
    "speed": {"prompts_per_step": 2, "n": 8, "max_new_tokens": 64, "lr": 0.0},
    "smollm2": {"prompts_per_step": 2, "n": 8, "max_new_tokens": 128, "lr": 0.0},
    "smollm2-learn": {"prompts_per_step": 8, "n": 8, "max_new_tokens": 16, "lr": 1e-5,
                      "learns": True, "model_dir": "sft_model"},
}
"""Step shapes. `learns`: --learn-steps steps with held-out accuracy every --eval-every steps
(else --speed-steps, no evaluation); `model_dir`: the model folder under --work-dir (default
"model"). The smollm2 regimes run on SmolLM2-135M-Instruct and reasoning-gym prompts (--model
smollm2), smollm2-learn from scripts/smollm2_recipe.sh's SFT warm-up; the others on the toy
Llama and the copy task."""

MODEL_REGIMES = {"toy": ["learn", "speed"], "smollm2": ["smollm2", "smollm2-learn"]}
MODEL_NAMES = {"toy": "Llama", "smollm2": "SmolLM2-135M-Instruct"}

SMOLLM2_FOLDER = os.path.join(REPO, "runs", "models", "smollm2-135m-instruct")
SMOLLM2_TASK = {"basic_arithmetic": {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
    "allow_parentheses": False, "allow_negation": False}}
SMOLLM2_SYSTEM = "Compute the result. Answer with just the number, no words."
"""The task of scripts/smollm2_recipe.sh (docs/smollm2_example.md)."""


# -- inputs shared by both sides -----------------------------------------------------------------
def write_model(folder: str, args) -> int:
    """The seeded random-init HF Llama with the toy tokenizer; returns its parameter count."""
    import torch
    import transformers

    from mcore_rl.data import write_toy_tokenizer
    from mcore_rl.data.toy import TOY_VOCAB_SIZE

    write_toy_tokenizer(folder)
    config = transformers.LlamaConfig(
        vocab_size=TOY_VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64, head_dim=64, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
        pad_token_id=0)
    torch.manual_seed(args.model_seed)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.bos_token_id = None
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def link_smollm2(folder: str) -> int:
    """The converted SmolLM2-135M-Instruct HF folder (made once from the packaged GGUF file, as
    docs/smollm2_example.md does), linked at `folder`; returns its parameter count."""
    import safetensors

    if not os.path.isdir(SMOLLM2_FOLDER):
        from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, smollm2_gguf_path

        gguf_to_hf(smollm2_gguf_path(), SMOLLM2_FOLDER)
    os.symlink(SMOLLM2_FOLDER, folder)
    count = 0
    for name in [n for n in os.listdir(folder) if n.endswith(".safetensors")]:
        with safetensors.safe_open(os.path.join(folder, name), "numpy") as tensors:
            count += sum(math.prod(tensors.get_slice(key).get_shape()) for key in tensors.keys())
    return count


def write_sft_model(folder: str, args) -> None:
    """SmolLM2 after scripts/smollm2_recipe.sh's SFT warm-up (its stages 1-2, on 2 ranks),
    converted to an HF folder at `folder` for both sides."""
    recipe_dir = args.recipe_dir or os.path.join(args.work_dir, "recipe")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=OURS_PYTHON, SMOLLM2_DIR=recipe_dir,
               MASTER_PORT=str(_free_port()))
    _run(["bash", os.path.join(REPO, "scripts", "smollm2_recipe.sh"), "--sft-only"], env,
         recipe_dir + ".log")
    _run([OURS_PYTHON, "-m", "mcore_rl", "convert", "mcore-to-hf", "--ckpt",
          os.path.join(recipe_dir, "sft", "model"), "--out", folder], env, folder + ".log")


def write_prompts(work_dir: str, args) -> None:
    """train.jsonl / val.jsonl in verl's row format (prompt, data_source, reward_model.
    ground_truth, extra_info): exactly the records mcore_rl's data source makes (data.toy, or
    data.reasoning_gym with --model smollm2), in the same order. TRL reads them; so does
    mcore_rl with --model smollm2 (data.train_files), so that neither side's start-up
    generates the tasks."""
    from mcore_rl.config.data import VAL_SEED_OFFSET

    if args.model == "smollm2":
        from mcore_rl.config.data import ReasoningGymConfig
        from mcore_rl.data.reasoning_gym_source import reasoning_gym_records

        gym = ReasoningGymConfig(tasks=list(SMOLLM2_TASK), task_kwargs=SMOLLM2_TASK,
                                 system_prompt=SMOLLM2_SYSTEM)
        make = lambda size, seed: reasoning_gym_records(gym, size, seed)  # noqa: E731
    else:
        from mcore_rl.data.toy import toy_copy_records as make
    for name, records in (("train", make(args.train_size, args.data_seed)),
                          ("val", make(args.val_size, args.data_seed + VAL_SEED_OFFSET))):
        with open(os.path.join(work_dir, f"{name}.jsonl"), "w") as handle:
            for record in records:
                handle.write(json.dumps({"prompt": record.prompt,
                                         "data_source": record.data_source,
                                         "reward_model": {"ground_truth": record.ground_truth},
                                         "extra_info": record.extra_info}) + "\n")


def data_section(args) -> dict:
    """mcore_rl's data config for the prompts write_prompts gives TRL."""
    if args.model == "smollm2":
        return {"max_prompt_tokens": 128, "shuffle": False, "apply_chat_template": "auto",
                "train_files": [os.path.join(args.work_dir, "train.jsonl")],
                "val_files": [os.path.join(args.work_dir, "val.jsonl")]}
    return {"max_prompt_tokens": 8, "shuffle": False,
            "toy": {"size": args.train_size, "val_size": args.val_size, "seed": args.data_seed}}


def settings(regime: str, args) -> dict:
    shape = dict(REGIMES[regime])
    shape.setdefault("lr", args.lr)
    learns = shape.pop("learns", False)
    shape["steps"] = args.learn_steps if learns else args.speed_steps
    shape["eval_every"] = args.eval_every if learns else 0
    shape["model"] = os.path.join(args.work_dir, shape.pop("model_dir", "model"))
    return shape


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the two sides -----------------------------------------------------------------------------
def run_ours(regime: str, seed: int, out_dir: str, args, variant: str = "ours") -> dict:
    s = settings(regime, args)
    rows_per_rank = s["prompts_per_step"] // args.ours_ranks * s["n"]
    config = {
        "init": {"hf_path": s["model"]},
        "data": data_section(args),
        "algorithm": {"estimator": "grpo", "norm_adv_by_std_in_grpo": True,
                      "policy_loss": "ppo", "clip_ratio_low": args.clip,
                      "clip_ratio_high": args.clip, "loss_aggregation": "token-mean",
                      "use_kl_loss": args.beta > 0, "kl_coef": args.beta,
                      "kl_estimator": "k3"},
        "actor": {"optimizer": {"lr": s["lr"], "lr_decay_style": "constant",
                                "weight_decay": 0.0, "clip_grad": 1.0}},
        "rollout": {"engine": "vllm", "prompts_per_step": s["prompts_per_step"],
                    "sampling": {"n": s["n"], "temperature": 1.0,
                                 "max_new_tokens": s["max_new_tokens"]},
                    "eval_sampling": {"n": 1, "temperature": 0.0,
                                      "max_new_tokens": s["max_new_tokens"]}},
        "reward": {"num_workers": 1, "timeout_seconds": 30},
        "trainer": {"total_steps": s["steps"], "eval_every": s["eval_every"],
                    "eval_kl_to_reference": False, "ppo_epochs": 1, "mini_batches": 1,
                    "tensorboard": False, "plots": False},
        "runtime": {"output_dir": out_dir, "seed": seed, "precision": args.precision},
    }
    if args.model == "toy":
        # The toy rows are 12 tokens: the default budget (2 rows of the longest sequence) would
        # time Python per micro-batch, not the update. SmolLM2 runs the defaults.
        config["actor"]["micro_batch_size"] = rows_per_rank
    for section, values in VARIANTS[variant].items():
        config[section].update(values)
    if "lora" in config["actor"] and s["lr"]:
        config["actor"]["optimizer"]["lr"] = args.lora_lr
    config_path = out_dir + ".yaml"
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=1)  # JSON is YAML
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=OURS_PYTHON,
               NPROC_PER_NODE=str(args.ours_ranks), MASTER_PORT=str(_free_port()))
    command = [os.path.join(REPO, "scripts", "torchrun.sh"), "train", "--config", config_path]
    t0 = time.time()
    cpu = _run(command, env, out_dir + ".log")
    wall = time.time() - t0
    steps = _read_jsonl(os.path.join(out_dir, "metrics.jsonl"))
    evals = _read_jsonl(os.path.join(out_dir, "eval.jsonl"))
    result = {"wall": wall, "cpu": cpu,
              "startup": steps[0]["wall_time"] - steps[0]["time/step"] - t0,
              "peak_mb": max(step.get("memory/peak_resident_mb", 0.0) for step in steps),
              "steps": [], "evals": []}
    for step in steps:
        phases = {name[5:]: value for name, value in step.items()
                  if name.startswith("time/") and name != "time/step"}
        rows = s["prompts_per_step"] * s["n"]
        result["steps"].append({"step": step["step"], "seconds": step["time/step"],
                                "tokens": step["response/length_mean"] * rows,
                                "phases": phases})
    logged = {step["step"]: step["wall_time"] for step in steps}
    for record in evals:  # an evaluation follows the step's log line (none before step 0's)
        seconds = record["wall_time"] - logged[record["step"]] if record["step"] else None
        result["evals"].append({"step": record["step"], "accuracy": record["eval/accuracy"],
                                "wall": record["wall_time"] - t0, "seconds": seconds})
    return result


def run_trl(regime: str, seed: int, out_dir: str, args, side: str = "trl") -> dict:
    s = settings(regime, args)
    out_json = out_dir + ".json"
    t0 = time.time()
    command = [TRL_PYTHON, os.path.join(REPO, "bench", "trl_side.py"),
               "--model", s["model"],
               "--train", os.path.join(args.work_dir, "train.jsonl"),
               "--val", os.path.join(args.work_dir, "val.jsonl"), "--out", out_json,
               "--work-dir", out_dir, "--t0", repr(t0), "--steps", str(s["steps"]),
               "--eval-every", str(s["eval_every"]),
               "--prompts-per-step", str(s["prompts_per_step"]), "--n", str(s["n"]),
               "--max-new-tokens", str(s["max_new_tokens"]), "--lr", repr(s["lr"]),
               "--beta", repr(args.beta), "--clip", repr(args.clip), "--seed", str(seed),
               "--threads", str(args.trl_threads),
               "--task", "reasoning_gym" if args.model == "smollm2" else "toy",
               "--precision", args.precision, *TRL_SIDES[side]]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.trl_threads))
    cpu = _run(command, env, out_dir + ".log")
    wall = time.time() - t0
    with open(out_json) as handle:
        raw = json.load(handle)
    rows = s["prompts_per_step"] * s["n"]
    result = {"wall": wall, "cpu": cpu, "startup": raw["first_step_start"] - t0, "steps": [],
              "evals": [], "peak_mb": raw.get("memory", {}).get("peak_mb")}
    for step in raw["steps"]:
        result["steps"].append({"step": step["step"], "seconds": step["seconds"],
                                "tokens": step["completion_mean_length"] * rows,
                                "phases": step["phases"]})
    for record in raw["evals"]:
        result["evals"].append({"step": record["step"], "accuracy": record["accuracy"],
                                "wall": record["wall"] - t0, "seconds": record["seconds"]})
    return result


def _run(command: list, env: dict, log_path: str) -> float:
    """Run `command`; returns the CPU seconds (user + system) it and its descendants used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "w") as log:
        status = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=REPO).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if status:
        raise SystemExit(f"{' '.join(command[:3])} ... failed with status {status}; see "
                         f"{log_path}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


# -- summaries ---------------------------------------------------------------------------------
def summarize(result: dict, threshold: float) -> dict:
    steps = result["steps"]
    timed = steps[1:] or steps  # the first step of either side includes lazy initialisation
    seconds = sorted(s["seconds"] for s in steps)
    summary = {"step_median": statistics.median(seconds),
               "step_p25": seconds[(len(seconds) - 1) // 4],
               "cpu": result.get("cpu"),
               "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed),
               "tokens_per_step": statistics.mean(s["tokens"] for s in steps),
               "startup": result["startup"], "wall": result["wall"],
               "peak_mb": result.get("peak_mb")}
    reached = next((e for e in result["evals"] if e["accuracy"] >= threshold), None)
    if result["evals"]:
        timed_evals = [e["seconds"] for e in result["evals"] if e.get("seconds") is not None
                       and e["step"]]
        summary["eval_s"] = statistics.mean(timed_evals) if timed_evals else None
        summary["final_accuracy"] = result["evals"][-1]["accuracy"]
        summary["best_accuracy"] = max(e["accuracy"] for e in result["evals"])
    if reached is not None:
        summary["reached_step"] = reached["step"]
        summary["train_to_acc"] = sum(s["seconds"] for s in steps if s["step"] <= reached["step"])
        summary["wall_to_acc"] = reached["wall"]
    return summary


def cpu_description() -> str:
    """The CPU's model and vector extensions: vLLM's CPU kernels and torch's matmuls run at
    different speeds on different ones, so ratios from two machines are not comparable."""
    model, flags = "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    extensions = sorted(flag for flag in flags if flag.startswith(("avx512", "amx")) or
                        flag in ("avx2", "fma"))
    return f"{model} ({' '.join(extensions) or 'no AVX2/AVX-512/AMX flags'})"


def _fmt(value, digits=2, suffix="") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def print_tables(records: list, args, parameters: int) -> None:
    names = {"trl": "TRL 1.16", "trl-vllm": "TRL+vLLM", "ours": "mcore_rl"}
    for regime in [r for r in REGIMES if any(x["regime"] == r for x in records)]:
        s = settings(regime, args)
        print(f"\n== {regime}: {s['prompts_per_step']} prompts x {s['n']} samples, <= "
              f"{s['max_new_tokens']} new tokens, lr {s['lr']:g}, KL loss {args.beta:g}, "
              f"{s['steps']} steps, {args.precision}; "
              f"{parameters / 1e6:.1f}M-param {MODEL_NAMES[args.model]}; "
              f"mcore_rl {args.ours_ranks} rank(s) x 1 thread, TRL 1 process x {args.trl_threads} "
              f"thread(s); {cpu_description()}")
        rows = [x for x in records if x["regime"] == regime]
        width = max(10, *(len(names.get(x["side"], x["side"])) + 2 for x in rows))
        header = (f"{'round':<6}{'side':<{width}}{'step s':>8}{'p25 s':>7}{'gen tok/s':>10}"
                  f"{'tok/step':>9}{'startup s':>10}")
        if s["eval_every"]:
            header += (f"{'acc>=' + format(args.threshold, 'g') + ' @step':>15}"
                       f"{'train s':>9}{'wall s':>8}{'last acc':>9}{'eval s':>8}")
        header += f"{'run s':>7}{'CPU s':>7}{'peak MB':>8}{'load before/after':>19}"
        print(header)
        sides = [side for side in (*TRL_SIDES, *VARIANTS) if any(x["side"] == side for x in rows)]
        for record in rows:
            summary = record["summary"]
            line = (f"{record['round']:<6}{names.get(record['side'], record['side']):<{width}}"
                    f"{summary['step_median']:>8.3f}{summary['step_p25']:>7.3f}"
                    f"{summary['tokens_per_s']:>10.1f}"
                    f"{summary['tokens_per_step']:>9.1f}{summary['startup']:>10.1f}")
            if s["eval_every"]:
                line += (f"{_fmt(summary.get('reached_step'), 0):>15}"
                         f"{_fmt(summary.get('train_to_acc'), 1):>9}"
                         f"{_fmt(summary.get('wall_to_acc'), 1):>8}"
                         f"{_fmt(summary.get('final_accuracy'), 3):>9}"
                         f"{_fmt(summary.get('eval_s'), 2):>8}")
            line += (f"{summary['wall']:>7.0f}{_fmt(summary.get('cpu'), 0):>7}"
                     f"{_fmt(summary.get('peak_mb'), 0):>8}"
                     f"{record['load'][0]:>10.2f}/{record['load'][1]:.2f}")
            print(line)
        by_side = {side: [x["summary"] for x in rows if x["side"] == side] for side in sides}

        def median(side, key):
            values = [x[key] for x in by_side[side] if x.get(key) is not None]
            return statistics.median(values) if len(values) == len(by_side[side]) else None

        def ratio(baseline, side, key, invert=False):
            a, b = median(baseline, key), median(side, key)
            if a is None or b is None or not a or not b:
                return "-"
            return f"{(b / a if invert else a / b):.2f}x"

        phase_rows = {side: _median_phases([x for x in rows if x["side"] == side])
                      for side in sides}
        ours_sides = [side for side in sides if side in VARIANTS]
        pairs = [(trl, ours) for trl in TRL_SIDES if trl in sides for ours in ours_sides] + [
            ("ours", side) for side in ours_sides if side != "ours" and "ours" in sides]
        for baseline, side in pairs:
            pooled = phase_rows[baseline]["step"] / phase_rows[side]["step"]
            print(f"{names.get(baseline, baseline)} / {names.get(side, side)} (> 1: "
                  f"{names.get(side, side)} faster): step time {pooled:.2f}x (median of all steps "
                  f"2..N of all rounds; per-round medians "
                  f"{ratio(baseline, side, 'step_median')}, per-round p25 "
                  f"{ratio(baseline, side, 'step_p25')}); medians over rounds: generated "
                  f"tokens/s {ratio(baseline, side, 'tokens_per_s', True)}, start-up "
                  f"{ratio(baseline, side, 'startup')}, run CPU seconds "
                  f"{ratio(baseline, side, 'cpu')}, peak resident MB "
                  f"{_fmt(median(baseline, 'peak_mb'), 0)} / {_fmt(median(side, 'peak_mb'), 0)}"
                  + (
                      f", train time to acc {ratio(baseline, side, 'train_to_acc')}, wall time "
                      f"to acc {ratio(baseline, side, 'wall_to_acc')}, one evaluation "
                      f"{ratio(baseline, side, 'eval_s')}" if s["eval_every"] else ""))
        print("median seconds per step by phase (steps 2..N of all rounds; medians resist "
              "other jobs' load, so the phases need not add up to the step):")
        for side in sides:
            phases = phase_rows[side]
            shown = "  ".join(f"{name} {value:.3f}" for name, value in sorted(
                phases.items(), key=lambda item: -item[1]) if name != "step")
            print(f"  {names.get(side, side):<9} step {phases['step']:.3f} = {shown}")


def _median_phases(records: list) -> dict:
    steps = [step for record in records for step in (record["result"]["steps"][1:]
                                                     or record["result"]["steps"])]
    names = {name for step in steps for name in step["phases"]}
    phases = {name: statistics.median(s["phases"].get(name, 0.0) for s in steps)
              for name in names}
    phases["step"] = statistics.median(s["seconds"] for s in steps)
    return phases


def save_results(records: list, args, parameters: int) -> None:
    """results.json after every run, so the runs that finished survive an interrupted bench
    (`--report` prints their tables)."""
    write_text_atomically(os.path.join(args.work_dir, "results.json"), json.dumps(
        {"args": vars(args), "parameters": parameters, "records": records}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODEL_REGIMES), default="toy",
                        help="toy: the seeded 8.4M Llama on the copy task; smollm2: "
                        "SmolLM2-135M-Instruct on reasoning-gym arithmetic")
    parser.add_argument("--regimes", help="comma list (default: all of the model's): "
                        "learn, speed (toy); smollm2 (smollm2)")
    parser.add_argument("--sides", default="trl,ours",
                        help="comma list of TRL_SIDES' and VARIANTS' names (trl, trl-vllm, ours, "
                        "ours-engine-logp)")
    parser.add_argument("--learn-steps", type=int, default=20)
    parser.add_argument("--speed-steps", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--threshold", type=float, default=0.4,
                        help="held-out greedy accuracy both sides must reach")
    parser.add_argument("--lr", type=float, default=1e-3, help="learn regime's learning rate")
    parser.add_argument("--beta", type=float, default=0.001, help="KL loss coefficient (k3)")
    parser.add_argument("--lora-lr", type=float, default=1e-4,
                        help="learning rate of the lora sides where the regime trains")
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--val-size", type=int, default=64)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1, help="sampling seed of round 1 (+1 per "
                        "round, the same on both sides)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="both sides: bf16 is TRL's bf16=True (autocast over fp32 weights) "
                             "and mcore_rl's runtime.precision=bf16 (bf16 weights, fp32 master "
                             "weights, vLLM in bf16)")
    parser.add_argument("--ours-ranks", type=int, default=1)
    parser.add_argument("--trl-threads", type=int, default=1)
    parser.add_argument("--work-dir", default="/tmp/trl_work/bench")
    parser.add_argument("--recipe-dir", help="smollm2-learn: the scripts/smollm2_recipe.sh folder "
                        "(SMOLLM2_DIR) whose SFT warm-up is reused, or made there when missing "
                        "(default: a new one under --work-dir)")
    parser.add_argument("--report", metavar="RESULTS_JSON",
                        help="only print the tables of an earlier run's results.json")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as handle:
            saved = json.load(handle)
        saved["args"].setdefault("model", "toy")  # results from before --model
        saved["args"].setdefault("precision", "fp32")  # results from before --precision
        for record in saved["records"]:
            record["summary"] = summarize(record["result"], saved["args"]["threshold"])
        print_tables(saved["records"], argparse.Namespace(**saved["args"]), saved["parameters"])
        return
    sides = args.sides.split(",")
    regimes = args.regimes.split(",") if args.regimes else MODEL_REGIMES[args.model]
    foreign = [regime for regime in regimes if regime not in MODEL_REGIMES[args.model]]
    if foreign:
        raise SystemExit(f"--regimes {foreign} do not run on --model {args.model}; its regimes: "
                         f"{', '.join(MODEL_REGIMES[args.model])}")
    unknown = [side for side in sides if side not in TRL_SIDES and side not in VARIANTS]
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; known: "
                         f"{', '.join([*TRL_SIDES, *VARIANTS])}")
    if any(side in TRL_SIDES for side in sides) and not os.path.exists(TRL_PYTHON):
        raise SystemExit(f"{TRL_PYTHON} not found: run bash bench/setup_trl.sh first")

    if os.path.isdir(args.work_dir):
        shutil.rmtree(args.work_dir)
    os.makedirs(args.work_dir)
    model_folder = os.path.join(args.work_dir, "model")
    parameters = (link_smollm2(model_folder) if args.model == "smollm2" else
                  write_model(model_folder, args))
    write_prompts(args.work_dir, args)
    if "smollm2-learn" in regimes:
        write_sft_model(os.path.join(args.work_dir, REGIMES["smollm2-learn"]["model_dir"]), args)
    records = []
    started = time.time()
    for round_index in range(args.rounds):
        order = sides if round_index % 2 == 0 else sides[::-1]
        for regime in regimes:
            for side in order:
                name = f"r{round_index + 1}_{regime}_{side}"
                load_before = os.getloadavg()[0]
                out_dir = os.path.join(args.work_dir, name)
                if side in TRL_SIDES:
                    result = run_trl(regime, args.seed + round_index, out_dir, args, side)
                else:
                    result = run_ours(regime, args.seed + round_index, out_dir, args, side)
                record = {"round": round_index + 1, "regime": regime, "side": side,
                          "load": (load_before, os.getloadavg()[0]), "result": result,
                          "summary": summarize(result, args.threshold)}
                records.append(record)
                save_results(records, args, parameters)
                print(f"{name}: step {record['summary']['step_median']:.3f} s, wall "
                      f"{result['wall']:.0f} s, load {record['load'][0]:.2f}/"
                      f"{record['load'][1]:.2f}", flush=True)
    print_tables(records, args, parameters)
    print(f"\ntotal {time.time() - started:.0f} s; load averages (1/5/15 min) now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; raw results in "
          f"{args.work_dir}/results.json")


if __name__ == "__main__":
    main()
