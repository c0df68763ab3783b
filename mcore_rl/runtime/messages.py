"""Python objects between the two sides of split placement (runtime/worlds.py).

Scored batches go from rollout ranks to trainer ranks as pickled bytes in uint8 tensors over a
gloo group spanning the job: they stay in host memory and never queue behind the weights on
the (NCCL) bridge. A send is posted and not waited for (`Outbox`): the rollout side goes on
generating while the trainers have not asked for the batch yet; gloo delivers it when the
receiver posts its receive, and the receive's wait is bounded by the group's timeout.

Control messages go the other way (new weights are coming, evaluate, stop) through the job's
rendezvous store instead (`ControlBoard`): the rollout side must be able to look for one
between two engine steps without blocking, and a store key can be checked where a posted
receive cannot be taken back.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time

import torch
import torch.distributed as dist

HEADER_TAG = 71
PAYLOAD_TAG = 72
FAILURE_POLL_SECONDS = 0.02


class Outbox:
    """Non-blocking sends of Python objects over a gloo group; per destination, objects arrive
    in the order they were sent."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._in_flight: list[tuple[list, torch.Tensor, torch.Tensor]] = []
        """Posted sends with the buffers they read from (kept alive until they complete)."""

    def send(self, message, destination: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        header = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [self.group.send([header], destination, HEADER_TAG),
                 self.group.send([payload], destination, PAYLOAD_TAG)]
        self._in_flight.append((works, header, payload))
        self._in_flight = [entry for entry in self._in_flight
                           if not all(work.is_completed() for work in entry[0])]

    def flush(self) -> None:
        """Wait until every message sent has been received."""
        for works, _, _ in self._in_flight:
            for work in works:
                work.wait()
        self._in_flight = []


def receive_object(group: dist.ProcessGroup, source: int, failure: "FailureNotice | None" = None):
    """The next object `source` sent to this rank over `group` (blocks, bounded by the group's
    timeout). With `failure`, the receive runs in a thread while this one watches the notice,
    and a failure the other side reports is raised at once, in place of the message (a posted
    gloo receive cannot be polled or taken back)."""
    if failure is None:
        return _receive(group, source)
    outcome = []
    receiver = threading.Thread(target=_receive_into, args=(outcome, group, source),
                                name="mcore_rl-receive", daemon=True)
    receiver.start()
    deadline = time.monotonic() + failure.timeout.total_seconds()
    while receiver.is_alive():
        failure.raise_if_reported()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no message from rank {source} within {failure.timeout}")
        receiver.join(FAILURE_POLL_SECONDS)
    if isinstance(outcome[0], BaseException):
        failure.raise_if_reported()  # the other side's own error explains the broken link
        raise outcome[0]
    return outcome[0]


def _receive(group: dist.ProcessGroup, source: int):
    header = torch.empty(1, dtype=torch.int64)
    group.recv([header], source, HEADER_TAG).wait()
    payload = torch.empty(int(header.item()), dtype=torch.uint8)
    group.recv([payload], source, PAYLOAD_TAG).wait()
    return pickle.loads(payload.numpy().tobytes())


def _receive_into(outcome: list, group: dist.ProcessGroup, source: int) -> None:
    try:
        outcome.append(_receive(group, source))
    except BaseException as error:  # handed to the waiting thread
        outcome.append(error)


class FailureNotice:
    """A rank's error ("rollout rank 3 failed: ..."), left on the job's store for the other
    side: a rank blocked in a receive from a rank that died looks here while it waits, and ends
    with that error instead of waiting out the timeout (and under launchers that do not kill
    the other ranks, srun --kill-on-bad-exit=0, instead of hanging until then)."""

    KEY = "mcore_rl/failed"

    def __init__(self, store: dist.Store, timeout: datetime.timedelta):
        self.store = store
        self.timeout = timeout
        """How long a receive waits for its message when no failure is reported."""

    def report(self, text: str) -> None:
        """Leave `text` unless an earlier failure is there already (the first is the cause)."""
        if not self.store.check([self.KEY]):
            self.store.set(self.KEY, text.encode())

    def wait_for_keys(self, store: dist.Store, keys: list[str]) -> None:
        """Wait until every key is in `store`, raising a reported failure at once."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not store.check(keys):
            self.raise_if_reported()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other side did not set {keys} within {self.timeout}")
            time.sleep(FAILURE_POLL_SECONDS)

    def raise_if_reported(self) -> None:
        if self.store.check([self.KEY]):
            raise RuntimeError(f"stopping: {self.store.get(self.KEY).decode()}")


class ControlBoard:
    """Numbered messages from one writer to one reader through a store: the writer posts, the
    reader polls (non-blocking) or waits, in order; each message is deleted once read."""

    def __init__(self, store: dist.Store, timeout: datetime.timedelta):
        self.store = store
        self.timeout = timeout
        self._posted = 0
        self._read = 0

    def post(self, message) -> None:
        self.store.set(f"message/{self._posted}", pickle.dumps(message))
        self._posted += 1

    def poll(self):
        """The next message, or None when it has not been posted yet."""
        if not self.store.check([self._key()]):
            return None
        return self._take()

    def wait(self):
        """The next message; raises when none comes within the timeout."""
        try:
            self.store.wait([self._key()], self.timeout)
        except RuntimeError as error:  # the store's timeout
            raise TimeoutError(f"no control message from the trainer ranks within "
                               f"{self.timeout} ({error})") from error
        return self._take()

    def _key(self) -> str:
        return f"message/{self._read}"

    def _take(self):
        key = self._key()
        message = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        self._read += 1
        return message
