"""scripts/gpu_validate.sh, the one-command GPU validation, runs end to end on CPU with tiny
models (--cpu --tiny): every stage passes its own checks (the actor against transformers, the
engine against the trainer, parking bitwise, a resumed run continuing at its step...), so the
script a GPU owner runs has not rotted. Its figures only mean something on a GPU."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["preflight", "smoke", "performance", "offload", "parity", "rl", "resume", "moe",
          "lora", "distill"]


def test_every_stage_passes_on_cpu(tmp_path):
    env = dict(os.environ, GPU_VALIDATE_OUT=str(tmp_path), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", "scripts/gpu_validate.sh", "--cpu", "--tiny"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert [record["stage"] for record in records] == STAGES
    assert all(record["ok"] and not record["failed"] for record in records)
    by_stage = {record["stage"]: record for record in records}
    assert by_stage["parity"]["hf_vs_actor_fp32"] <= 1e-4
    assert by_stage["resume"]["resumed_at"] == 2
    assert "PASS" in run.stdout and "FAIL" not in run.stdout
