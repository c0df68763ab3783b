"""Point-to-point transports: how a rank posts the sends and receives of one exchange round.

The resharder's messages go either over the default process group (colocated placement: the
trainer and the engine share every rank) or over the bridge between the two rank sets of split
placement (runtime/worlds.py), whose group is not the default world's: torch.distributed's
module-level calls (`batch_isend_irecv`, `all_gather_object`) refuse a group that was not
created through it, so the bridge speaks the group object's own API.

A transport also lets the ranks agree on a failure before anything moves (runtime/agreement.py
over the default world; the rendezvous store over the bridge).
"""

from __future__ import annotations

import json
from typing import Protocol

import torch
import torch.distributed as dist

from .agreement import raise_gathered, raise_on_any_rank
from .devices import collective_device
from .messages import FailureNotice


class Transport(Protocol):
    rank: int
    """This process's rank among the transport's ranks."""

    size: int
    """Ranks the transport connects."""

    device: torch.device
    """Where message buffers must live (the GPU for NCCL, the CPU for gloo)."""

    def post(self, receives: dict[int, torch.Tensor], sends: dict[int, torch.Tensor],
             tag: int) -> list:
        """Start receiving into each buffer from its peer and sending each tensor to its peer;
        returns handles whose `wait()` completes them."""

    def agree(self, problems: list[str], error_type: type[Exception], prefix: str) -> None:
        """Raise the same error on every rank if any rank found a problem."""


class WorldTransport:
    """The default process group. One batched call per round: NCCL deadlocks on two ranks
    that exchange through separate irecv/isend calls (gloo does not)."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.device = collective_device()

    def post(self, receives, sends, tag):
        ops = [dist.P2POp(dist.irecv, buffer, peer, tag=tag) for peer, buffer in receives.items()]
        ops += [dist.P2POp(dist.isend, tensor, peer, tag=tag) for peer, tensor in sends.items()]
        return dist.batch_isend_irecv(ops) if ops else []

    def agree(self, problems, error_type, prefix):
        raise_on_any_rank(problems, error_type, prefix)


class BridgeTransport:
    """A process group spanning both rank sets of split placement, used through its own
    send/recv. In split placement every message goes one way (trainer ranks send, rollout
    ranks receive), so no two ranks exchange in both directions and separate calls cannot
    deadlock under NCCL."""

    def __init__(self, group, store: dist.Store, failure: FailureNotice | None = None):
        self.group = group
        self.store = store
        """The bridge's rendezvous store (a PrefixStore of the job's), for agreement."""
        self.failure = failure
        """Looked at while waiting for the other ranks' agreement (a failed rank never
        arrives)."""
        self.rank = group.rank()
        self.size = group.size()
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if group.name().lower() == "nccl" else torch.device("cpu"))
        self._rounds = 0

    def post(self, receives, sends, tag):
        handles = [self.group.recv([buffer], peer, tag) for peer, buffer in receives.items()]
        return handles + [self.group.send([tensor], peer, tag) for peer, tensor in sends.items()]

    def agree(self, problems, error_type, prefix):
        """Every rank writes its problems under this round's key and reads everyone's (the
        store's timeout bounds the wait for a rank that never arrives). A rank in round r has
        every peer past round r - 2, so it deletes its own key of that round."""
        self._rounds += 1
        keys = [f"agree/{self._rounds}/{rank}" for rank in range(self.size)]
        if self._rounds > 2:
            self.store.delete_key(f"agree/{self._rounds - 2}/{self.rank}")
        self.store.set(keys[self.rank], json.dumps(problems))
        self._wait_for(keys)
        gathered = {rank: json.loads(self.store.get(key)) for rank, key in enumerate(keys)}
        if any(gathered.values()):
            # Every rank raises and may exit. The job's store lives in rank 0's process (under
            # torchrun: in its agent), which must not go before every rank has read from it.
            read = [f"{key}/read" for key in keys]
            self.store.set(read[self.rank], "1")
            if self.rank == 0:
                self._wait_for(read)
        raise_gathered(gathered, error_type, prefix)

    def _wait_for(self, keys: list[str]) -> None:
        if self.failure is None:
            self.store.wait(keys)
        else:
            self.failure.wait_for_keys(self.store, keys)
