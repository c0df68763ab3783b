"""mcore_rl: RL post-training of LLMs on Megatron-Core.

    from mcore_rl import Trainer, make_trainer_config

The names are resolved on first use, so `import mcore_rl` stays cheap (no torch, no Megatron).
"""

__all__ = ["Trainer", "make_trainer_config"]


def __getattr__(name: str):
    if name in __all__:
        from . import rl

        return getattr(rl, name)
    raise AttributeError(f"module 'mcore_rl' has no attribute {name!r}")
