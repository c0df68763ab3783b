"""Serving a trained model: vLLM's OpenAI-compatible server plus the seed's /generate."""

from .server import serve

__all__ = ["serve"]
