"""The last resort of a shutdown: end the process at a deadline, whatever its threads are doing.

A thread in a native call (a tokenizer, a grammar compiler, a mask) cannot be stopped, and the
interpreter waits for such threads before it exits; SIGTERM must still end the process within
``--shutdown-timeout`` plus a grace (server.py). ``exit_after`` arms a daemon timer that flushes
the logs and calls ``os._exit`` if the process is still there when it fires.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

_log = logging.getLogger("infeng.server")


def exit_after(seconds: float, exit_code: Callable[[], int | None]) -> threading.Timer:
    """End the process ``seconds`` from now with ``exit_code()`` (1 if None) unless it ended before."""
    def exit_now() -> None:
        code = exit_code()
        code = 1 if code is None else code
        _log.error("the process did not end in time after the shutdown began; exiting now",
                   extra={"fields": {"exit_code": code, "after_s": seconds}})
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()
    return timer
