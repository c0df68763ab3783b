"""`mcore-rl serve` as a client sees it: one real server process (vLLM's OpenAI server on CPU)
serving an mcore_rl weights checkpoint (converted on the fly), with an API key, asked with a
real HTTP client and the OpenAI client. Generations are checked against HF transformers on the
same weights; every bad request must get a 4xx naming what was wrong, and the server must
answer the next good request; SIGTERM must stop it and remove the conversion."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
import transformers

from hf_models import write_tokenizer
from world import free_port

API_KEY = "test-key"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w7 {% endif %}")
"""Word-level tokens only: the test tokenizer knows nothing else."""


def _write_model(folder: str) -> None:
    """A random Llama vLLM's CPU attention takes (head_dim 64), weights spread wide enough that
    greedy decoding has no near-ties, a word-level tokenizer and a chat template."""
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn_like(param))
    model.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size)
    with open(os.path.join(folder, "tokenizer_config.json")) as handle:
        tokenizer_config = json.load(handle)
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as handle:
        json.dump(tokenizer_config, handle)


class Server:
    def __init__(self, process, base_url, name, hf_folder, scratch_before):
        self.process, self.base_url, self.name = process, base_url, name
        self.hf_folder, self.scratch_before = hf_folder, scratch_before

    def post(self, path: str, key: str | None = API_KEY, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.base_url + path, headers=headers, timeout=120, **kwargs)


def _scratch_folders() -> set[str]:
    """The server's scratch folders: in its private temporary folder (process_guard)."""
    from mcore_rl.runtime.process_guard import TEMP_PREFIX, system_temp_dir

    return set(glob.glob(os.path.join(system_temp_dir(), f"{TEMP_PREFIX}*",
                                      "mcore_rl_serve_*")))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    hf_folder, checkpoint = str(root / "hf"), str(root / "ckpt")
    _write_model(hf_folder)
    # vLLM's server as a CPU user would start it, without compiling the model (eager) or its
    # sampler's ops (inductor builds C++ per process: minutes of compiler for microseconds)
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1",
               TORCHDYNAMO_DISABLE="1")
    subprocess.run([sys.executable, "-m", "mcore_rl", "convert", "hf-to-mcore", "--hf", hf_folder,
                    "--out", checkpoint], check=True, env=env, capture_output=True)
    port = free_port()
    scratch_before = _scratch_folders()
    log = open(root / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl", "serve", checkpoint, "--port", str(port),
         "--api-key", API_KEY, "--dtype", "float32", "--max-model-len", "64", "--enforce-eager",
         "--max-body-mb", "1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert process.poll() is None, (root / "server.log").read_text()[-3000:]
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(1)
    else:
        process.kill()
        pytest.fail("the server did not become healthy in 240 s")
    yield Server(process, base_url, checkpoint, hf_folder, scratch_before)
    if process.poll() is None:
        process.kill()
    log.close()


def _hf_greedy_words(folder: str, prompt: str, new_tokens: int) -> list[str]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return tokenizer.convert_ids_to_tokens(out[0, ids.shape[1]:].tolist())


def test_generate_and_completions_equal_transformers_greedy(server):
    prompt = "w11 w42 w99 w5"
    expected = _hf_greedy_words(server.hf_folder, prompt, 8)
    seed_shape = server.post("/generate", json={"prompt": prompt, "max_tokens": 8})
    assert seed_shape.status_code == 200, seed_shape.text
    assert seed_shape.json()["response"].split() == expected
    completion = server.post("/v1/completions", json={
        "model": server.name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "min_tokens": 8})
    assert completion.json()["choices"][0]["text"].split() == expected


def test_openai_client_chat_uses_the_tokenizers_template(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY)
    assert [model.id for model in client.models.list()] == [server.name]
    messages = [{"role": "user", "content": "w20 w21"}, {"role": "user", "content": "w22"}]
    reply = client.chat.completions.create(model=server.name, messages=messages, max_tokens=4,
                                           temperature=0)
    templated = transformers.AutoTokenizer.from_pretrained(server.hf_folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert reply.usage.prompt_tokens == len(templated) == 4
    assert reply.choices[0].message.content.split()  # the model answered


BAD_REQUESTS = [
    # (path, body or raw bytes, expected status, text the error must contain)
    ("/generate", {"prompt": ""}, 400, "prompt"),
    ("/generate", {"prompt": "w5 " * 80}, 400, "maximum context length"),
    ("/generate", {"prompt": "w5", "max_tokens": -1}, 400, "max_tokens"),
    ("/generate", {"prompt": "w5", "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("/generate", {"prompt": 5}, 400, "prompt"),
    ("/generate", {"prompt": "w5", "max_token": 3}, 400, "max_token"),
    ("/generate", b"{not json", 400, "JSON"),
    ("/generate", b"x" * (2 * 1024 ** 2), 413, "body"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "w5"}, 404, "no-such-model"),
    ("/v1/completions", {"model": None, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": None, "prompt": "w5", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": None, "messages": "w5"}, 400, "messages"),
    ("/v1/completions", b"x" * (2 * 1024 ** 2), 413, "body"),
]


@pytest.mark.parametrize("path,body,status,names", BAD_REQUESTS,
                         ids=[f"{path}-{index}" for index, (path, *_) in
                              enumerate(BAD_REQUESTS)])
def test_bad_request_gets_a_4xx_naming_the_field_and_the_server_lives_on(
        server, path, body, status, names):
    if isinstance(body, dict) and "model" in body and body["model"] is None:
        body = dict(body, model=server.name)
    kwargs = {"json": body} if isinstance(body, dict) else {
        "content": body, "headers": {"content-type": "application/json"}}
    if "headers" in kwargs:
        kwargs["headers"]["Authorization"] = f"Bearer {API_KEY}"
        response = httpx.post(server.base_url + path, timeout=120, **kwargs)
    else:
        response = server.post(path, **kwargs)
    assert response.status_code == status, response.text
    assert names.lower() in response.text.lower()
    assert server.post("/generate", json={"prompt": "w5", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_api_key_is_refused(server, path, key):
    response = server.post(path, key=key, json={"model": server.name, "prompt": "w5"}
                           if path != "/generate" else {"prompt": "w5"})
    assert response.status_code == 401, response.text
    assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key


def test_sigterm_stops_the_server_and_removes_the_conversion(server):
    created = _scratch_folders() - server.scratch_before
    assert len(created) == 1  # the checkpoint was converted into a temporary folder
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout=60)
    assert not any(os.path.exists(folder) for folder in created)
