"""How one bucket's messages travel: whole, or as the change since the copy the receiver holds.

The plan fixes every (sender, receiver) message of every bucket: which runs of which parameters
it carries, in which order. So a sender's message of bucket b to receiver r holds the same
elements at every sync, and the receiver's last copy of it is exactly what the sender sent it
last time. That makes the delta sync (``rollout.delta_sync``) a matter of messages alone:

- the sender keeps the last buffer it sent each receiver per bucket and sends the change
  (resharding/delta.py: runs, bitmask or whole, the smallest);
- the receiver keeps the last buffer it received from each sender per bucket, applies the
  change in place and hands the bucket on as before (the rollout shards are cut from these
  buffers, so the engine gets whole shards, bitwise what a full sync gives, whatever it did
  with its weights meanwhile: a restart, a sleep that discarded them, a repack);
- a full sync (no copies yet, or every ``anchor_every``-th sync) sends whole buffers, so a
  resumed or restarted run starts with one by construction.

Message sizes differ per sync, so a delta bucket takes two rounds: fixed-size headers (form,
runs, changed elements, and with ``verify`` a checksum per parameter segment), then payloads of
the sizes the headers announced. Reading the headers is one host synchronisation per bucket.
With ``verify`` the receiver checks every segment of every rebuilt buffer against the sender's
checksum and names the tensor whose rows differ; the Resharder then has every rank agree and
resends everything whole.

The copies cost memory on the transport's device: a rank holds what it sent plus what it
received in one full sync (the resharder's lower bound on the receiving side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.transport import Transport
from .delta import (HEADER_LENGTH, apply_delta, checksums, encode_delta, from_wire, full_delta,
                    header, to_wire, wire_bytes)

Segment = tuple[str, int]
"""A parameter's run inside a message: (what to call it in an error, elements)."""


@dataclass(frozen=True)
class DeltaOptions:
    """How a delta sync runs (rollout.delta_sync_*)."""

    anchor_every: int
    """Every this many syncs a full one (the first sync is always full)."""
    verify: bool
    """Check a checksum per parameter segment on the receiving side."""


class WholeMessages:
    """Every message whole, in one round (the plain sync)."""

    verifies = False

    def __init__(self, transport: Transport, dtype: torch.dtype):
        self.transport = transport
        self.dtype = dtype
        self.received_bytes = 0
        """Bytes this rank received since `start`."""
        self.mismatches: list[str] = []

    def start(self) -> None:
        """A sync begins."""
        self.received_bytes = 0

    def post(self, index: int, receives: dict[int, list[Segment]],
             sends: dict[int, tuple[torch.Tensor, list[Segment]]]) -> tuple:
        """Start bucket `index`'s exchange: receive each sender's segments, send each packed
        buffer to its receiver."""
        buffers = {src: torch.empty(_elements(segments), dtype=self.dtype,
                                    device=self.transport.device)
                   for src, segments in sorted(receives.items())}
        self.received_bytes += sum(b.numel() * b.element_size() for b in buffers.values())
        packed = {dst: tensor for dst, (tensor, _) in sorted(sends.items())}
        return self.transport.post(buffers, packed, index), buffers, packed

    def wait(self, pending: tuple) -> dict[int, torch.Tensor]:
        """Sender -> the whole buffer it sent, once the bucket's exchange completed."""
        handles, buffers, _ = pending
        for handle in handles:
            handle.wait()
        return buffers


class DeltaMessages(WholeMessages):
    """Messages as changes since the copies both ends hold (see the module docstring)."""

    def __init__(self, transport: Transport, dtype: torch.dtype, options: DeltaOptions):
        super().__init__(transport, dtype)
        if options.anchor_every < 1:
            raise ValueError(f"anchor_every={options.anchor_every} must be >= 1")
        self.options = options
        self.verifies = options.verify
        self._sent: dict[tuple[int, int], torch.Tensor] = {}
        """(bucket, receiver) -> the buffer last sent."""
        self._held: dict[tuple[int, int], torch.Tensor] = {}
        """(bucket, sender) -> the buffer last received, changes applied."""
        self._syncs = 0
        """Syncs since the copies were last forgotten (the same count on every rank)."""
        self.full = True
        """Whether the current sync sends whole buffers."""

    def start(self) -> None:
        super().start()
        self._begin()

    def resend_whole(self) -> None:
        """Drop every copy and begin the sync again, full (every rank together, after a
        mismatch); the bytes keep counting."""
        self._sent.clear()
        self._held.clear()
        self._syncs = 0
        self._begin()

    def _begin(self) -> None:
        self.full = self._syncs % self.options.anchor_every == 0
        self._syncs += 1
        self.mismatches = []

    def post(self, index, receives, sends):
        deltas = {dst: self._encode(index, dst, tensor) for dst, (tensor, _) in sends.items()}
        headers = self._exchange_headers(index, receives, sends, deltas)
        wires = {dst: to_wire(delta) for dst, delta in sorted(deltas.items()) if delta.nbytes}
        buffers = {}
        for src, segments in sorted(receives.items()):
            size = wire_bytes(headers[src][:HEADER_LENGTH], _elements(segments), self.dtype)
            if size:
                buffers[src] = torch.empty(size, dtype=torch.uint8, device=self.transport.device)
        self.received_bytes += sum(buffer.numel() for buffer in buffers.values())
        return (self.transport.post(buffers, wires, 2 * index), buffers, wires, index, receives,
                headers)

    def wait(self, pending):
        handles, buffers, _, index, receives, headers = pending
        for handle in handles:
            handle.wait()
        held = {}
        nothing = torch.empty(0, dtype=torch.uint8, device=self.transport.device)
        for src, segments in sorted(receives.items()):
            delta = from_wire(headers[src][:HEADER_LENGTH], _elements(segments), self.dtype,
                              buffers.get(src, nothing))
            held[src] = self._apply(index, src, delta)
            if self.verifies:
                self._verify(held[src], segments, headers[src][HEADER_LENGTH:], src)
        return held

    # ----------------------------------------------------------------------------------------

    def _encode(self, index: int, dst: int, tensor: torch.Tensor):
        previous = None if self.full else self._sent.get((index, dst))
        self._sent[(index, dst)] = tensor
        return full_delta(tensor) if previous is None else encode_delta(previous, tensor)

    def _exchange_headers(self, index, receives, sends, deltas) -> dict[int, list[int]]:
        """Sender -> its header for this rank, after one blocking round."""
        device = self.transport.device
        outgoing = {}
        for dst, delta in sorted(deltas.items()):
            values = torch.tensor(header(delta), dtype=torch.int64, device=device)
            if self.verifies:
                tensor, segments = sends[dst]
                values = torch.cat([values, checksums(tensor, [n for _, n in segments])])
            outgoing[dst] = values
        incoming = {src: torch.empty(HEADER_LENGTH + (len(segments) if self.verifies else 0),
                                     dtype=torch.int64, device=device)
                    for src, segments in sorted(receives.items())}
        for handle in self.transport.post(incoming, outgoing, 2 * index + 1):
            handle.wait()
        self.received_bytes += sum(values.numel() * 8 for values in incoming.values())
        return {src: values.tolist() for src, values in incoming.items()}

    def _apply(self, index: int, src: int, delta) -> torch.Tensor:
        if delta.kind == "full":
            self._held[(index, src)] = delta.parts[0]
        elif (index, src) not in self._held:
            raise RuntimeError(f"bucket {index}: rank {src} sent a change but this rank holds "
                               "no copy to apply it to (the ranks disagree on the sync count)")
        else:
            apply_delta(self._held[(index, src)], delta)
        return self._held[(index, src)]

    def _verify(self, rebuilt: torch.Tensor, segments: list[Segment], expected: list[int],
                src: int) -> None:
        found = checksums(rebuilt, [n for _, n in segments]).tolist()
        self.mismatches += [f"{label} (from rank {src}) differs from the trainer's"
                            for (label, _), mine, theirs in zip(segments, found, expected)
                            if mine != theirs]


def _elements(segments: list[Segment]) -> int:
    return sum(count for _, count in segments)
