"""How outputs get from the engine thread to the event loop: ``AsyncSink`` is called on the engine
thread once per step, queues the outputs and wakes the event loop through a pipe it watches; the
event loop routes them to each request's queue (``Request.context``)."""
from __future__ import annotations

import asyncio
import collections
import ctypes
import operator
import os
from typing import Callable

from ..request import SeqOutput, grouped

__all__ = ["AsyncSink"]

_CONTEXT = operator.attrgetter("request.context")     # the queue of the request's HTTP handler


def _gil_holding_write() -> Callable[[int], None]:
    """``write(fd, "\\0", 1)`` without releasing the GIL (libc through ctypes.PyDLL).

    Waking the event loop with ``call_soon_threadsafe`` sends on a socket, which releases the GIL:
    the event loop thread wakes, takes the GIL and keeps it for all of its Python work (every
    stream's chunks), and the engine thread waits that long before it can start the next forward
    call. Writing with the GIL held lets the engine thread go on into the forward call, which
    releases the GIL; the event loop then does its work while the library computes."""
    try:
        write = ctypes.PyDLL(None).write
        write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        write.restype = ctypes.c_ssize_t
        return lambda fd: write(fd, b"\0", 1) and None     # a full pipe (EAGAIN) already means "wake"
    except (OSError, AttributeError):                        # no libc symbols: the plain way
        def plain(fd: int) -> None:
            try:
                os.write(fd, b"\0")
            except BlockingIOError:
                pass
        return plain


_wake_fd = _gil_holding_write()


class AsyncSink:
    """Called on the engine thread once per step: queues the outputs and wakes the event loop
    (through a pipe it watches), which routes them to per-request queues."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: collections.deque[list[SeqOutput]] = collections.deque()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        loop.add_reader(self._read_fd, self._drain)
        self.closed = False

    def __call__(self, outs: list[SeqOutput]) -> None:
        if not self.closed:
            self.pending.append(outs)
            _wake_fd(self._write_fd)

    def _drain(self) -> None:
        try:
            os.read(self._read_fd, 65536)
        except BlockingIOError:
            pass
        while self.pending:
            self._route(self.pending.popleft())

    def close(self) -> None:
        self.closed = True
        self.loop.remove_reader(self._read_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)

    @staticmethod
    def _route(outs: list[SeqOutput]) -> None:
        for queue, batch in grouped(outs, _CONTEXT):
            queue.put_nowait(batch)
