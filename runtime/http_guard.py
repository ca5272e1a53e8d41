"""Access checks in front of the API, as plain ASGI (they answer before FastAPI parses anything).

In order, for every HTTP request:

1. **Host** (only when the server is bound to a loopback address): the ``Host`` header must name
   loopback (``localhost``, ``127.x.x.x``, ``[::1]``, any port), else 421. A web page the user
   opens cannot reach a loopback server through a DNS name it controls (DNS rebinding).
2. **API key** (``--api-key``): every path but ``/health``, ``/metrics`` and the pages' static files
   (``web.is_page_path``: the page asks for the key itself) needs
   ``Authorization: Bearer <key>``, compared in constant time, else 401.
3. **Content type**: a request with a body must be ``application/json`` (a ``charset`` other than
   utf-8 is refused too), else 415: a web page can send ``text/plain`` across origins without a
   CORS preflight, never ``application/json``.
4. **Body size**: more than ``max_request_bytes`` (by ``Content-Length``, or counted while a
   chunked body arrives) is 413. The body is read here, whole, and handed on.

A refused request's body is read and dropped (up to ``DRAIN_BYTES``) before the answer, so the
client, still writing, reads the error instead of a reset connection.

``AdapterRoots`` confines runtime adapter loads (``POST /v1/adapters``) to directories under the
roots given with ``--adapter-root``, and reads them through a private copy made from files checked
after they were opened (no window between the check and the read).
"""
from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from infeng_common.errors import InfengError

from .api_errors import APIError
from .request_log import record_of
from .web import is_page_path

#: Paths anyone who can reach the server may read (no key): liveness and Prometheus scrapes.
OPEN_PATHS = frozenset({"/health", "/metrics"})
#: How much of a refused request's body is read and dropped so that the client reads the answer.
DRAIN_BYTES = 64 * 2 ** 20
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})
#: Bytes per read while an adapter's files are copied (AdapterRoots.snapshot).
COPY_CHUNK = 1 << 20
#: The files of a PEFT adapter directory the loader reads (common/peft.py), and those it only names.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
NAMED_ONLY = ("adapter_model.bin",)


def is_loopback_address(host: str) -> bool:
    """A bind address on loopback only (``127.0.0.1``, ``::1``, ``localhost``)."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_is_loopback(header: str) -> bool:
    """A ``Host`` header value that names loopback, with or without a port."""
    header = header.strip().lower()
    if header.startswith("["):                      # [::1] or [::1]:8000
        name, _, rest = header[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return False
    else:
        name, _, port = header.partition(":")
        if port and not port.isdigit():
            return False
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class AccessPolicy:
    api_key: str | None = None
    loopback_only: bool = False                     # check Host (the server is bound to loopback)
    max_request_bytes: int = 4 * 2 ** 20


class AccessGuard:
    """ASGI middleware applying an ``AccessPolicy`` (see the module docstring)."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy
        self._key = policy.api_key.encode() if policy.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        error = self._check(scope, headers)
        if error is not None:
            await _drain(receive, DRAIN_BYTES)
            return await error.send(send, _auth_challenge(error))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        cap = self.policy.max_request_bytes
        too_large = APIError(413, f"the request body is larger than this server's limit of {cap} bytes "
                                  f"(--max-request-bytes)", param=None, code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _drain(receive, DRAIN_BYTES)
                return await APIError(400, "the Content-Length header is not a number").send(send)
            if int(length) > cap:
                await _drain(receive, DRAIN_BYTES if int(length) <= DRAIN_BYTES else 0)
                return await too_large.send(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":   # the client left before sending its body
                record = record_of(scope)
                if record is not None:
                    record.disconnected = True
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await _drain(receive, DRAIN_BYTES - size)
                return await too_large.send(send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()                     # then disconnects, as the server reports them

        await self.app(scope, replay, send)

    def _check(self, scope, headers: dict[bytes, bytes]) -> APIError | None:
        if self.policy.loopback_only:
            host = headers.get(b"host")
            if host is None or not host_is_loopback(host.decode("latin-1")):
                return APIError(421, "this server listens on loopback and only answers requests addressed to "
                                     "localhost, 127.0.0.1 or [::1] (the Host header names another host)",
                                code="invalid_host")
        if self._key is not None and scope["path"] not in OPEN_PATHS and not is_page_path(scope["path"]):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                return APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
        if scope["method"] in ("POST", "PUT", "PATCH") and not _is_json(headers.get(b"content-type", b"")):
            return APIError(415, "the request body must be JSON sent with 'Content-Type: application/json'",
                            code="unsupported_media_type")
        return None


def _headers(scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope["headers"]}


def _is_json(content_type: bytes) -> bool:
    media, *params = content_type.decode("latin-1").split(";")
    if media.strip().lower() != "application/json":
        return False
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


def _auth_challenge(error: APIError) -> list[tuple[bytes, bytes]]:
    return [(b"www-authenticate", b"Bearer")] if error.status == 401 else []


async def _drain(receive, limit: int) -> None:
    """Read and drop up to ``limit`` bytes of the request body."""
    while limit > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        limit -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class AdapterRoots:
    """The directories runtime adapter loads may read (``--adapter-root``, repeatable). A path is
    allowed when it resolves (symlinks followed) under a root, and no entry of the adapter
    directory is a symlink that leaves the roots. A refusal says the same whether or not the path
    exists, and never names anything outside the roots."""

    def __init__(self, roots: Iterable[str | Path]):
        self.roots: list[Path] = []
        for root in roots:
            resolved = Path(root).expanduser().resolve()
            if not resolved.is_dir():
                raise InfengError(f"--adapter-root {root}: not a directory")
            self.roots.append(resolved)

    def __bool__(self) -> bool:
        return bool(self.roots)

    def _inside(self, path: Path) -> bool:
        return any(path == root or path.is_relative_to(root) for root in self.roots)

    def confine(self, given: str) -> Path:
        """The resolved directory for a client's ``path`` (absolute, or relative to a root);
        APIError 403 when it is not under a root."""
        refused = _outside_roots(given)
        if "\0" in given:
            raise refused
        path = Path(given)                      # never expanduser: "~user" would tell which users exist
        candidates = [path] if path.is_absolute() else [root / path for root in self.roots]
        inside = []
        for candidate in candidates:
            try:
                resolved = candidate.resolve()
            except (OSError, RuntimeError):            # a symlink loop
                continue
            if self._inside(resolved):
                inside.append(resolved)
        if not inside:
            raise refused
        resolved = next((p for p in inside if p.exists()), inside[0])
        if resolved.is_dir():
            try:
                entries = list(resolved.iterdir())
            except OSError:
                entries = []
            for entry in entries:
                if entry.is_symlink():
                    try:
                        target = entry.resolve()
                    except (OSError, RuntimeError):
                        raise refused from None
                    if not self._inside(target):
                        raise refused
        return resolved

    @contextlib.contextmanager
    def snapshot(self, given: str) -> Iterator[Path]:
        """A private copy of the adapter directory ``given`` names (``confine``'s rules), for the
        loader to read, removed afterwards; it copies files, so run it off the event loop. Of the
        directory only the files the PEFT reader reads are copied (``ADAPTER_FILES``; a pickled
        ``adapter_model.bin`` only as an empty name, for the reader to refuse it by name), each
        first opened as a path (``O_PATH``: no device or FIFO is ever opened for reading), accepted
        only if it is a regular file that lies under a root once open (``/proc/self/fd``), and then
        read through that same open file, at most the size it had then: a symlink inside a root
        swapped between the check and the read cannot make the server read anything outside the
        roots, and a file that keeps growing cannot keep it copying. A file larger than half the
        free space where the copy goes is refused (400). A directory that cannot be opened gives an
        empty copy (the loader then says what is missing, as for any missing file)."""
        resolved = self.confine(given)
        with tempfile.TemporaryDirectory(prefix="infeng-adapter-") as private:
            copy = Path(private)
            try:
                dir_fd = os.open(resolved, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                yield copy
                return
            try:
                self._check_opened(dir_fd, given)
                for name in ADAPTER_FILES + NAMED_ONLY:
                    self._copy_entry(dir_fd, name, copy / name, given)
            finally:
                os.close(dir_fd)
            yield copy

    def _check_opened(self, fd: int, given: str) -> None:
        """APIError 403 unless the open file ``fd`` lies under a root now."""
        try:
            where = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            where = None
        if where is None or not self._inside(where):
            raise _outside_roots(given)

    def _copy_entry(self, dir_fd: int, name: str, to: Path, given: str) -> None:
        """Copy the entry ``name`` of the open directory to ``to`` if it is a regular file under a
        root (``NAMED_ONLY`` names: an empty file)."""
        try:
            path_fd = os.open(name, os.O_PATH, dir_fd=dir_fd)       # follows symlinks, opens nothing
        except OSError:
            return
        try:
            info = os.fstat(path_fd)
            if not stat.S_ISREG(info.st_mode):
                return
            self._check_opened(path_fd, given)
            if name in NAMED_ONLY:
                to.touch()
                return
            if info.st_size > shutil.disk_usage(to.parent).free // 2:
                raise APIError(400, f"the adapter file {name!r} under {given!r} is too large to load "
                                    f"({info.st_size} bytes)", param="path", code="adapter_load_failed")
            fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)  # the same file
            with os.fdopen(fd, "rb") as source, open(to, "wb") as target:
                left = info.st_size
                while left > 0 and (chunk := source.read(min(COPY_CHUNK, left))):
                    target.write(chunk)
                    left -= len(chunk)
        finally:
            os.close(path_fd)


def _outside_roots(given: str) -> APIError:
    """The one refusal of an adapter path, whether or not it exists."""
    return APIError(403, f"the adapter path {given!r} is not under an adapter root of this server (--adapter-root)",
                    param="path", code="adapter_path_forbidden")
