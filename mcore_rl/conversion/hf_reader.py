"""Lazy, validated access to an HF checkpoint folder (config.json + safetensors).

Tensors are read one at a time through safetensors' memory-mapped `safe_open`, so a converter
holds at most the tensors it is working on. Every file is opened and its header checked before
any work starts: a truncated or corrupt file, or an index naming a missing file, fails with the
file's name instead of half-way through a conversion.
"""

from __future__ import annotations

import json
import os
from functools import cached_property

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpoint:
    """An HF model folder: `config` (dict), `names` (tensor names) and `tensor(name)`."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"HF checkpoint folder not found: {self.path}")
        self.config = self._read_config()
        self._file_of = self._tensor_files()
        self._check_files()

    def _read_config(self) -> dict:
        path = os.path.join(self.path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: not an HF checkpoint folder")
        try:
            with open(path) as handle:
                return json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON: {error}") from None

    def _tensor_files(self) -> dict[str, str]:
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as handle:
                weight_map = json.load(handle).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' object")
            return {name: os.path.join(self.path, file) for name, file in weight_map.items()}
        single = os.path.join(self.path, SINGLE_FILE)
        if os.path.isfile(single):
            with _open(single) as handle:
                return {name: single for name in handle.keys()}
        found = sorted(os.listdir(self.path))
        raise FileNotFoundError(f"{self.path} has neither {INDEX_FILE} nor {SINGLE_FILE} "
                                f"(only safetensors checkpoints are supported); found {found}")

    def _check_files(self) -> None:
        for file in sorted(set(self._file_of.values())):
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{file} is named by {INDEX_FILE} but does not exist")
            with _open(file) as handle:
                missing = [n for n, f in self._file_of.items() if f == file and
                           n not in handle.keys()]
            if missing:
                raise ValueError(f"{file} lacks tensors its index assigns to it: {missing[:5]}")

    @cached_property
    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return sorted(self._file_of)

    def shape(self, name: str) -> tuple:
        """A tensor's shape from the file header, without reading its data."""
        self._require(name)
        with safe_open(self._file_of[name], framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def _require(self, name: str) -> None:
        if name not in self._file_of:
            raise KeyError(f"tensor '{name}' is not in the HF checkpoint {self.path}")

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (a copy, detached from the memory map)."""
        self._require(name)
        file = self._file_of[name]
        try:
            with safe_open(file, framework="pt") as handle:
                return handle.get_tensor(name).clone()
        except (SafetensorError, OSError, RuntimeError) as error:
            raise ValueError(f"{file}: cannot read tensor '{name}': {error}") from None


def _open(file: str):
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError, RuntimeError) as error:
        raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt?): "
                         f"{error}") from None
