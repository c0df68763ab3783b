"""The distributed smoke job through the real launcher: scripts/torchrun.sh with 4 CPU ranks at
TP2 x PP2, in bf16 from a random start and in fp32 from an HF folder (its loss against
transformers')."""

import math
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LINE = re.compile(r"step (\d+): loss ([0-9.]+)\s+grad_norm ([0-9.]+)")


def run_launcher(*arguments, port):
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE="4", MASTER_PORT=str(port))
    return subprocess.run([os.path.join(REPO, "scripts", "torchrun.sh"), *arguments], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


def test_smoke_job_trains_at_tp2_pp2_in_bf16():
    done = run_launcher("smoke", "--config", "configs/smoke.yaml", "smoke.steps=3",
                        "runtime.precision=bf16", port=29542)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TP 2 x PP 2 x DP 1" in done.stdout
    steps = [(int(s), float(loss), float(norm)) for s, loss, norm in
             STEP_LINE.findall(done.stdout)]
    assert [s for s, _, _ in steps] == [0, 1, 2], done.stdout
    for _, loss, norm in steps:
        # random tokens over a 1000-word vocabulary: an untrained model is near ln(1000)
        assert abs(loss - math.log(1000)) < 0.5 and 0 < norm < 100


def test_bad_config_fails_before_launching_work():
    done = run_launcher("smoke", "--config", "configs/smoke.yaml",
                        "parallel.tensor_model_parallel_size=3", port=29543)
    assert done.returncode != 0
    assert "num_attention_heads=4 must be divisible by tensor_model_parallel_size=3" in done.stderr


def test_smoke_job_from_hf_folder_reports_transformers_loss(tmp_path):
    """Start from an HF folder at TP2 x PP2: the step-0 loss (computed before the update) is the
    token-mean NLL that transformers gives for the same batch."""
    import torch

    from hf_models import save_hf_case
    from mcore_rl.config import load_config
    from mcore_rl.conversion.model_source import with_model_from_init
    from mcore_rl.smoke import random_batch

    hf_dir = str(tmp_path / "hf")
    hf_model = save_hf_case("qwen2", hf_dir)
    overrides = [f"init.hf_path={hf_dir}", "parallel.tensor_model_parallel_size=2",
                 "parallel.pipeline_model_parallel_size=2", "batch.global_batch_size=8",
                 "batch.micro_batch_size=2", "batch.seq_length=32", "smoke.steps=1"]
    done = run_launcher("smoke", *overrides, port=29544)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"weights from {hf_dir}" in done.stdout and "TP 2 x PP 2 x DP 1" in done.stdout
    batch = random_batch(with_model_from_init(load_config(None, overrides)), step=0)
    with torch.no_grad():
        logits = hf_model(input_ids=batch["input_ids"],
                          attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(
        -1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["attention_mask"][:, 1:].float()
    want = -(logp * mask).sum() / mask.sum()
    loss = float(STEP_LINE.search(done.stdout).group(2))
    assert abs(loss - want.item()) < 2e-4, (loss, want.item())
