"""Fair shares between clients: one client (a peer address) cannot take every text thread or
grammar compiler, nor push everyone else's requests behind all of its own.

``CLIENT`` holds the peer address of the request being handled (set once per request by the
server's ASGI layer). ``ClientShares`` lets each client run at most ``per_client`` jobs of one kind
at a time while another client has jobs too (its further jobs wait their turn behind its own, not
in front of others'; alone, it may use every thread); the
scheduler ranks a client's new sequences after the ones it already has in flight
(``Request.client``, scheduler.py), so a bystander's request is admitted before a greedy
client's backlog, and ``AdmissionShare`` holds a client past its share of the running slots while
another waits. Behind a proxy every request has the proxy's address and these shares are one.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

CLIENT: ContextVar[str | None] = ContextVar("infeng_client", default=None)


class ClientsInFlight:
    """The clients with a request in flight (the server's ASGI layer enters and leaves them)."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}

    @contextmanager
    def request(self, client: str) -> Iterator[None]:
        _count(self.requests, client, 1)
        try:
            yield
        finally:
            _count(self.requests, client, -1)


class ClientShares:
    """Turns at ``capacity`` jobs of one kind (the threads that run them): while another client
    holds or waits for a turn, or has a request in flight (``in_flight``: it may need a turn at any
    moment, between its jobs), each client runs at most ``per_client`` jobs at a time; a client
    alone may use every one (a single client, a proxy or a benchmark, keeps the whole throughput).
    ``acquire`` waits for a turn and returns its release; the caller releases it when the job's
    thread is done (not when the request gives up on it: a job past its budget still holds a turn).
    A client's waiting jobs take their turns in the order they came."""

    def __init__(self, per_client: int = 1, capacity: int = 1, in_flight: ClientsInFlight | None = None):
        self.per_client = per_client
        self.in_flight = in_flight or ClientsInFlight()
        self.capacity = max(capacity, per_client)
        self._running: dict[str, int] = {}
        self._waiting: dict[str, int] = {}
        self._wakers: list[asyncio.Future] = []

    def _may_run(self, client: str) -> bool:
        running = self._running.get(client, 0)
        if running < self.per_client:
            return True
        alone = all(c == client for counts in (self._running, self._waiting, self.in_flight.requests)
                    for c in counts)
        return alone and running < self.capacity

    async def acquire(self, client: str | None) -> Callable[[], None]:
        if client is None:
            return _nothing
        _count(self._waiting, client, 1)
        try:
            while not self._may_run(client):
                waker = asyncio.get_running_loop().create_future()
                self._wakers.append(waker)
                try:
                    await waker
                finally:
                    if waker in self._wakers:
                        self._wakers.remove(waker)
        finally:
            _count(self._waiting, client, -1)
            self._wake()                       # a client that stops waiting may lift another's cap
        _count(self._running, client, 1)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                _count(self._running, client, -1)
                self._wake()
        return release

    @property
    def _held(self) -> dict[str, int]:
        """Clients with a job running or waiting (empty when every turn was given back)."""
        return {c: self._running.get(c, 0) + self._waiting.get(c, 0) for c in {*self._running, *self._waiting}}

    def _wake(self) -> None:
        wakers, self._wakers = self._wakers, []
        for waker in wakers:
            if not waker.done():
                waker.set_result(None)


def _count(counts: dict[str, int], client: str, change: int) -> None:
    left = counts.get(client, 0) + change
    if left:
        counts[client] = left
    else:
        counts.pop(client, None)


def _nothing() -> None:
    pass


class AdmissionShare:
    """One admission round's fair share: while another client has sequences waiting, no client is
    admitted past ``max(1, max_seqs // clients)`` running sequences (clients: those with
    unfinished sequences)."""

    def __init__(self, unfinished: dict[str, int], running: Iterable, max_seqs: int):
        """``unfinished``: each client's unfinished sequences; ``running``: the running sequences."""
        self.unfinished = unfinished
        self.running: dict[str, int] = {}
        for seq in running:
            if seq.request.client is not None:
                self.running[seq.request.client] = self.running.get(seq.request.client, 0) + 1
        self.cap = max(1, max_seqs // max(len(self.unfinished), 1))
        self.waiting = {c for c, n in self.unfinished.items() if n > self.running.get(c, 0)}

    def over(self, client: str | None) -> bool:
        return (client is not None and self.running.get(client, 0) >= self.cap
                and any(other != client for other in self.waiting))

    def admitted(self, client: str | None) -> None:
        if client is not None:
            self.running[client] = self.running.get(client, 0) + 1
            if self.running[client] >= self.unfinished[client]:
                self.waiting.discard(client)
