"""The compatibility tier: megatron-core 0.16.1 (this environment's, the last release for Python
3.10/3.11) and 0.19.2 (the newest, what clusters and NGC images have), tested side by side.

`scripts/install.sh` puts 0.19.2 in `.venv/megatron-core-0.19.2`; a process with that folder
first on PYTHONPATH imports it instead (its cp311 wheel runs on this Python). Checked here:
- the tests that meet Megatron-Core's API where its releases differ (the layer spec's MLP, the
  MoE block spec with experts split over ranks, LoRA's linears, the GPT inference wrapper of the
  Megatron engine over pipeline stages) pass under 0.19.2, in a nested pytest run;
- a checkpoint (torch_dist) written under either release loads under the other, bit for bit;
- the toy GRPO job through vLLM logs the same numbers under both.
"""

import json
import os
import subprocess
import sys

import pytest

from hf_models import assert_same_hf_folder, save_hf_case
from mcore_rl.checkpoint.weights_io import is_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEWER_RELEASE = "0.19.2"
NEWER = os.path.join(sys.prefix, f"megatron-core-{NEWER_RELEASE}")
TIER = [
    "tests/test_lora.py::test_lora_matches_peft[qwen2_moe-TP1PP1]",
    "tests/test_lora.py::test_lora_matches_peft[qwen2_moe-TP2PP2]",
    "tests/test_layout_invariance.py::test_experts_split_over_ranks_train_like_one_rank[EP2]",
    "tests/test_rollout_engines.py::"
    "test_megatron_engine_over_pipeline_stages_samples_what_the_trainer_scores",
]
"""Tests of the code paths the releases differ in: the layer spec's MLP (LoRA, on the MoE model,
whose first layer is dense: dense MLP, shared expert and attention adapters in one world; the
MoE block spec with experts over two ranks, an Adam step against one rank's) and the Megatron
engine's inference wrapper over two pipeline stages. Dense models, the trainer and resharding
into vLLM run in the toy job below."""

pytestmark = pytest.mark.skipif(not os.path.isdir(NEWER),
                                reason=f"megatron-core {NEWER_RELEASE} is not in {NEWER} "
                                       "(scripts/install.sh puts it there)")


def environment(release: str) -> dict:
    """This process's environment for a child importing megatron-core `release`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep)
            if entry and entry != NEWER]
    env["PYTHONPATH"] = os.pathsep.join(([NEWER] if release == NEWER_RELEASE else []) + path)
    return env


def run(release: str, *arguments: str, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *arguments], cwd=REPO, env=environment(release),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_api_tier_passes_under_the_newer_release():
    done = run(NEWER_RELEASE, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", *TIER,
               timeout=900)
    assert f"megatron-core {NEWER_RELEASE}" in done.stdout  # the report header: what it imported
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize("writer, reader", [("0.16.1", NEWER_RELEASE), (NEWER_RELEASE, "0.16.1")])
def test_a_checkpoint_written_under_one_release_loads_under_the_other(tmp_path, writer, reader):
    """`mcore-rl convert` of a Mixture-of-Experts model (a dense first layer, experts split
    over two ranks' worth of shards) to a torch_dist checkpoint under `writer` and back to HF
    under `reader`: the same tensors bit for bit, the tokenizer carried along, transformers'
    logits unchanged. Also the conversion command's own round-trip test."""
    hf_dir, ckpt, back = (str(tmp_path / name) for name in ("hf", "mcore", "back"))
    hf_model = save_hf_case("qwen3_moe", hf_dir)
    run(writer, "-m", "mcore_rl", "convert", "hf-to-mcore", "--hf", hf_dir, "--out", ckpt,
        "--tp", "2")
    assert is_checkpoint(ckpt) and os.path.isfile(os.path.join(ckpt, "tokenizer",
                                                               "tokenizer.json"))
    run(reader, "-m", "mcore_rl", "convert", "mcore-to-hf", "--ckpt", ckpt, "--out", back)
    assert_same_hf_folder(hf_dir, back, hf_model)


def test_the_toy_rl_job_logs_the_same_numbers_under_both(tmp_path):
    """Two GRPO steps of the toy task through vLLM (model building, the trainer's update,
    resharding to the engine): the same rewards, entropy and gradient norms."""
    logged = {}
    for release in ("0.16.1", NEWER_RELEASE):
        folder = tmp_path / release
        run(release, "-m", "mcore_rl", "train", "--config", "configs/grpo_toy.yaml",
            "trainer.total_steps=2", "trainer.eval_every=0", "trainer.plots=false",
            "trainer.save_every=0", f"runtime.output_dir={folder}")
        logged[release] = [json.loads(line) for line in
                           (folder / "metrics.jsonl").read_text().splitlines()]
    older, newer = logged["0.16.1"], logged[NEWER_RELEASE]
    assert len(older) == len(newer) == 2
    for before, after in zip(older, newer):
        for key in ("reward/mean", "actor/entropy", "actor/grad_norm", "actor/loss"):
            assert after[key] == pytest.approx(before[key], rel=1e-5, abs=1e-7), key
