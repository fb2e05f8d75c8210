"""The API key: where it comes from, where it is required, and that it never shows itself.

Without a key a server listens only where nobody else can reach it: ipc:// (a 0600 socket
file) and loopback tcp:// and HTTP. Any other address needs a key (:func:`check_exposure`).
With a key, HTTP requires it as a bearer token on every address (``http_auth``), and every
tcp:// endpoint is a CURVE server whose client keys derive from it (``ipc.curve``); ipc://
stays protected by its file mode alone.

The key is a secret: :class:`ApiKey` prints as ``<API key>`` (logs, exceptions, reprs in
tracebacks), and no error message here quotes it.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from ipc.curve import CurveKeys
from ipc.endpoints import is_loopback_host

ENV_VAR = "DOVETAIL_API_KEY"
MIN_CHARS = 16  # a guessable key could be found offline from a recorded CURVE handshake
MAX_CHARS = 1024
MAX_FILE_BYTES = 4096
MAKE_ONE = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


class ApiKeyError(ValueError):
    """A key that cannot be used, or a server that would be open without one; one line."""


class ApiKey:
    """One API key. Compare with :meth:`matches` (constant time); :meth:`reveal` is for the
    places that must send it (an HTTP client's header)."""

    __slots__ = ("_value",)

    def __init__(self, value: str, source: str = "the API key"):
        if not MIN_CHARS <= len(value) <= MAX_CHARS:
            raise ApiKeyError(f"{source}: an API key needs {MIN_CHARS} to {MAX_CHARS} characters, this one has "
                              f"{len(value)} (make a random one: {MAKE_ONE})")
        if not all("!" <= char <= "~" for char in value):
            raise ApiKeyError(f"{source}: an API key is printable ASCII without spaces (it travels in an HTTP "
                              f"header)")
        self._value = value

    def reveal(self) -> str:
        return self._value

    def matches(self, presented: bytes) -> bool:
        return hmac.compare_digest(presented, self._value.encode("ascii"))

    def curve_keys(self) -> CurveKeys:
        return CurveKeys.from_secret(self._value.encode("ascii"))

    def __repr__(self) -> str:
        return "<API key>"

    __str__ = __repr__


def read_key_file(path: str | os.PathLike[str]) -> ApiKey:
    """The key in ``path`` (one line; surrounding whitespace ignored). The file must be a
    regular file of this user that nobody else may read or write, as ssh wants of its keys."""
    where = f"--api-key-file {path}"
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ApiKeyError(f"{where}: not a regular file")
            if info.st_uid != os.getuid():
                raise ApiKeyError(f"{where}: the file belongs to another user (uid {info.st_uid}); a key file "
                                  f"must be yours")
            mode = stat.S_IMODE(info.st_mode)
            if mode & 0o077:
                raise ApiKeyError(f"{where}: others may read or write it (mode {mode:04o}); make it yours alone: "
                                  f"chmod 600 {path}")
            data = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ApiKeyError(f"{where}: no such file; make one with: (umask 077; {MAKE_ONE} > {path})") from None
    except IsADirectoryError:
        raise ApiKeyError(f"{where}: not a regular file") from None
    except OSError as error:
        raise ApiKeyError(f"{where}: cannot read it: {error.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ApiKeyError(f"{where}: larger than {MAX_FILE_BYTES} bytes; a key file holds one key")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ApiKeyError(f"{where}: an API key is printable ASCII without spaces") from None
    return ApiKey(text, where)


def exposed_addresses(binds: Sequence[str], http_host: str | None) -> list[str]:
    """What would listen beyond this machine: tcp:// binds and an HTTP host that are not loopback."""
    exposed = [endpoint for endpoint in binds
               if endpoint.startswith("tcp://") and not is_loopback_host(urlsplit(endpoint).hostname or "")]
    if http_host is not None and not is_loopback_host(http_host):
        exposed.append(f"HTTP on {http_host}")
    return exposed


def check_exposure(binds: Sequence[str], http_host: str | None, key: ApiKey | None) -> None:
    """Refuse to serve beyond loopback without a key."""
    exposed = exposed_addresses(binds, http_host)
    if exposed and key is None:
        raise ApiKeyError(f"refusing to serve {', '.join(exposed)} without an API key: anyone who can reach it could "
                          f"use this server; give --api-key-file PATH (or DOVETAIL_API_KEY), or serve on 127.0.0.1")


def load_api_key(key_file: Path | None, key_text: str | None, text_source: str) -> ApiKey | None:
    """The key from ``--api-key-file``, else from ``--api-key`` / DOVETAIL_API_KEY (named by
    ``text_source``); None without either."""
    if key_file is not None:
        return read_key_file(key_file)
    if key_text is not None:
        return ApiKey(key_text.strip(), text_source)
    return None


__all__ = ["ApiKey", "ApiKeyError", "ENV_VAR", "check_exposure", "exposed_addresses", "load_api_key",
           "read_key_file"]
