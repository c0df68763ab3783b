"""HF <-> Megatron conversion: logits parity with transformers at TP1/PP1, TP2, PP2 and TP2xPP2
for all four architectures, bit-identical round trips, multi-process conversion, and bad input.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from conversion_worker import run_parity
from hf_models import (CASES, assert_same_hf_folder, hf_logits, hf_state, reference_batch,
                       save_hf_case, toy_llama)
from mcore_rl.checkpoint.weights_io import is_checkpoint
from mcore_rl.config import InitConfig
from world import run_world

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*arguments, check=True):
    done = subprocess.run([sys.executable, "-m", "mcore_rl", *arguments], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if check:
        assert done.returncode == 0, done.stderr[-2000:]
    return done


def _convert_all(jobs, tp=2, pp=2):
    """In one process (one Megatron import): HF -> mcore for TP x PP, then mcore -> HF."""
    from mcore_rl.conversion.hf_to_mcore import convert_hf_to_mcore
    from mcore_rl.conversion.mcore_to_hf import convert_mcore_to_hf
    from mcore_rl.runtime import start_process_group
    start_process_group(timeout_minutes=3)
    for hf_dir, ckpt, back in jobs:
        convert_hf_to_mcore(hf_dir, ckpt, tp=tp, pp=pp)
        convert_mcore_to_hf(ckpt, back)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{case: (hf folder, mcore checkpoint, HF model, exported HF folder)}."""
    root = tmp_path_factory.mktemp("conversion")
    cases, jobs = {}, []
    for case in CASES:
        hf_dir, ckpt, back = (str(root / f"{case}-{kind}") for kind in ("hf", "mcore", "back"))
        cases[case] = (hf_dir, ckpt, save_hf_case(case, hf_dir), back)
        jobs.append((hf_dir, ckpt, back))
    run_world(1, _convert_all, jobs)
    return cases


@pytest.fixture(scope="module")
def parity(converted, tmp_path_factory):
    """Megatron logits for every case and layout, plus the direct-from-HF start for two."""
    ids, _ = reference_batch()
    jobs = [(case, InitConfig(checkpoint=ckpt)) for case, (_, ckpt, _, _) in converted.items()]
    jobs += [(case, InitConfig(hf_path=converted[case][0])) for case in ("qwen2", "llama_tied_kv1")]
    out = str(tmp_path_factory.mktemp("parity") / "logits.pt")
    run_world(4, run_parity, jobs, LAYOUTS, ids, out)
    return torch.load(out)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"TP{l[0]}PP{l[1]}")
def test_megatron_logits_equal_transformers(converted, parity, case, layout):
    ids, mask = reference_batch()
    want = hf_logits(converted[case][2], ids, mask)
    got = parity[(case, "mcore", *layout)]
    valid = mask.bool()
    assert got.shape == want.shape
    assert (got[valid] - want[valid]).abs().max().item() < 1e-4


MOE_CASES = ["qwen3_moe", "qwen2_moe", "mixtral"]
EXPERT_LAYOUTS = [(2, 1, 2, 1), (2, 1, 2, 2), (1, 2, 2, 1), (1, 1, 4, 1),
                  (1, 1, 1, 1)]  # (tp, pp, ep, etp)


@pytest.fixture(scope="module")
def expert_parity(converted, tmp_path_factory):
    """Megatron logits of the MoE cases with experts split over EP ranks: the converted
    checkpoints, and the same weights saved again from the TP2 x EP2 x ETP1 model (the expert
    grid across the TP groups) and loaded at every layout (EP1, EP2, EP4, with TP2 at ETP1 and
    ETP2, and PP2)."""
    from conversion_worker import run_expert_parity

    ids, _ = reference_batch()
    root = tmp_path_factory.mktemp("expert_parity")
    run_world(4, run_expert_parity, {case: converted[case][1] for case in MOE_CASES},
              EXPERT_LAYOUTS, ids, str(root / "resaved"), str(root / "logits.pt"))
    return torch.load(root / "logits.pt")


@pytest.mark.parametrize("case", MOE_CASES)
def test_experts_split_over_ranks_give_transformers_logits(converted, expert_parity, case):
    """Expert parallelism (each EP rank holds E/EP experts, tokens exchanged all-to-all) gives
    transformers' logits, at expert TP 1 and 2 beside TP2, and a checkpoint saved at EP2 x ETP1
    loads at EP1, EP2 (ETP2) and EP4."""
    ids, mask = reference_batch()
    want = hf_logits(converted[case][2], ids, mask)
    valid = mask.bool()
    for layout in EXPERT_LAYOUTS:
        for source in ("converted", "resaved"):
            got = expert_parity[(case, source, *layout)]
            assert (got[valid] - want[valid]).abs().max().item() < 1e-4, (source, layout)


@pytest.mark.parametrize("case", ["qwen2", "llama_tied_kv1"])
def test_training_can_start_straight_from_hf_folder(converted, parity, case):
    ids, mask = reference_batch()
    want = hf_logits(converted[case][2], ids, mask)
    valid = mask.bool()
    for layout in LAYOUTS:
        got = parity[(case, "hf", *layout)]
        assert (got[valid] - want[valid]).abs().max().item() < 1e-4, layout


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_identical(converted, case):
    hf_dir, _, hf_model, back = converted[case]
    assert_same_hf_folder(hf_dir, back, hf_model)


def _convert_in_world(hf_dir, ckpt, back):
    from mcore_rl.conversion.hf_to_mcore import convert_hf_to_mcore
    from mcore_rl.conversion.mcore_to_hf import convert_mcore_to_hf
    from mcore_rl.runtime import start_process_group
    start_process_group(timeout_minutes=3)
    convert_hf_to_mcore(hf_dir, ckpt, tp=2, pp=2)
    convert_mcore_to_hf(ckpt, back, max_file_bytes=20_000)


def test_conversion_under_a_world_of_four(tmp_path):
    """TP2 x PP2 on 4 ranks, each reading its own shards, of a 3-layer model: stages of 2 and 1
    layers (uneven; config.parallel.pipeline_stage_layers), then back, bit-identical."""
    hf_dir = toy_llama(str(tmp_path / "source"), num_layers=3)
    ckpt, back = str(tmp_path / "mcore"), str(tmp_path / "hf")
    run_world(4, _convert_in_world, hf_dir, ckpt, back)
    assert len(glob.glob(os.path.join(back, "*.safetensors"))) > 4  # files dealt to 4 ranks
    original, exported = hf_state(hf_dir), hf_state(back)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[name], exported[name]) for name in original)


def _convert_experts_split(hf_dir, ckpt, back):
    from mcore_rl.conversion.hf_to_mcore import convert_hf_to_mcore
    from mcore_rl.conversion.mcore_to_hf import convert_mcore_to_hf
    from mcore_rl.runtime import start_process_group

    start_process_group(timeout_minutes=3)
    convert_hf_to_mcore(hf_dir, ckpt, tp=2, pp=1, ep=2, etp=1)
    convert_mcore_to_hf(ckpt, back, max_file_bytes=20_000)


def test_conversion_with_experts_split_over_ranks(converted, tmp_path):
    """`convert hf-to-mcore --tp 2 --ep 2 --etp 1` on 4 ranks (each reading its TP half of the
    dense tensors and 2 of the 4 experts whole; the two ranks of a TP group hold different
    experts, the other TP group copies of them) and back: bit-identical to the HF folder."""
    hf_dir = converted["qwen2_moe"][0]
    ckpt, back = str(tmp_path / "mcore"), str(tmp_path / "hf")
    run_world(4, _convert_experts_split, hf_dir, ckpt, back)
    original, exported = hf_state(hf_dir), hf_state(back)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[name], exported[name]) for name in original)


# ----------------------------------------------------------------------------- bad input


def _copy_case(converted, tmp_path, case="llama"):
    import shutil
    target = str(tmp_path / "hf")
    shutil.copytree(converted[case][0], target)
    return target


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as handle:
        config = json.load(handle)
    config.update(changes)
    with open(path, "w") as handle:
        json.dump(config, handle)


def _rewrite_tensors(folder, edit):
    """Rewrite the weights as one model.safetensors (no index) after `edit`ing the state."""
    from safetensors.torch import save_file
    state = hf_state(folder)
    for file in glob.glob(os.path.join(folder, "model*.safetensors*")):
        os.remove(file)
    edit(state)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def expect_refusal(hf_dir, *needles):
    from mcore_rl.conversion.hf_to_mcore import open_hf
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        open_hf(hf_dir)
    for needle in needles:
        assert needle in str(error.value), str(error.value)


def test_unsupported_architecture_lists_supported(converted, tmp_path):
    hf_dir = _copy_case(converted, tmp_path)
    _edit_config(hf_dir, architectures=["GPT2LMHeadModel"])
    expect_refusal(hf_dir, "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_unsupported_config_field_is_named(converted, tmp_path):
    hf_dir = _copy_case(converted, tmp_path, "mistral")
    _edit_config(hf_dir, sliding_window=16)
    expect_refusal(hf_dir, "sliding_window", "16")


def test_tp_not_dividing_heads_fails_before_work(converted, tmp_path):
    out = str(tmp_path / "out")
    done = cli("convert", "hf-to-mcore", "--hf", converted["llama"][0], "--out", out,
               "--tp", "3", check=False)
    assert done.returncode == 2 and "num_attention_heads=4" in done.stderr, done.stderr[-2000:]
    assert not os.path.exists(out) and not os.path.exists(out + ".incomplete")


def test_index_naming_a_tensor_its_file_lacks(converted, tmp_path):
    hf_dir = _copy_case(converted, tmp_path)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    with open(index) as handle:
        content = json.load(handle)
    first_file = next(iter(content["weight_map"].values()))
    content["weight_map"]["model.phantom.weight"] = first_file
    with open(index, "w") as handle:
        json.dump(content, handle)
    expect_refusal(hf_dir, first_file, "model.phantom.weight")


def test_missing_extra_and_misshaped_tensors_are_named(converted, tmp_path):
    hf_dir = _copy_case(converted, tmp_path)

    def edit(state):
        del state["model.layers.1.mlp.up_proj.weight"]
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
        state["model.extra_bias"] = torch.zeros(3)
    _rewrite_tensors(hf_dir, edit)
    expect_refusal(hf_dir, "model.layers.1.mlp.up_proj.weight", "model.extra_bias",
                   "model.layers.0.self_attn.k_proj.weight", "(8, 64)", "(32, 64)")


def test_truncated_safetensors_names_the_file(converted, tmp_path):
    hf_dir = _copy_case(converted, tmp_path)
    victim = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))[0]
    with open(victim, "r+b") as handle:
        handle.truncate(os.path.getsize(victim) // 2)
    expect_refusal(hf_dir, os.path.basename(victim))


def test_existing_output_is_not_overwritten(converted, tmp_path):
    out = str(tmp_path / "exists")
    os.makedirs(out)
    done = cli("convert", "hf-to-mcore", "--hf", converted["llama"][0], "--out", out, check=False)
    assert done.returncode != 0 and "already exists" in done.stderr


def _die_after_writing_data(hf_dir, out):
    from megatron.core import dist_checkpointing
    from mcore_rl.conversion.hf_to_mcore import convert_hf_to_mcore
    from mcore_rl.runtime import start_process_group
    real_save = dist_checkpointing.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("killed after the tensor files were written")
    dist_checkpointing.save = save_then_die
    start_process_group(timeout_minutes=1)
    try:
        convert_hf_to_mcore(hf_dir, out)
    except KeyboardInterrupt:
        return
    raise AssertionError("conversion finished although save was interrupted")


def test_interrupted_conversion_leaves_no_checkpoint(converted, tmp_path):
    out = str(tmp_path / "out")
    run_world(1, _die_after_writing_data, converted["llama"][0], out)
    assert os.listdir(out + ".incomplete"), "the interruption came before any file was written"
    assert not os.path.exists(out) and not is_checkpoint(out + ".incomplete")
