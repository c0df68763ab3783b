"""A torch_dist checkpoint that every supported Megatron-Core release loads.

A checkpoint's common state (what is not sharded: the scheduler's, the optimizer's parameter
groups, ...) is `common.pt` beside the shards up to Megatron-Core 0.16; from 0.17 on it is a
"common_state" object inside the shards, and common.pt is read only when present (as legacy).
0.16 has no other place to look, so a checkpoint written by a newer release gets the same state
written to common.pt too: then 0.16.1 and 0.19.2 both load what either wrote
(tests/test_megatron_versions.py).
"""

from __future__ import annotations

import os

import torch

COMMON_STATE_FILE = "common.pt"
"""Megatron-Core's COMMON_STATE_FNAME, where 0.16 reads the common state from."""


def write_common_state_file(directory: str) -> None:
    """On one rank, after every rank's `dist_checkpointing.save` into `directory`: write the
    common state to common.pt where the release kept it only inside the shards."""
    path = os.path.join(directory, COMMON_STATE_FILE)
    if os.path.exists(path):
        return
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    common = load_common_state_dict(directory)
    staging = path + ".incomplete"
    with open(staging, "wb") as handle:
        torch.save(common, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)
