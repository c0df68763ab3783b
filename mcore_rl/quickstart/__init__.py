"""The README's main job: SFT then GRPO on a tiny model, end to end on a laptop CPU.

    python -m mcore_rl.quickstart prepare runs/quickstart   # tiny HF Llama, tokenizer, data
    mcore-rl convert hf-to-mcore ...; mcore-rl sft ...; mcore-rl train ...   (scripts/quickstart.sh)
    python -m mcore_rl.quickstart report runs/quickstart    # accuracy before/after, files
"""
