"""Fair shares between clients: one client (a peer address) cannot take every text thread or
grammar compiler, nor push everyone else's requests behind all of its own.

``CLIENT`` holds the peer address of the request being handled (set once per request by the
server's ASGI layer). ``ClientShares`` lets each client run at most ``per_client`` jobs of one kind
at a time (its further jobs wait their turn behind its own, not in front of others'); the
scheduler ranks a client's new sequences after the ones it already has in flight
(``Request.client``, scheduler.py), so a bystander's request is admitted before a greedy
client's backlog. Behind a proxy every request has the proxy's address and these shares are one.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextvars import ContextVar

CLIENT: ContextVar[str | None] = ContextVar("infeng_client", default=None)


class ClientShares:
    """Per-client semaphores of ``per_client`` slots, dropped when no job of the client is left.
    ``acquire`` waits for a slot and returns its release; the caller releases it when the job's
    thread is done (not when the request gives up on it: a job past its budget still holds a slot)."""

    def __init__(self, per_client: int = 1):
        self.per_client = per_client
        self._held: dict[str, tuple[asyncio.Semaphore, int]] = {}

    async def acquire(self, client: str | None) -> Callable[[], None]:
        if client is None:
            return _nothing
        sem, users = self._held.get(client) or (asyncio.Semaphore(self.per_client), 0)
        self._held[client] = (sem, users + 1)
        try:
            await sem.acquire()
        except BaseException:
            self._leave(client)
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                sem.release()
                self._leave(client)
        return release

    def _leave(self, client: str) -> None:
        sem, users = self._held[client]
        if users == 1:
            del self._held[client]
        else:
            self._held[client] = (sem, users - 1)


def _nothing() -> None:
    pass
