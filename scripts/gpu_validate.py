"""One stage of the GPU validation (scripts/gpu_validate.sh runs each in a fresh process).

    python scripts/gpu_validate.py --stage parity --out results.jsonl [--cpu] [--tiny]

Every rank runs the stage (SPMD, under torchrun for --gpus N); rank 0 appends one JSON line to
--out: {"stage", "ok", "seconds", "failed": [broken checks], figures...}. A stage that raises is
recorded as failed with its error. --cpu lets the stages run without CUDA (fp32, gloo), --tiny
shrinks every model so that the whole validation runs in a few CPU minutes: that is how CI
keeps this script working; the figures only mean something on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0,
                    "L40S": 362.0}
"""Dense bf16 peak (TFLOP/s) by GPU name fragment, first match wins (spec sheets)."""

PERF_MODEL = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=5632,
                  num_attention_heads=16, num_kv_heads=4, vocab_size=32000,
                  max_position_embeddings=2048)
"""About 0.8B parameters, Llama-shaped with GQA."""
TINY_MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_kv_heads=2, vocab_size=512, max_position_embeddings=128)


class Checks:
    """Named conditions of a stage; the failed ones are reported."""

    def __init__(self):
        self.failed: list[str] = []

    def __call__(self, condition: bool, description: str) -> None:
        if not condition:
            self.failed.append(description)


# -- stages ------------------------------------------------------------------------------------

def preflight(args, check: Checks) -> dict:
    """What this machine has: torch, CUDA, the GPU, and which optional kernels import."""
    import importlib.util

    figures = {"python": sys.version.split()[0], "torch": torch.__version__,
               "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        figures.update(gpu=properties.name, gpus=torch.cuda.device_count(),
                       memory_gib=round(properties.total_memory / 2 ** 30, 1),
                       capability=f"{properties.major}.{properties.minor}",
                       bf16=torch.cuda.is_bf16_supported())
    check(torch.cuda.is_available() or args.cpu, "CUDA is available")
    for module in ("megatron.core", "transformers", "omegaconf"):
        try:
            __import__(module)
            figures[f"import {module}"] = True
        except ImportError as error:
            figures[f"import {module}"] = False
            check(False, f"{module} imports ({error})")
    if figures["import megatron.core"]:
        from megatron.core.package_info import __version__ as megatron_core_version

        figures["megatron_core"] = megatron_core_version
    from mcore_rl.models.kernels import fused_rope_available, fused_softmax_available

    for module in ("transformer_engine", "apex", "vllm", "flash_attn"):
        figures[f"import {module}"] = importlib.util.find_spec(module) is not None
    figures["fused softmax"] = fused_softmax_available()
    figures["fused rope"] = fused_rope_available()
    return figures


def smoke(args, check: Checks) -> dict:
    """`mcore-rl smoke` on random tokens at the machine's default precision: the first loss
    of a freshly initialised model is about ln(vocab)."""
    from mcore_rl.config import load_config
    from mcore_rl.smoke import run_smoke

    overrides = [f"runtime.output_dir={args.workdir}/smoke", "smoke.steps=3",
                 f"parallel.tensor_model_parallel_size={_world()}",
                 "parallel.pipeline_model_parallel_size=1", f"batch.global_batch_size={8}",
                 "batch.micro_batch_size=2"]
    config = load_config(os.path.join(REPO, "configs", "smoke.yaml"), overrides)
    history = run_smoke(config)
    expected = math.log(config.model.vocab_size)
    losses = [step["loss"] for step in history]
    check(all(math.isfinite(loss) for loss in losses), "losses are finite")
    check(abs(losses[0] - expected) < 0.05 * expected,
          f"first loss {losses[0]:.3f} within 5% of ln(vocab) = {expected:.3f}")
    return {"precision": config.runtime.resolved().precision, "losses": [round(x, 4) for x in losses],
            "ln_vocab": round(expected, 4), "tokens_per_second": round(history[-1][
                "tokens_per_second"])}


def performance(args, check: Checks) -> dict:
    """Training throughput of a ~0.8B Llama (bf16 on GPUs, distributed optimizer): tokens/s,
    achieved TFLOP/s, MFU against the GPU's dense bf16 peak, peak memory."""
    from mcore_rl.smoke import next_token_loss, random_batch
    from mcore_rl.training import train_step

    sequence = args.sequence or (128 if args.tiny else 2048)
    model = TINY_MODEL if args.tiny else PERF_MODEL
    model = dict(model, max_position_embeddings=max(sequence, model["max_position_embeddings"]))
    config = _job(args, model, sequence, global_batch=8,
                  micro_batch=1, distributed_optimizer=True)
    trainable = _trainable(config)
    timings = []
    for step in range(5):
        batch = random_batch(config, step)
        batch["attention_mask"].fill_(1)  # every position real: the FLOP count is exact
        _synchronize()
        started = time.perf_counter()
        metrics = train_step(trainable, batch, 1, next_token_loss,
                             vocab_size=config.model.vocab_size)
        _synchronize()
        timings.append(time.perf_counter() - started)
        check(math.isfinite(metrics["loss"]), f"step {step} loss is finite")
    seconds = sorted(timings[2:])[len(timings[2:]) // 2]  # median after two warm-up steps
    tokens = config.batch.global_batch_size * sequence
    flops = training_flops_per_token(config.model, sequence) * tokens
    achieved = flops / seconds / 1e12 / _world()
    peak = _peak_tflops()
    figures = {"parameters_billion": round(_parameters(config.model) / 1e9, 3),
               "sequence": sequence, "tokens_per_step": tokens,
               "seconds_per_step": round(seconds, 4),
               "tokens_per_second": round(tokens / seconds),
               "tflops_per_gpu": round(achieved, 1),
               "mfu": round(achieved / peak, 3) if peak else None,
               "peak_memory_gib": _peak_memory_gib()}
    return figures


def offload(args, check: Checks) -> dict:
    """Parking the trained state in host memory frees its device memory and brings it back
    bitwise; the next step trains; host copy speed."""
    from mcore_rl.smoke import next_token_loss, random_batch
    from mcore_rl.training import train_step
    from mcore_rl.training.offload import HostParking

    sequence = 128 if args.tiny else 1024
    model = TINY_MODEL if args.tiny else dict(PERF_MODEL, num_layers=8)
    config = _job(args, model, sequence, global_batch=2, micro_batch=1,
                  distributed_optimizer=True)
    trainable = _trainable(config)
    train_step(trainable, random_batch(config, 0), 1, next_token_loss,
               vocab_size=config.model.vocab_size)  # creates Adam's moments
    parking = HostParking(trainable)
    before = [tensor.detach().cpu().clone() for tensor in parking._kept_tensors()]
    _synchronize()
    started = time.perf_counter()
    parking.park()  # the first park also allocates and page-locks the host arena
    first_park_seconds = time.perf_counter() - started
    parking.restore()
    allocated = _allocated()
    started = time.perf_counter()
    freed = parking.park()
    park_seconds = time.perf_counter() - started
    copied = sum(host.numel() for _, host in parking.kept)  # gradient buffers are not copied
    released = allocated - _allocated()
    started = time.perf_counter()
    parking.restore()
    restore_seconds = time.perf_counter() - started
    after = [tensor.detach().cpu() for tensor in parking._kept_tensors()]
    check(all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after),
          "parameters and Adam state restored bitwise")
    if torch.cuda.is_available():
        check(released >= 0.9 * freed, f"the allocator released {released} of the {freed} "
              f"bytes parked (>= 90%)")
    metrics = train_step(trainable, random_batch(config, 1), 1, next_token_loss,
                         vocab_size=config.model.vocab_size)
    check(math.isfinite(metrics["loss"]), "the step after restoring is finite")
    return {"parked_gib": round(freed / 2 ** 30, 3), "released_gib": round(released / 2 ** 30, 3),
            "copied_gib": round(copied / 2 ** 30, 3),
            "first_park_seconds": round(first_park_seconds, 2),
            "park_gb_per_s": round(copied / park_seconds / 1e9, 2),
            "restore_gb_per_s": round(copied / restore_seconds / 1e9, 2)}


def parity(args, check: Checks) -> dict:
    """The actor's log-probs against HF transformers on the same weights (fp32 must agree to
    1e-4; bf16 reported), the Megatron engine's log-probs against the trainer's, and greedy
    generation repeated exactly."""
    from mcore_rl.config import InitConfig, ParallelConfig
    from mcore_rl.config.rollout import PromptConfig, SamplingConfig
    from mcore_rl.conversion.hf_to_mcore import model_config_of_hf
    from mcore_rl.models.pretrained import build_from_init
    from mcore_rl.rollout import MegatronEngine
    from mcore_rl.runtime import initialize, shutdown
    from mcore_rl.training import compute_outputs

    folder = _hf_llama(args)
    model = model_config_of_hf(folder)
    parallel = ParallelConfig(tensor_model_parallel_size=_world())
    runtime = initialize(_job(args, TINY_MODEL, 64, 4, 4, False), _launch())
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.vocab_size, (4, 48), generator=generator)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    reference = _hf_logprobs(folder, input_ids, runtime.device)
    figures = {}
    for precision in ("fp32", "bf16"):
        if precision == "bf16" and runtime.device.type == "cpu":
            continue
        module = build_from_init(InitConfig(hf_path=folder), model, parallel, precision,
                                 device=runtime.device, place=runtime.training)
        logprobs = compute_outputs([module], batch, 4, "lm", model.vocab_size)["logprobs"]
        figures[f"hf_vs_actor_{precision}"] = float((logprobs - reference)[:, 1:].abs().max())
    check(figures["hf_vs_actor_fp32"] <= 1e-4,
          f"fp32 actor log-probs within 1e-4 of transformers ({figures['hf_vs_actor_fp32']:.2e})")
    engine = MegatronEngine(module, model, 96)
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=16)
    prompts = [row[:8].tolist() for row in input_ids]
    first = engine.generate(prompts, greedy, PromptConfig(max_prompt_tokens=32))
    second = engine.generate(prompts, greedy, PromptConfig(max_prompt_tokens=32))
    check([c.token_ids for c in first.completions] == [c.token_ids for c in second.completions],
          "greedy generation repeats exactly")
    rows = first.response_tensors()
    trainer = compute_outputs([module], {"input_ids": rows["input_ids"], "attention_mask":
                              rows["attention_mask"]}, 4, "lm", model.vocab_size)["logprobs"]
    mask = rows["response_mask"].bool()
    figures["engine_vs_trainer_" + module.config.params_dtype.__repr__().split(".")[-1]] = \
        float((trainer - rows["engine_logprobs"])[mask].abs().max())
    shutdown()
    return figures


def rl(args, check: Checks) -> dict:
    """A few GRPO steps on the toy task at the machine's default precision, saved (the
    `resume` stage continues them in a new process)."""
    trainer = _toy_trainer(args, total_steps=2)
    history = trainer.fit()
    trainer.close()
    check(all(math.isfinite(step["actor/loss"]) for step in history), "losses are finite")
    check(len(history) == 2, f"2 steps ran ({len(history)})")
    return {"engine": trainer.config.rollout.engine,
            "precision": trainer.config.runtime.precision, "peak_mb": _peak_mb(history),
            "step_seconds": [round(step["time/step"], 3) for step in history],
            "reward": [round(step["reward/mean"], 3) for step in history]}


def resume(args, check: Checks) -> dict:
    """The `rl` stage's run resumed from its checkpoint by a new process, two more steps, an
    HF export, and transformers scoring with the exported weights as the actor does."""
    trainer = _toy_trainer(args, total_steps=4)
    check(trainer.step == 2, f"the run resumed at step 2 (got {trainer.step})")
    history = trainer.fit()
    exported = trainer.export_hf()
    input_ids = torch.randint(0, 16, (16, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    actor = trainer.roles.actor.logprobs(batch)["logprobs"]
    device, precision = trainer.runtime.device, trainer.config.runtime.precision
    trainer.close()
    check(len(history) == 2 and all(math.isfinite(step["actor/loss"]) for step in history),
          "two more finite steps")
    figures = {"resumed_at": 2, "step_seconds": [round(step["time/step"], 3)
                                                 for step in history]}
    if _rank() == 0:
        reference = _hf_logprobs(exported, input_ids, device)
        figures["export_vs_actor"] = float((actor - reference)[:, 1:].abs().max())
        tolerance = 1e-4 if precision == "fp32" else 0.1
        check(figures["export_vs_actor"] <= tolerance, f"the exported model's log-probs "
              f"under transformers match the actor's within {tolerance}")
    return figures


def moe(args, check: Checks) -> dict:
    """Three GRPO steps of the toy Mixture-of-Experts model (configs/grpo_toy_moe.yaml) with
    routing replay: Megatron's MoE layer, the router observation and the replay on the GPU.
    Under --vllm experts over every rank and r3 (the engine's routes: every one of them must
    reach the trainer, which vLLM's async scheduling on GPUs would silently prevent), else one
    expert group and r2 (the Megatron engine generates only at EP1, and returns no routes)."""
    overrides = [f"runtime.output_dir={args.workdir}/moe", "trainer.eval_every=0",
                 "trainer.save_every=0", "trainer.plots=false",
                 "trainer.total_steps=3", f"rollout.routing_replay={'r3' if args.vllm else 'r2'}",
                 f"rollout.engine={'vllm' if args.vllm else 'megatron'}",
                 f"rollout.rollout_tp={_world() if args.vllm else 1}",
                 f"parallel.expert_model_parallel_size={_world() if args.vllm else 1}"]
    trainer = _toy_trainer(args, 3, "grpo_toy_moe.yaml", overrides)
    history = trainer.fit()
    trainer.close()
    check(len(history) == 3 and all(math.isfinite(step["actor/loss"]) for step in history),
          "three finite steps")
    check(all(math.isfinite(step["moe/load_balancing"]) for step in history),
          "the routers' figures are finite")
    figures = {"engine": trainer.config.rollout.engine,
               "precision": trainer.config.runtime.precision,
               "load_balancing": [round(step["moe/load_balancing"], 3) for step in history],
               "step_seconds": [round(step["time/step"], 3) for step in history]}
    if args.vllm:  # only vLLM returns the engine's routes to compare with
        figures["router_agreement"] = [step["moe/router_agreement"] for step in history]
        figures["routes_replayed"] = [step["moe/routes_replayed"] for step in history]
        check(all(share == 1.0 for share in figures["routes_replayed"]),
              "r3: the trainer replayed the engine's route of every token the engine fed")
    return figures


def lora(args, check: Checks) -> dict:
    """Three GRPO steps with adapters (actor.lora) and a KL loss: the adapted linears, the
    reference as the actor with adapters off, the merged weight sync and the peft export on the
    device; peak memory beside the `rl` stage's full fine-tuning."""
    overrides = [f"runtime.output_dir={args.workdir}/lora", "trainer.save_every=0",
                 "actor.lora.enabled=true", "actor.lora.rank=8", "algorithm.use_kl_loss=true",
                 "algorithm.kl_coef=0.01"]
    trainer = _toy_trainer(args, 3, extra=overrides)
    history = trainer.fit()
    exported = trainer.export_hf()
    trainer.close()
    check(len(history) == 3 and all(math.isfinite(step["actor/loss"]) for step in history),
          "three finite steps")
    check(abs(history[0]["actor/kl_to_reference"]) <= 1e-6,
          "the reference is the starting policy (adapters start at B = 0)")
    check(history[-1]["actor/kl_to_reference"] > 0, "the adapters moved the policy")
    check(os.path.isfile(os.path.join(exported, "adapter", "adapter_model.safetensors")),
          "the export holds a peft adapter")
    return {"engine": trainer.config.rollout.engine, "peak_mb": _peak_mb(history),
            "step_seconds": [round(step["time/step"], 3) for step in history]}


def distill(args, check: Checks) -> dict:
    """Three steps of on-policy distillation (docs/distillation.md) from a wider, deeper random
    teacher in its own layout (TP = the ranks), parked in host memory between its passes: the
    teacher's groups, its NCCL collectives and its offload on the device; its log-probs of a
    fixed batch against transformers'."""
    folder = _toy_teacher(args)
    overrides = [f"runtime.output_dir={args.workdir}/distill", "trainer.save_every=0",
                 f"teacher.init.hf_path={folder}", "teacher.offload=true",
                 f"teacher.parallel.tensor_model_parallel_size={_world()}"]
    trainer = _toy_trainer(args, 3, extra=overrides)
    history = trainer.fit()
    input_ids = torch.randint(0, 16, (16, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    teacher = trainer.roles.teacher.logprobs(batch)
    device, precision = trainer.runtime.device, trainer.config.runtime.precision
    trainer.close()
    check(len(history) == 3 and all(math.isfinite(step["actor/loss"]) for step in history),
          "three finite steps")
    check(all(math.isfinite(step["distill/reverse_kl"]) for step in history),
          "the reverse KL to the teacher is finite")
    figures = {"precision": precision, "peak_mb": _peak_mb(history),
               "reverse_kl": [round(step["distill/reverse_kl"], 3) for step in history],
               "step_seconds": [round(step["time/step"], 3) for step in history]}
    if _rank() == 0:
        figures["teacher_vs_hf"] = float((teacher - _hf_logprobs(folder, input_ids, device))
                                         [:, 1:].abs().max())
        tolerance = 1e-4 if precision == "fp32" else 0.1
        check(figures["teacher_vs_hf"] <= tolerance,
              f"the teacher's log-probs match transformers' within {tolerance}")
    return figures


def _toy_teacher(args) -> str:
    """A random HF Llama wider and deeper than the toy student (hidden 256, 3 layers, GQA) with
    the toy tokenizer, written by rank 0."""
    import transformers
    from mcore_rl.data import write_toy_tokenizer

    folder = os.path.join(args.workdir, "toy_teacher")
    if _rank() == 0 and not os.path.isdir(folder):
        config = transformers.LlamaConfig(
            vocab_size=16, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False)
        torch.manual_seed(1)
        transformers.LlamaForCausalLM(config).save_pretrained(folder + ".incomplete")
        write_toy_tokenizer(folder + ".incomplete")
        os.replace(folder + ".incomplete", folder)
    while not os.path.isdir(folder):
        time.sleep(0.2)
    return folder


def _peak_mb(history: list[dict]) -> float:
    """The run's peak memory figure (device memory on GPUs, resident memory on CPU)."""
    return round(max(value for step in history for name, value in step.items()
                     if name.startswith("memory/peak_")), 1)


def _toy_trainer(args, total_steps: int, config: str = "grpo_toy.yaml",
                 extra: list[str] = ()):

    from mcore_rl.config import load_config
    from mcore_rl.data import write_toy_tokenizer
    from mcore_rl.rl import Trainer

    tokenizer = os.path.join(args.workdir, "toy_tokenizer")
    if _rank() == 0 and not os.path.isdir(tokenizer):
        write_toy_tokenizer(tokenizer)
    while not os.path.isdir(tokenizer):
        time.sleep(0.2)
    overrides = [f"data.tokenizer={tokenizer}", f"runtime.output_dir={args.workdir}/rl",
                 f"rollout.engine={'vllm' if args.vllm else 'megatron'}",
                 f"rollout.rollout_tp={_world()}", "trainer.eval_every=0",
                 "trainer.save_every=2", "trainer.plots=false",
                 f"trainer.total_steps={total_steps}",
                 f"parallel.tensor_model_parallel_size={_world()}"]
    return Trainer(load_config(os.path.join(REPO, "configs", config), overrides + list(extra)))


def delta(args, check: Checks) -> dict:
    """The delta weight sync's encoding on this machine's device (resharding/delta.py): a bf16
    shard of 64M elements (--tiny: 1M), 0.5% of them moved, encoded on the device and applied
    to a copy of the old one, which must then equal the new one bit for bit; the checksums
    must equal the CPU's (integer arithmetic); figures: the delta's form and share of the
    whole shard and the encoding's rate (GB of shard compared per second)."""
    from mcore_rl.resharding.delta import apply_delta, checksums, encode_delta

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    numel = (1 << 20) if args.tiny else (64 << 20)
    generator = torch.Generator().manual_seed(0)
    previous = torch.randn(numel, generator=generator).to(torch.bfloat16)
    current = previous.clone()
    moved = torch.randperm(numel, generator=generator)[:numel // 200]
    current[moved] = (current[moved].float() * 1.5).to(torch.bfloat16)
    old, new = previous.to(device), current.to(device)
    encoded = encode_delta(old, new)  # warm-up
    repeats = 3
    _synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        encoded = encode_delta(old, new)
    _synchronize()
    seconds = (time.perf_counter() - started) / repeats
    held = old.clone()
    apply_delta(held, encoded)
    check(torch.equal(held.view(torch.int16), new.view(torch.int16)),
          "the old shard plus the delta equals the new shard bitwise")
    counts = [numel // 3, numel - numel // 3]
    check(torch.equal(checksums(new, counts).cpu(), checksums(current, counts)),
          "the device's checksums equal the CPU's")
    share = encoded.nbytes / (numel * 2)
    check(share < 0.1, "the delta of 0.5% moved elements is under 10% of the shard")
    return {"device": str(device), "delta_kind": encoded.kind, "delta_share": round(share, 4),
            "encode_gb_per_s": round(numel * 2 / seconds / 1e9, 2)}


STAGES = {"preflight": preflight, "smoke": smoke, "performance": performance,
          "offload": offload, "parity": parity, "rl": rl, "resume": resume, "moe": moe,
          "lora": lora, "distill": distill, "delta": delta}


# -- helpers -----------------------------------------------------------------------------------

def training_flops_per_token(model, sequence: int) -> float:
    """Forward + backward FLOPs per token: 3 x (2 x matmul parameters + attention's two
    [s, s] products, counted whole as Megatron's MFU does)."""
    return 3 * (2 * _parameters(model, embeddings=False)
                + 2 * model.vocab_size * model.hidden_size
                + 4 * sequence * model.num_attention_heads * model.kv_channels * model.num_layers)


def _parameters(model, embeddings: bool = True) -> int:
    heads, kv, head_dim = model.num_attention_heads, model.kv_heads, model.kv_channels
    attention = model.hidden_size * head_dim * (heads + 2 * kv) + heads * head_dim * \
        model.hidden_size
    mlp = 3 * model.hidden_size * model.ffn_hidden_size
    total = model.num_layers * (attention + mlp)
    return total + (2 * model.vocab_size * model.hidden_size if embeddings else 0)


def _job(args, model: dict, sequence: int, global_batch: int, micro_batch: int,
         distributed_optimizer: bool):
    from mcore_rl.config import load_config

    overrides = [f"model.{key}={value}" for key, value in model.items()]
    overrides += [f"batch.seq_length={sequence}", f"batch.global_batch_size={global_batch}",
                  f"batch.micro_batch_size={micro_batch}",
                  f"optimizer.use_distributed_optimizer={str(distributed_optimizer).lower()}",
                  f"parallel.tensor_model_parallel_size={_world()}", "optimizer.lr=1e-5",
                  f"runtime.output_dir={args.workdir}/job"]
    return load_config(None, overrides)


def _trainable(config):
    from mcore_rl.models import build_gpt_model
    from mcore_rl.runtime import initialize
    from mcore_rl.training import make_trainable

    runtime = initialize(config, _launch())
    model = build_gpt_model(config.model, config.parallel, config.runtime.precision,
                            device=runtime.device, place=runtime.training)
    return make_trainable(model, config.optimizer, config.runtime.precision)


def _hf_llama(args) -> str:
    """A random Llama HF folder (peaked distributions: weights of std 0.1), written by rank 0."""
    import torch.distributed as dist
    import transformers

    folder = os.path.join(args.workdir, "hf_llama")
    if _rank() == 0 and not os.path.isdir(folder):
        size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if args.tiny \
            else dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4)
        config = transformers.LlamaConfig(**size, num_attention_heads=8, num_key_value_heads=2,
                                          vocab_size=1000, max_position_embeddings=256,
                                          tie_word_embeddings=False)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(param))
        model.save_pretrained(folder + ".incomplete")
        os.replace(folder + ".incomplete", folder)
    if dist.is_initialized():
        dist.barrier()
    while not os.path.isdir(folder):
        time.sleep(0.5)
    return folder


def _hf_logprobs(folder: str, input_ids: torch.Tensor, device) -> torch.Tensor:
    """transformers' fp32 log-probs of each token given the ones before (0 at position 0)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.to(device).eval()
    with torch.no_grad():
        logits = model(input_ids.to(device)).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(
        -1, input_ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(logprobs, (1, 0)).cpu()


def _launch():
    from mcore_rl.runtime import read_launch_env

    return read_launch_env()


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _peak_memory_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)


def _peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for fragment, peak in PEAK_BF16_TFLOPS.items() if fragment in name), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", required=True, choices=sorted(STAGES))
    parser.add_argument("--out", required=True, help="JSON lines file to append to")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a new one)")
    parser.add_argument("--cpu", action="store_true", help="allow running without CUDA")
    parser.add_argument("--tiny", action="store_true", help="tiny models (CI on CPU)")
    parser.add_argument("--vllm", action="store_true", help="the RL stage generates with vLLM")
    parser.add_argument("--sequence", type=int, default=None,
                        help="the performance stage's sequence length (default 2048; --tiny 128)")
    args = parser.parse_args()
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_validate_")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    check, started = Checks(), time.perf_counter()
    try:
        figures = STAGES[args.stage](args, check)
    except Exception as error:  # recorded as the stage's failure
        traceback.print_exc()
        figures = {"error": f"{type(error).__name__}: {error}"}
        check(False, "the stage ran to the end")
    else:
        from mcore_rl.runtime import shutdown

        shutdown()  # the stages that keep their process group (safe after one that did)
    record = {"stage": args.stage, "ok": not check.failed,
              "seconds": round(time.perf_counter() - started, 1), "failed": check.failed,
              **figures}
    if _rank() == 0:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
