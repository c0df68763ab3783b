"""Save and resume the complete training state of a job, atomically, so that a killed run resumes
exactly where its newest checkpoint left it (bitwise on CPU).

A step depends on more than the weights: on the Adam moments and step counters, the fp32 master
weights of the (distributed) optimizer, the LR schedule, every random generator of every rank,
and the trainer's own state (sampler position, KL controller, ...). All of it goes into one
directory per saved step:

    <root>/
      step_00000002/               a complete checkpoint
        actor/                     Megatron-Core distributed checkpoint (torch_dist) of one role:
        critic/                    {"model", "optimizer", "scheduler"}
        rng/rank_00000.pt ...      each rank's RNG states (Python, NumPy, torch CPU and CUDA,
                                   Megatron's model-parallel RNG tracker) and its own trainer
                                   state (e.g. a rollout generated ahead for the next step)
        trainer_state.pt           the trainer's `state` dict (identical on every rank)
        config.yaml                the job's configuration as the trainer passed it
        complete.json              written last: step, roles, which roles have optimizer state,
                                   the layout that saved it
      step_00000003.incomplete/    an interrupted save: ignored, removed by the next save

Atomicity: everything is written into `step_<n>.incomplete/`; after a barrier (every rank has
written its files, each fsynced) rank 0 writes `complete.json` and renames the directory, so a
directory named `step_<n>` with its marker exists only when complete. A checkpoint beyond
`keep_last` is renamed to `step_<n>.deleting` before it is deleted, so a crash mid-deletion
never leaves a partial checkpoint under a checkpoint's name.

Weights and optimizer state are Megatron's own sharded state dicts (training/megatron_state.py,
with the three Megatron-Core 0.16 code paths that need help). Megatron's keys carry the
vocabulary padded for the saving TP and the RNG states are per rank, so a resume must use the
layout that saved (checked: world size, TP, PP, EP; the CP size may change, `_without_cp`). For
layout-independent weights (export, another layout) use `weights_io`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mcore_rl.checkpoint.common_state import write_common_state_file
from mcore_rl.runtime.faults import kill_point
from mcore_rl.runtime.model_rank import ModelRank

from .megatron_state import has_state, load_role, rng_states, save_role, set_rng_states

if TYPE_CHECKING:
    from .optimizer import TrainableModel

MARKER_FILE = "complete.json"
TRAINER_STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
RNG_DIR = "rng"
FORMAT_VERSION = 1
INCOMPLETE_SUFFIX = ".incomplete"
DELETING_SUFFIX = ".deleting"
_NAME = re.compile(r"^step_(\d{8,})$")
_LEFTOVER = re.compile(r"^step_\d{8,}(\.incomplete|\.deleting)$")


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint saved after `step`."""
    return f"step_{step:08d}"


def _complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = _NAME.match(name)
        if match and os.path.isfile(os.path.join(root, name, MARKER_FILE)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under `root` (None when there is none)."""
    steps = _complete_steps(root)
    return os.path.join(os.path.abspath(root), checkpoint_name(steps[-1])) if steps else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _layout(here: ModelRank) -> dict:
    """The layout a resume must match: world size, TP, PP and, when experts are split, EP, and
    ETP when it is not TP, CP when above 1 (DP follows; dense checkpoints keep the three keys
    they always had)."""
    layout = {"world_size": _world_size(), "tensor_model_parallel_size": here.tp_size,
              "pipeline_model_parallel_size": here.pp_size}
    if here.ep_size > 1:
        layout["expert_model_parallel_size"] = here.ep_size
    if here.etp_size != here.tp_size:
        layout["expert_tensor_parallel_size"] = here.etp_size
    if here.cp_size > 1:
        layout["context_parallel_size"] = here.cp_size
    return layout


def _rng_path(directory: str, rank: int) -> str:
    return os.path.join(directory, RNG_DIR, f"rank_{rank:05d}.pt")


def _write_durably(path: str, write) -> None:
    """write(handle) into `path`, flushed to disk before returning."""
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_leftovers(root: str) -> None:
    """Delete interrupted saves and deletions (`step_*.incomplete`, `step_*.deleting`)."""
    for name in os.listdir(root):
        if _LEFTOVER.match(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _delete_checkpoint(path: str) -> None:
    """Rename away from the checkpoint name first (atomic), then delete."""
    doomed = path + DELETING_SUFFIX
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def _prune(root: str, keep_last: int) -> None:
    steps = _complete_steps(root)
    for step in steps[:max(len(steps) - keep_last, 0)]:
        _delete_checkpoint(os.path.join(root, checkpoint_name(step)))


def _publish(staging: str, final: str, marker: dict) -> None:
    """Rank 0, after every rank wrote its files: marker last, then the rename."""
    _write_durably(os.path.join(staging, MARKER_FILE),
                   lambda handle: handle.write(json.dumps(marker, indent=2).encode()))
    if os.path.exists(final):
        os.replace(final, final + DELETING_SUFFIX)
        os.replace(staging, final)
        shutil.rmtree(final + DELETING_SUFFIX)
    else:
        os.replace(staging, final)
    _fsync_directory(os.path.dirname(final))


def _raise_together(problems: list[str]) -> None:
    """Raise ValueError on every rank if any rank found a problem (each distinct message once:
    they name the checkpoint and the rule, and are usually the same on every rank)."""
    everyone = [problems]
    if dist.is_initialized():
        everyone = [None] * _world_size()
        dist.all_gather_object(everyone, list(problems))
    distinct = list(dict.fromkeys(problem for theirs in everyone for problem in theirs))
    if distinct:
        raise ValueError("; ".join(distinct))


def _agree_on_call(step: int, roles: list[str], keep_last: int, models: dict) -> dict:
    """Check that every rank saves the same step and roles; returns {role: whether its
    optimizer has state on any rank}."""
    call = (step, roles, keep_last)
    stepped = [has_state(models[role].optimizer) for role in roles]
    everyone = [(call, stepped)]
    if dist.is_initialized():
        everyone = [None] * _world_size()
        dist.all_gather_object(everyone, (call, stepped))
    problems = []
    if keep_last < 1:
        problems.append(f"save_training_state: keep_last={keep_last} must be >= 1")
    calls = [theirs for theirs, _ in everyone]
    if any(theirs != call for theirs in calls):
        problems.append(f"save_training_state: (step, roles, keep_last) differ between ranks: "
                        f"{calls}")
    _raise_together(problems)
    return {role: any(flags[index] for _, flags in everyone) for index, role in enumerate(roles)}


def save_training_state(root: str, step: int, models: dict[str, TrainableModel], state: dict,
                        config_yaml: str, keep_last: int, rank_state: dict | None = None, *,
                        place: ModelRank) -> str:
    """Collective: write the checkpoint of `step` under `root` and return its path.

    `models` maps role names ("actor", "critic") to TrainableModels laid out at `place` (this
    rank in the trained models' layout, which a resume must match); `state` is the trainer's
    state, plain data (numbers, strings, lists, dicts, tensors: read back weights-only),
    identical on every rank (rank 0's copy is written); `rank_state` is this
    rank's own picklable state (saved per rank). Each rank's RNG states
    are captured during the call, so call it where a resumed run should continue: after the
    step's updates, before anything of the next step draws random numbers. The checkpoint
    appears only when complete; afterwards only the newest `keep_last` (>= 1) complete
    checkpoints are kept, and interrupted saves under `root` are removed.
    """
    root = os.path.abspath(root)
    roles = sorted(models)
    with_optimizer = _agree_on_call(step, roles, keep_last, models)
    final = os.path.join(root, checkpoint_name(step))
    staging = final + INCOMPLETE_SUFFIX
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        _remove_leftovers(root)
        for folder in (*roles, RNG_DIR):
            os.makedirs(os.path.join(staging, folder))
    _barrier()
    kill_point("save")
    for role in roles:
        save_role(os.path.join(staging, role), models[role], with_optimizer[role])
    _write_durably(_rng_path(staging, _rank()),
                   lambda handle: torch.save({"rng": rng_states(), "rank_state": rank_state},
                                             handle))
    if _rank() == 0:
        _write_durably(os.path.join(staging, TRAINER_STATE_FILE),
                       lambda handle: torch.save(state, handle))
        _write_durably(os.path.join(staging, CONFIG_FILE),
                       lambda handle: handle.write(config_yaml.encode()))
    _barrier()
    if _rank() == 0:
        for role in roles:
            write_common_state_file(os.path.join(staging, role))
        marker = {"format_version": FORMAT_VERSION, "step": step, "roles": roles,
                  "optimizer_state": with_optimizer, "layout": _layout(place)}
        if _bases(models):
            marker["bases"] = _bases(models)
        _publish(staging, final, marker)
        _prune(root, keep_last)
    _barrier()
    return final


def read_marker(path: str) -> dict:
    """The `complete.json` of a checkpoint directory."""
    with open(os.path.join(path, MARKER_FILE)) as handle:
        marker = json.load(handle)
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}/{MARKER_FILE}: format_version {marker.get('format_version')} "
                         f"is not {FORMAT_VERSION}")
    return marker


def _bases(models: dict) -> dict:
    """The frozen base of each role that trains adapters."""
    return {role: models[role].base for role in sorted(models) if models[role].base is not None}


def compatibility_problems(path: str, marker: dict, roles: list[str], layout: dict,
                           bases: dict | None = None) -> list[str]:
    """Why the checkpoint at `path` cannot be loaded into these roles at this layout (and, for
    roles that train adapters, onto these frozen bases)."""
    name = os.path.basename(path)
    problems = []
    saved_bases = marker.get("bases", {})
    for role in sorted(set(saved_bases) | set(bases or {})):
        saved, ours = saved_bases.get(role), (bases or {}).get(role)
        if saved is None or ours is None:
            problems.append(f"{name}: its {role} trains {'adapters' if saved else 'every weight'}"
                            f", this job's {'adapters' if ours else 'every weight'}")
        elif saved.get("adapters") != ours.get("adapters"):
            problems.append(f"{name}: its {role} adapters are {saved.get('adapters')}, this "
                            f"job's are {ours.get('adapters')}")
        elif saved["fingerprint"] != ours["fingerprint"]:
            problems.append(f"{name}: its {role} adapters were trained on the base "
                            f"{saved['source']} (fingerprint {saved['fingerprint'][:12]}), this "
                            f"job's base is {ours['source']} (fingerprint "
                            f"{ours['fingerprint'][:12]}): adapters load only onto their base")
    if marker["roles"] != roles:
        problems.append(f"{name}: has roles {marker['roles']}, the trainer has {roles}")
    if _without_cp(marker["layout"]) != _without_cp(layout):
        problems.append(f"{name}: saved by layout {marker['layout']}, this job runs {layout}; a "
                        "training-state checkpoint resumes only in the layout that saved it")
    return problems


def _without_cp(layout: dict) -> dict:
    """The layout but its CP size. At the same world size, TP, PP and EP, another CP trades CP
    ranks for DP ranks: weights and every optimizer shard live on the same ranks (Megatron
    shards the distributed optimizer over DP x CP, in the same rank order), and the sampler
    hands out the same prompts per step. Only rank-local state (a rollout generated ahead for
    the old DP shards) cannot move: `_rank_state_problems`."""
    return {key: value for key, value in layout.items() if key != "context_parallel_size"}


def _rank_state_problems(path: str, marker: dict, layout: dict, rank_state) -> list[str]:
    """A rank's saved state belongs to its data shard at the CP that saved it."""
    saved_cp = marker["layout"].get("context_parallel_size", 1)
    ours = layout.get("context_parallel_size", 1)
    if saved_cp == ours or rank_state is None:
        return []
    held = ([key for key, value in rank_state.items() if value is not None]
            if isinstance(rank_state, dict) else ["rank_state"])
    if not held:
        return []
    return [f"{os.path.basename(path)}: saved at context_parallel_size={saved_cp}, this job runs "
            f"{ours}, and rank {_rank()} holds state of its old data shard ({', '.join(held)}: "
            "a rollout generated ahead, rollout.async_rollout); resume at the saved CP"]


def _agreed_latest(root: str) -> str | None:
    """Rank 0's choice of checkpoint, broadcast so that every rank loads the same one."""
    choice = [latest_checkpoint(root) if _rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def load_latest_training_state(root: str, models: dict[str, TrainableModel], *,
                               place: ModelRank) -> tuple[int, dict] | None:
    """Collective: load the newest complete checkpoint under `root` into `models` (freshly
    built at `place`, same roles and layout as when saved), restore this rank's RNG states and
    return (step, trainer state with this rank's saved `rank_state` under "rank_state"); None
    when `root` holds no complete checkpoint. The RNG states are restored last, so call it after everything that seeds or draws at start-up (initialize,
    building models and engines); training continues with step + 1."""
    path = _agreed_latest(os.path.abspath(root))
    if path is None:
        return None
    marker, layout = read_marker(path), _layout(place)
    # Not weights_only: this rank's file holds numpy's RNG state (an ndarray) and its
    # `rank_state`, a rollout generated ahead (rollout.async_rollout: our dataclasses around the
    # dataset's rows, whatever types those hold), which the weights-only unpickler refuses.
    # It is read only from a checkpoint this job's own ranks wrote under runtime.output_dir.
    per_rank = torch.load(_rng_path(path, _rank()), weights_only=False)
    _raise_together(compatibility_problems(path, marker, sorted(models), layout, _bases(models))
                    + _rank_state_problems(path, marker, layout, per_rank["rank_state"]))
    for role in sorted(models):
        load_role(os.path.join(path, role), models[role], marker["optimizer_state"][role])
    state = read_trainer_state(os.path.join(path, TRAINER_STATE_FILE))
    _barrier()
    set_rng_states(per_rank["rng"])
    return marker["step"], dict(state, rank_state=per_rank["rank_state"])


def read_trainer_state(path: str) -> dict:
    """The trainer's state saved at `path`: plain data (numbers, strings, lists, dicts,
    tensors), so it is read with the weights-only unpickler, which runs no code a crafted or
    corrupted file could carry. A state that needs more is refused, naming the file."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        raise ValueError(f"{path}: the trainer state holds objects other than tensors and plain "
                         f"containers ({found.group(1) if found else error}), which are not "
                         "unpickled: they could run code") from error
