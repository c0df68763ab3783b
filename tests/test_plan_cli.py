"""`mcore-rl plan`: the dry-run figures match bytes counted by hand, and bad input is refused.

Hand count for TP2 x PP2 -> vLLM TP2 on 4 GPUs, rank 0 (TP rank 0, stage 0; vocabulary 1024
so neither Megatron nor vLLM pads): its rollout shard is half of every TP-split tensor and every
norm; it holds exactly that for stage 0, so it lacks stage 1's part. Full-gather gives it the
other TP half of stage 0's split tensors and every stage-1 tensor whole.
"""

import math
import subprocess
import sys

import pytest
import yaml

from mcore_rl.config import ModelConfig
from mcore_rl.config.model import MoEConfig
from mcore_rl.param_layout import sharding

# Large enough (2.2B parameters) that the table's two-decimal GiB resolve the counts; planning
# touches no weights, so size costs nothing.
MODEL = dict(num_layers=4, hidden_size=8192, ffn_hidden_size=16384, num_attention_heads=64,
             num_kv_heads=8, vocab_size=1024, max_position_embeddings=64, tie_embeddings=False)
BF16 = 2


def hand_count() -> tuple[int, int]:
    """(bytes rank 0 lacks, bytes full-gather sends it)."""
    model = ModelConfig(**MODEL)
    lacking = full_gather = 0
    for name, shape in sharding.canonical_param_shapes(model).items():
        size = math.prod(shape) * BF16
        split = sharding.shard_kind(name) is not sharding.ShardKind.REPLICATED
        on_stage_0 = sharding.to_local_name(name, model, 2)[0] == 0
        if on_stage_0:
            full_gather += size // 2 if split else 0
        else:
            lacking += size // 2 if split else size
            full_gather += size
    return lacking, full_gather


def run_plan(tmp_path, *arguments, model=MODEL):
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"model": model}))
    return subprocess.run([sys.executable, "-m", "mcore_rl", "plan", "--model", str(config),
                           *arguments], capture_output=True, text=True, timeout=300)


def test_plan_reports_the_hand_counted_bytes(tmp_path):
    done = run_plan(tmp_path, "--train-tp", "2", "--train-pp", "2", "--rollout-tp", "2",
                    "--gpus", "4,8")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 4 |")
            or line.startswith("| 8 |")]
    assert len(rows) == 2
    lacking, full_gather = hand_count()
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        ours, full, lower = (float(v) * 1024 ** 3 for v in cells[3].split(" / "))
        # the table prints GiB with two decimals: compare at that resolution
        assert ours == pytest.approx(lacking, abs=0.006 * 1024 ** 3)
        assert lower == ours
        assert full == pytest.approx(full_gather, abs=0.006 * 1024 ** 3)
        assert float(cells[4]) == pytest.approx(lacking / full_gather, abs=0.006)


def test_plan_reports_the_rank_order_train_uses(tmp_path):
    """TP2 x PP2 -> vLLM TP4: the trainer lays PP fastest, so that each rank's rollout quarter
    lies in its training half; the table shows that order and the default order's bytes."""
    done = run_plan(tmp_path, "--train-tp", "2", "--train-pp", "2", "--rollout-tp", "4",
                    "--gpus", "4")
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 4 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    ours = float(cells[3].split(" / ")[0])
    assert cells[7].split("-").index("pp") < cells[7].split("-").index("tp")
    assert float(cells[8]) == pytest.approx(2 * ours, abs=0.01)


def test_plan_refuses_a_world_that_is_not_whole_replicas(tmp_path):
    done = run_plan(tmp_path, "--train-tp", "2", "--train-pp", "2", "--rollout-tp", "2",
                    "--gpus", "6")
    assert done.returncode == 2
    assert "--gpus 6 is not a multiple of --train-tp x --train-pp = 4" in done.stderr


def test_plan_refuses_a_rollout_tp_the_heads_cannot_take(tmp_path):
    done = run_plan(tmp_path, "--train-tp", "2", "--rollout-tp", "3", "--gpus", "6")
    assert done.returncode == 2
    assert "num_attention_heads=64 must be divisible by tensor_model_parallel_size=3" in done.stderr


# 8 experts of width 4096 in each of 2 layers: 0.8B expert parameters, so two-decimal GiB resolve
# the counts; vocabulary 1024 again so no layout pads.
MOE_MODEL = dict(MODEL, num_layers=2, hidden_size=4096, ffn_hidden_size=4096,
                 num_attention_heads=32, moe=dict(num_experts=8, router_topk=2))


def moe_hand_count() -> tuple[int, int]:
    """(bytes a rank lacks, bytes full-gather sends it) for TP1 x DP4 with EP2 -> vLLM TP2: the
    rank holds every non-expert tensor whole and its EP rank's 4 experts; its rollout half of
    the other 4 experts is what it lacks, while full-gather sends those 4 experts whole."""
    model = ModelConfig(**dict(MOE_MODEL, moe=MoEConfig(**MOE_MODEL["moe"])))
    experts = sum(math.prod(shape) * BF16
                  for name, shape in sharding.canonical_param_shapes(model).items()
                  if sharding.expert_of(name) is not None)
    return experts // 4, experts // 2


def test_plan_counts_expert_parallel_training(tmp_path):
    done = run_plan(tmp_path, "--train-tp", "1", "--train-ep", "2", "--rollout-tp", "2",
                    "--gpus", "4", model=MOE_MODEL)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 4 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "1x1x4xEP2"
    ours, full, lower = (float(v) * 1024 ** 3 for v in cells[3].split(" / "))
    lacking, full_gather = moe_hand_count()
    assert ours == pytest.approx(lacking, abs=0.006 * 1024 ** 3)
    assert lower == ours
    assert full == pytest.approx(full_gather, abs=0.006 * 1024 ** 3)
    model_bytes = 2 * full_gather + sum(
        math.prod(shape) * BF16 for name, shape in sharding.canonical_param_shapes(
            ModelConfig(**dict(MOE_MODEL, moe=MoEConfig(**MOE_MODEL["moe"])))).items()
        if sharding.expert_of(name) is None)
    assert float(cells[-1]) * 1024 ** 3 == pytest.approx(model_bytes / 2, abs=0.006 * 1024 ** 3)


def test_plan_sizes_vllm_expert_parallelism(tmp_path):
    """--rollout-ep: vLLM's EP over the 4 engine ranks serves 2 of the 8 experts whole on each
    (the dense tensors still split over rollout TP2); ranks 1 and 2 train other experts than
    they serve (EP2 training: ranks 0, 2 hold experts 0-3), so they receive 2 experts."""
    done = run_plan(tmp_path, "--train-tp", "1", "--train-ep", "2", "--rollout-tp", "2",
                    "--rollout-ep", "--gpus", "4", model=MOE_MODEL)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 4 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == "2x2xEP4"
    lacking, full_gather = moe_hand_count()  # a quarter, and half, of the experts' bytes
    ours, _, lower = (float(v) * 1024 ** 3 for v in cells[3].split(" / "))
    assert ours == lower == pytest.approx(lacking, abs=0.006 * 1024 ** 3)
    dense = sum(math.prod(shape) * BF16 for name, shape in sharding.canonical_param_shapes(
        ModelConfig(**dict(MOE_MODEL, moe=MoEConfig(**MOE_MODEL["moe"])))).items()
        if sharding.expert_of(name) is None)
    assert float(cells[-1]) * 1024 ** 3 == pytest.approx(dense / 2 + lacking,
                                                         abs=0.006 * 1024 ** 3)


@pytest.mark.parametrize("model,ep,message", [
    (MOE_MODEL, "3", "model.moe.num_experts=8 must be divisible by "
                     "expert_model_parallel_size=3"),
    (MODEL, "2", "--train-ep 2 needs a Mixture-of-Experts model"),
], ids=["ep-not-dividing-dp", "ep-on-a-dense-model"])
def test_plan_refuses_a_bad_expert_parallel_size(tmp_path, model, ep, message):
    done = run_plan(tmp_path, "--train-tp", "1", "--train-ep", ep, "--rollout-tp", "2",
                    "--gpus", "4", model=model)
    assert done.returncode == 2
    assert message in done.stderr
