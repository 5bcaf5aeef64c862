"""The console's login: a one-time, short-lived token traded for a session cookie."""

from __future__ import annotations

import pytest

from boxd.console.sessions import COOKIE, MAX_LIVE, Logins, cookie_header
from boxd.errors import AuthError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_login_token_is_exchanged_once_for_a_session_of_its_account() -> None:
    logins = Logins(Clock())
    token = logins.mint("alice")
    account, session = logins.exchange(token)
    assert account == "alice"
    assert logins.account(session) == "alice"
    with pytest.raises(AuthError, match="unknown, used or expired"):
        logins.exchange(token)  # a second use
    assert session != token


def test_a_login_token_expires() -> None:
    clock = Clock()
    logins = Logins(clock, token_seconds=60)
    token = logins.mint("alice")
    clock.now += 60.5
    with pytest.raises(AuthError):
        logins.exchange(token)


def test_a_session_expires_and_ends_at_logout() -> None:
    clock = Clock()
    logins = Logins(clock, session_seconds=100)
    _, session = logins.exchange(logins.mint("alice"))
    clock.now += 99
    assert logins.account(session) == "alice"
    clock.now += 2
    with pytest.raises(AuthError, match="expired"):
        logins.account(session)
    _, other = logins.exchange(logins.mint("bob"))
    logins.end(other)
    with pytest.raises(AuthError):
        logins.account(other)


@pytest.mark.parametrize("value", [None, "", "nope", "x" * 43])
def test_no_token_or_session_is_an_auth_error(value: str | None) -> None:
    logins = Logins(Clock())
    logins.mint("alice")
    with pytest.raises(AuthError):
        logins.exchange(value)
    with pytest.raises(AuthError):
        logins.account(value)


def test_a_session_id_is_not_a_login_token_and_the_reverse() -> None:
    logins = Logins(Clock())
    token = logins.mint("alice")
    with pytest.raises(AuthError):
        logins.account(token)
    _, session = logins.exchange(token)
    with pytest.raises(AuthError):
        logins.exchange(session)


def test_only_hashes_are_kept() -> None:
    logins = Logins(Clock())
    token = logins.mint("alice")
    _, session = logins.exchange(logins.mint("alice"))
    kept = " ".join([*logins._tokens, *logins._sessions])
    assert token not in kept and session not in kept


def test_live_tokens_are_bounded_the_oldest_dropped() -> None:
    logins = Logins(Clock())
    first = logins.mint("alice")
    for _ in range(MAX_LIVE):
        logins.mint("alice")
    assert len(logins._tokens) == MAX_LIVE
    with pytest.raises(AuthError):
        logins.exchange(first)


def test_the_cookie_is_httponly_samesite_strict_for_the_whole_site() -> None:
    header = cookie_header("abc", 3600)
    parts = [p.strip() for p in header.split(";")]
    assert parts[0] == f"{COOKIE}=abc"
    assert "HttpOnly" in parts
    assert "SameSite=Strict" in parts
    assert "Path=/" in parts
    assert "Max-Age=3600" in parts
