"""Idempotency keys: a create or fork retried with its key returns the first one's
machines, never new ones.

A keyed request claims (account, key) in the control plane's database before it starts
(`state.repos.IdempotencyKeys`), with a fingerprint of what it asked. Then:

- the key is free: this request runs; when it is done its response is kept for the
  key's retries. If it failed (an exception, or a fork batch of which no child was
  made) the key is released, so a retry runs anew: nothing was made that a retry could
  return, and keeping the error would turn a passing fault (a full quota, a busy host)
  into a permanent one.
- the key holds another request (another route, source or body): `IdempotencyKeyReused`.
- the key holds this request, done: its response (the machines as they are now).
- the key holds this request, still running: the retry waits for it, then answers as
  above (or runs anew if it failed). Concurrent retries therefore make one request's
  machines.

Keys live ``ttl`` seconds (24 h) and the next keyed request prunes the expired ones; an
account holds at most ``max_keys`` (the oldest done keys over an hour old go first,
then a new key is refused with `QuotaExceeded`). A daemon restart keeps the done keys
and releases the running ones (their requests died with the daemon; their clients saw
the connection drop and retry).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from boxd import models
from boxd.errors import (
    BoxdError,
    IdempotencyKeyReused,
    InternalError,
    InvalidRequest,
    QuotaExceeded,
    error_from_body,
)
from boxd.models import IDEMPOTENCY_KEY_PATTERN
from boxd.state import Repos

log = logging.getLogger("boxd.control")

_T = TypeVar("_T")

#: Seconds a key is kept after its request began.
KEY_TTL = 24 * 3600.0
#: Seconds a key is kept at least, even when its account is at ``max_keys``.
KEY_MIN_TTL = 3600.0
#: Keys an account holds at once.
MAX_KEYS = 10_000
#: Seconds between two prunes of the expired keys.
_PRUNE_EVERY = 60.0

_KEY_RE = re.compile(IDEMPOTENCY_KEY_PATTERN.removesuffix("$") + r"\Z")


def check_key(key: str) -> str:
    """Raises: InvalidRequest: not 1-255 printable ASCII characters without spaces."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise InvalidRequest(
            f"invalid idempotency key {str(key)[:80]!r}: use 1-255 printable ASCII "
            "characters without spaces", field="Idempotency-Key",
            hint="e.g. a UUID per logical request, the same on each of its retries")
    return key


def fingerprint(*parts: Any) -> str:
    """A stable hash of what a request asked (JSON values)."""
    raw = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


class Idempotency:
    """Runs keyed requests once per (account, key)."""

    def __init__(
        self, repos: Repos, *, ttl: float = KEY_TTL, max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.repos = repos
        self.ttl = ttl
        self.max_keys = max_keys
        self.clock = clock
        # (account, key) -> set when the request running under it ends
        self._running: dict[tuple[str, str], asyncio.Event] = {}
        self._pruned = 0.0

    def recover(self) -> None:
        """At daemon start: release the keys of requests the last daemon was running."""
        n = self.repos.idempotency.release_running()
        if n:
            log.info("event=idempotency_keys_released count=%d", n)

    def _prune(self, account: str, key: str, now: float) -> None:
        """Drop expired keys (at most once a minute); keep the account under its bound.

        Raises:
            QuotaExceeded: the account holds ``max_keys`` keys none of which may go yet.
        """
        keys = self.repos.idempotency
        if now - self._pruned >= _PRUNE_EVERY:
            self._pruned = now
            keys.prune(now)
        held = keys.get(account, key)
        if held is not None and held.expires_at > now:
            return  # a retry: it adds no key
        if keys.count(account) >= self.max_keys:
            keys.prune(now)
            keys.trim(account, self.max_keys - 1, now - KEY_MIN_TTL)
            used = keys.count(account)
            if used >= self.max_keys:
                raise QuotaExceeded(
                    f"this account holds {used} idempotency keys, its limit; none is an "
                    "hour old yet", limit="idempotency_keys", used=used,
                    hint="send fewer keyed requests, or retry in a few minutes")

    async def run(
        self, account: str, key: str, fp: str, call: Callable[[], Awaitable[_T]], *,
        dump: Callable[[_T], str], load: Callable[[str], _T],
        made: Callable[[_T], bool] = lambda _: True,
    ) -> _T:
        """``call()`` once for (account, key): its result, or the first call's (``load``
        of what ``dump`` kept). ``made(result)`` False releases the key as a failure
        does.

        Raises:
            InvalidRequest: a malformed key.
            IdempotencyKeyReused: the key named another request (``fp`` differs).
            QuotaExceeded: the account holds too many keys.
            BoxdError: what ``call`` raised (the key is released).
        """
        check_key(key)
        slot = (account, key)
        while True:
            now = self.clock()
            self._prune(account, key, now)
            held = self.repos.idempotency.claim(account, key, fp, now=now, ttl=self.ttl)
            if held is None:
                break  # ours: run it
            if held.fingerprint != fp:
                raise IdempotencyKeyReused(
                    f"idempotency key {key[:80]!r} was used for a different request "
                    "(another route, source or body)", key=key,
                    hint="send a retry unchanged with its key; give each new request a "
                    "new key")
            if held.response is not None:
                log.info("event=idempotent_replay key=%s", key[:80])
                return load(held.response)
            running = self._running.get(slot)
            if running is None:
                # No request of this daemon runs under it (the claim and this lookup
                # share one step of the event loop): left by a request that died.
                self.repos.idempotency.release(account, key)
                continue
            await running.wait()  # then: its response, or the key is free again
        done = self._running[slot] = asyncio.Event()
        try:
            result = await call()
            if made(result):
                self.repos.idempotency.finish(account, key, dump(result))
            else:
                self.repos.idempotency.release(account, key)
        except BaseException:
            self.repos.idempotency.release(account, key)
            raise
        finally:
            del self._running[slot]
            done.set()
        return result

    async def machine(
        self, account: str, key: str, fp: str, call: Callable[[], Awaitable[models.Machine]],
        fresh: Callable[[models.Machine], models.Machine],
    ) -> models.Machine:
        """`run` for a create: its retries get ``fresh`` of the machine it made."""
        return await self.run(
            account, key, fp, call, dump=lambda m: m.model_dump_json(),
            load=lambda raw: fresh(models.Machine.model_validate_json(raw)))

    async def items(
        self, account: str, key: str, fp: str,
        call: Callable[[], Awaitable[list[models.Machine | Exception]]],
        fresh: Callable[[models.Machine], models.Machine],
    ) -> list[models.Machine | Exception]:
        """`run` for a fork: its retries get each child (``fresh``) or its typed error;
        a fork that made no child releases the key."""
        return await self.run(
            account, key, fp, call, dump=_dump_items,
            load=lambda raw: [fresh(i) if isinstance(i, models.Machine) else i
                              for i in _load_items(raw)],
            made=lambda items: any(isinstance(i, models.Machine) for i in items))


def _dump_items(items: list[models.Machine | Exception]) -> str:
    """A fork's items as JSON: each child, or its error's body."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, models.Machine):
            out.append({"machine": item.model_dump(mode="json")})
        else:
            err = item if isinstance(item, BoxdError) else InternalError(
                "internal error", hint="the daemon's log has the details")
            out.append(err.to_body())
    return json.dumps(out, separators=(",", ":"), default=str)


def _load_items(raw: str) -> list[models.Machine | Exception]:
    """The inverse of `_dump_items` (an error comes back as its typed `BoxdError`)."""
    return [models.Machine.model_validate(i["machine"]) if "machine" in i
            else error_from_body(i) for i in json.loads(raw)]


__all__ = ["KEY_MIN_TTL", "KEY_TTL", "MAX_KEYS", "Idempotency", "check_key", "fingerprint"]
