"""scripts/gpu_validate.sh, the one-command GPU validation, runs end to end on CPU with tiny
models (--cpu --tiny), so the script a GPU owner runs has not rotted. Its figures only mean
something on a GPU.

The default tier runs three stages through the script (its stage loop, JSON lines and PASS/FAIL
table, the actor's log-probs against transformers, and the delta sync's encoding); every stage passing its own checks (the
engine against the trainer, parking bitwise, a resumed run continuing at its step...) is the slow
tier's, since each stage's behaviour is tested on its own elsewhere (docs/testing.md)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["preflight", "smoke", "performance", "offload", "parity", "rl", "resume", "moe",
          "lora", "distill", "delta"]


def run_stages(tmp_path, stages: list[str]) -> dict:
    """Run the script's `stages` on CPU; each stage's JSON record, by stage."""
    env = dict(os.environ, GPU_VALIDATE_OUT=str(tmp_path), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", "scripts/gpu_validate.sh", "--cpu", "--tiny", "--stages",
                          ",".join(stages)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert [record["stage"] for record in records] == stages
    assert all(record["ok"] and not record["failed"] for record in records)
    assert "PASS" in run.stdout and "FAIL" not in run.stdout
    return {record["stage"]: record for record in records}


def test_the_script_runs_its_stages_and_the_actor_matches_transformers(tmp_path):
    by_stage = run_stages(tmp_path, ["preflight", "parity", "delta"])
    assert by_stage["parity"]["hf_vs_actor_fp32"] <= 1e-4
    assert by_stage["delta"]["delta_kind"] == "runs"


@pytest.mark.slow
def test_every_stage_passes_on_cpu(tmp_path):
    by_stage = run_stages(tmp_path, STAGES)
    assert by_stage["parity"]["hf_vs_actor_fp32"] <= 1e-4
    assert by_stage["resume"]["resumed_at"] == 2
