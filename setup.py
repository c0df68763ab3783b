"""mcore_rl: RL post-training (PPO, GRPO and relatives) for LLMs on Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="mcore_rl",
    version="0.1.0",
    description="Reinforcement-learning post-training for LLMs on Megatron-Core, SPMD with vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mcore_rl", "mcore_rl.*"]),
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "safetensors",
        "transformers",
        "sentencepiece",
        "tensorboard",
        "tqdm",
        "omegaconf>=2.3",
        "pyyaml",
        "psutil",
        "pyarrow",
        "math-verify",
        "reasoning-gym",
        "cloudpickle",  # the user's script's own functions and classes reach the sandbox by value
    ],
    extras_require={
        # peft: the LoRA reference; openai-agents, langchain: agents through the endpoint
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "peft", "openai-agents",
                 "langchain", "langchain-openai"],
        "bench": ["locust>=2.40"],  # bench/serve_load.py
        "vllm": ["vllm>=0.32,<0.33"],  # mcore_rl.rollout.vllm_start.SUPPORTED_VLLM
        "te": ["transformer-engine[pytorch]"],
        "wandb": ["wandb>=0.31,<0.32"],  # trainer.wandb_project
        "agents": ["fastapi", "uvicorn", "openai"],  # rollout.multi_turn.agent
    },
    entry_points={
        "console_scripts": ["mcore-rl=mcore_rl.__main__:main"],
        # /generate on vLLM's OpenAI server; `mcore-rl serve` allow-lists it in VLLM_PLUGINS.
        "vllm.endpoint_plugins": ["mcore_rl_generate=mcore_rl.serve.generate_route:GenerateEndpoint"],
    },
)
