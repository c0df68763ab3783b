"""The bytes between the rank and a session: framing, and what the rank may unpickle.

The rank only ever unpickles plain data from a session (`load_plain_data`): code running in a
session must not be able to run code in the rank through a crafted pickle, nor stall it with
half a message (the rank reads sessions without blocking: `_Channel`). A session checks its own
replies the same way before sending them (session.py), so that a value that is not plain data
is an error its caller reads rather than a broken protocol.
"""

from __future__ import annotations

import io
import pickle
import select
import socket
import struct
import time
from typing import Any


MAX_MESSAGE_BYTES = 64 << 20
"""Largest reply a session may send; a larger one ends the session."""

SEND_TIMEOUT_SECONDS = 5.0
"""How long sending a request may block (a session that stops reading its channel is ended)."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Loads only what pickles without naming a class or function (None, bool, int, float, str,
    bytes, list, tuple, dict, set): unpickling anything else runs code chosen by whoever wrote
    the bytes, and a session's bytes may have been written by the code it runs."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def load_plain_data(message: bytes) -> Any:
    """Unpickle `message`, refusing anything but plain data (pickle.UnpicklingError)."""
    return _PlainDataUnpickler(io.BytesIO(message)).load()


class _Channel:
    """The rank's end of a session's socket. Messages are framed as multiprocessing's Connection
    frames them (4-byte big-endian length, then the bytes; the session uses a Connection), but
    are read without blocking, so a session that sends half a message cannot stall the rank."""

    def __init__(self, end: socket.socket):
        end.setblocking(False)
        self.socket = end
        self.received = bytearray()

    def fileno(self) -> int:
        return self.socket.fileno()

    def send(self, message: bytes) -> bool:
        """Send one message, blocking at most SEND_TIMEOUT_SECONDS; False: it could not."""
        pending = memoryview(struct.pack("!i", len(message)) + message)
        deadline = time.monotonic() + SEND_TIMEOUT_SECONDS
        while pending:
            try:
                pending = pending[self.socket.send(pending):]
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([], [self.socket], [], remaining)[1]:
                    return False
            except OSError:
                return False
        return True

    def receive(self) -> tuple[list[bytes], bool]:
        """(the complete messages that arrived, whether the session closed its end). Raises
        ValueError for a message over MAX_MESSAGE_BYTES."""
        closed = False
        while True:
            try:
                chunk = self.socket.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                closed = True
                break
            self.received += chunk
        messages = []
        while len(self.received) >= 4:
            (size,) = struct.unpack("!i", self.received[:4])
            if not 0 <= size <= MAX_MESSAGE_BYTES:
                raise ValueError(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
            if len(self.received) < 4 + size:
                break
            messages.append(bytes(self.received[4:4 + size]))
            del self.received[:4 + size]
        return messages, closed

    def close(self) -> None:
        self.socket.close()
