"""The gateway's API keys (key -> tenant) and the watch that rotates them without a restart.

Keys come from ``QLM_GATEWAY_API_KEYS`` and ``QLM_GATEWAY_API_KEYS_FILE`` (JSON objects, merged).
The file is read again when its content changes (checked every ``QLM_GATEWAY_API_KEYS_RELOAD_S``
and on SIGHUP): an operator rotates a key by writing the file, with both keys in it for the
overlap, then without the old one. A file that cannot be read or does not hold valid keys
leaves the keys in use as they are: a half-written or mistyped file never locks every client
out, and is logged (by position, never a key) until it is fixed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:  # app.py imports this module
    from qlm.gateway.app import GatewaySettings

log = structlog.get_logger(__name__)

# RFC 6750 b64token, as the admin API requires of its tokens: every configured key can be sent.
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_MIN_KEY_CHARS = 16
_UNREADABLE = b""  # ApiKeysWatch: the file could not be read (never a content's digest)


class ApiKeys:
    """API key → tenant. Keys are kept only as SHA-256 digests and every lookup compares the
    digest of the presented key with *all* of them in constant time, so neither a key's
    content nor its position in the table leaks through response timing."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        if not keys:
            raise ValueError("no API keys configured (QLM_GATEWAY_API_KEYS or _API_KEYS_FILE)")
        entries: list[tuple[bytes, str]] = []
        for n, (key, tenant) in enumerate(keys.items()):
            # The error names the entry by position: the key itself must never be printed.
            if not isinstance(key, str) or not _B64TOKEN.fullmatch(key):
                raise ValueError(f"API key #{n + 1} has characters a bearer token cannot carry")
            if len(key) < _MIN_KEY_CHARS:
                raise ValueError(f"API key #{n + 1} is shorter than {_MIN_KEY_CHARS} characters")
            if not isinstance(tenant, str) or len(tenant) > 128:
                raise ValueError(f"the tenant of API key #{n + 1} must be a string ≤ 128 chars")
            entries.append((hashlib.sha256(key.encode()).digest(), tenant))
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def tenant_for(self, presented: str) -> str | None:
        """The tenant of ``presented``, or None when it is no configured key."""
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found: str | None = None
        for key_digest, tenant in self._entries:  # no early exit: constant work per lookup
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found

    def adopt(self, other: ApiKeys) -> None:
        """Serve ``other``'s keys from now on (one assignment: a lookup sees the old table
        or the new one, never a mix)."""
        self._entries = other._entries

    @classmethod
    def from_settings(cls, settings: GatewaySettings, file_text: str | None = None) -> ApiKeys:
        """The keys of the variable and the file merged; ``file_text``: the file's content as
        already read (the watch parses what it hashed, not a later version)."""
        keys: dict[str, str] = {}
        sources: list[tuple[str, str]] = []
        if settings.api_keys is not None:
            sources.append(("QLM_GATEWAY_API_KEYS", settings.api_keys.get_secret_value()))
        if settings.api_keys_file is not None:
            if file_text is None:
                try:
                    file_text = settings.api_keys_file.read_text()
                except OSError as exc:
                    raise ValueError(f"QLM_GATEWAY_API_KEYS_FILE: {exc.strerror}") from None
            sources.append(("QLM_GATEWAY_API_KEYS_FILE", file_text))
        for name, text in sources:
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as exc:
                # Position only: the message would quote the (secret) text.
                raise ValueError(f"{name}: not JSON (line {exc.lineno})") from None
            if not isinstance(loaded, dict):
                raise ValueError(f"{name}: must be a JSON object of API key -> tenant")
            for key, tenant in loaded.items():
                if key in keys and keys[key] != tenant:
                    raise ValueError(f"{name}: a key is mapped to two different tenants")
                keys[key] = tenant
        return cls(keys)


class ApiKeysWatch:
    """Reads ``QLM_GATEWAY_API_KEYS_FILE`` again when its content changed since the keys in
    use were read, and has ``keys`` adopt what it holds; a file that cannot be read or holds
    no valid keys leaves ``keys`` as they are (logged once per content)."""

    def __init__(self, keys: ApiKeys, settings: GatewaySettings) -> None:
        if settings.api_keys_file is None:
            raise ValueError("no QLM_GATEWAY_API_KEYS_FILE to watch")
        self.keys = keys
        self._settings = settings
        self._path = settings.api_keys_file
        read = self._read()
        # the content the keys in use came from (None: unreadable now; the first readable
        # content then counts as a change)
        self._loaded: bytes | None = None if read is None else read[0]
        self._refused: bytes | None = None  # the last content refused, or _UNREADABLE
        self.reloads = 0

    def _read(self) -> tuple[bytes, str] | None:
        """(digest, text) of the file now; None (logged once) where it cannot be read."""
        try:
            raw = self._path.read_bytes()
        except OSError as exc:
            if self._refused != _UNREADABLE:
                self._refused = _UNREADABLE
                log.error("api_keys_file_unreadable", error=exc.strerror, kept="the keys in use")
            return None
        return hashlib.sha256(raw).digest(), raw.decode("utf-8", "replace")

    def check(self) -> bool:
        """Adopt the file's keys if its content changed and holds valid keys; whether the
        keys in use changed."""
        read = self._read()
        if read is None:
            return False
        digest, text = read
        if digest == self._loaded or digest == self._refused:
            return False
        try:
            fresh = ApiKeys.from_settings(self._settings, file_text=text)
        except ValueError as exc:
            self._refused = digest
            log.error("api_keys_reload_refused", error=str(exc), kept="the keys in use")
            return False
        self.keys.adopt(fresh)
        self._loaded, self._refused = digest, None
        self.reloads += 1
        log.info("api_keys_reloaded", api_keys=len(fresh))
        return True

    async def run(self, interval_s: float) -> None:
        """Check every ``interval_s`` seconds until cancelled; a check that fails unexpectedly
        is logged and the next one runs (the keys in use stay)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.check()
            except Exception:
                log.exception("api_keys_watch_failed", kept="the keys in use")
