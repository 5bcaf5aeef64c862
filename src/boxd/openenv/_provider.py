"""`BoxdProvider`: OpenEnv's container provider over boxd forks."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx
from openenv.core.containers.runtime import ContainerProvider

from boxd import errors, models
from boxd.sdk import Boxd

#: The guest port a session's URL reaches unless ``start_container(port=...)`` names
#: another (docs/lifecycle.md#urls): the OpenEnv server in the source listens there.
GUEST_PORT = 8080
#: Seconds between two ``/health`` polls.
_POLL = 0.2


# openenv-core ships no type information: its base class is Any to mypy.
class BoxdProvider(ContainerProvider):  # type: ignore[misc]
    """OpenEnv sessions in forks of a boxd machine whose server is already listening.

    One provider holds one session, as OpenEnv's providers do (``EnvClient.close()``
    calls ``stop_container()``), plus the branches it made of it (``branch``); use one
    provider per concurrent session.

    Args:
        client: the boxd client to use; a ``Boxd()`` from the environment if None (the
            provider then closes it in ``stop_container``).

    Example:
        >>> env = MyEnv.from_docker_image("echo-warm", provider=BoxdProvider())
    """

    def __init__(self, client: Boxd | None = None) -> None:
        self._given = client
        self._own: Boxd | None = None  # made on first use, closed by stop_container
        self._session: str | None = None  # machine id of the session started
        self._urls: dict[str, str] = {}  # base URL -> machine id, session and branches
        self._ports: dict[str, int] = {}  # base URL -> the guest port it reaches

    @property
    def _client(self) -> Boxd:
        if self._given is not None:
            return self._given
        if self._own is None:
            self._own = Boxd()
        return self._own

    @property
    def machine(self) -> str | None:
        """Id of the session's machine (None before ``start_container``, after stop)."""
        return self._session

    def start_container(
        self,
        image: str,
        port: int | None = None,
        env_vars: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> str:
        """Start a session: fork the machine ``image`` (or start one from the snapshot
        ``image`` when no machine has that name) and return the new machine's URL.

        Args:
            image: a machine name or id whose OpenEnv server is listening, or a
                snapshot (``NAME``, ``NAME@N``, ``sha256:...``) saved from one.
            port: the guest port the server listens on (default 8080; OpenEnv's
                images use 8000): the session's URL reaches that port.
            env_vars: must be empty: the server already runs in the source, with the
                environment it was started with.
            **kwargs: ``name``, the new machine's name (generated if absent).

        Returns:
            The base URL of the session's server (``http://127.0.0.1:PORT/TOKEN``, or
            ``.../TOKEN.N`` for guest port N).

        Raises:
            InvalidRequest: a session is already started, or ``port``/``env_vars``/a
                keyword cannot be honoured.
            NotFound: no machine and no snapshot has the name ``image``.
            BoxdError: the fork or start failed (its own type: StateError, QuotaExceeded...).
        """
        if self._session is not None:
            raise errors.InvalidRequest(
                f"this provider already holds session machine {self._session}; "
                "use one BoxdProvider per session (or call stop_container first)",
                field="image")
        guest_port = GUEST_PORT if port is None else port
        if not isinstance(guest_port, int) or not 1 <= guest_port <= 65535:
            raise errors.InvalidRequest(f"port {port!r} is not a TCP port (1-65535)",
                                        field="port")
        if env_vars:
            raise errors.InvalidRequest(
                "env_vars cannot reach a fork: its server already runs with the "
                "environment of the source; set them when you start the server there",
                field="env_vars")
        name = kwargs.pop("name", None)
        if kwargs:
            raise errors.InvalidRequest(
                f"BoxdProvider.start_container takes no {sorted(kwargs)}", field="kwargs")
        machine = self._launch(image, name)
        self._session = machine.id
        try:
            return self._record(machine, guest_port)
        except BaseException:  # no half-started session: the machine goes too
            self._session = None
            self._delete(machine.id)
            raise

    def _launch(self, image: str, name: str | None) -> models.Machine:
        machines = self._client.machines
        try:
            return machines.fork(image, name)
        except errors.MachineNotFound:
            pass
        try:
            return machines.new(name, from_snapshot=image)
        except errors.SnapshotNotFound:
            raise errors.NotFound(
                f"no machine and no snapshot named {image!r}",
                hint="prepare a source with its OpenEnv server listening "
                     "(examples/openenv/), or snapshot one") from None

    def _record(self, machine: models.Machine, port: int) -> str:
        if machine.url is None:  # a machine gets its URL port when it first runs
            machine = self._client.machines.wait_until_ready(machine.id)
        if machine.url is None:
            raise errors.InternalError(f"machine {machine.id} is ready but has no URL")
        url = machine.url_for(port).rstrip("/")
        self._urls[url] = machine.id
        self._ports[url] = port
        return url

    def wait_for_ready(self, base_url: str, timeout_s: float = 30.0) -> None:
        """Poll ``base_url + "/health"`` until it answers 200.

        Raises:
            TimeoutError: no 200 within ``timeout_s`` seconds (OpenEnv's contract); the
                message has the last answer or error.
        """
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        with httpx.Client(timeout=5.0, trust_env=False) as http:
            while True:
                try:
                    resp = http.get(f"{base_url.rstrip('/')}/health")
                    if resp.status_code == 200:
                        return
                    last = f"HTTP {resp.status_code}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the OpenEnv server at {base_url} did not answer /health within "
                        f"{timeout_s:g} s (last: {last}); is it listening in the source "
                        "on the port given to start_container?")
                time.sleep(_POLL)

    def branch(self, base_url: str, k: int) -> list[str]:
        """Fork the machine behind a session ``k`` times; return the branches' URLs.

        Each branch's server continues from this moment in memory, but a WebSocket
        session does not survive the fork (its TCP connection stays with the original):
        see docs/openenv.md for what a client re-attaches to. All or nothing: when a
        fork fails the others are deleted and its error is raised. ``stop_container``
        deletes the branches too (or ``stop(url)`` one at a time).

        Raises:
            InvalidRequest: ``k`` < 1, or ``base_url`` is not a session of this provider.
            BoxdError: a fork failed.
        """
        if k < 1:
            raise errors.InvalidRequest(f"k={k}: branch at least once", field="k")
        source = self._machine_of(base_url)
        port = self._ports[base_url.rstrip("/")]
        results = self._client.machines.fork(source, count=k)
        failed = [r for r in results if isinstance(r, errors.BoxdError)]
        made = [r for r in results if isinstance(r, models.Machine)]
        if failed:
            for m in made:
                self._delete(m.id)
            raise failed[0]
        return [self._record(m, port) for m in made]

    def stop(self, base_url: str) -> None:
        """Delete one session or branch of this provider by its URL.

        Raises:
            InvalidRequest: ``base_url`` is not one of this provider's.
        """
        machine = self._machine_of(base_url)
        del self._urls[base_url.rstrip("/")]
        self._ports.pop(base_url.rstrip("/"), None)
        if machine == self._session:
            self._session = None
        self._delete(machine)

    def stop_container(self) -> None:
        """Delete the session's machine and every branch made of it (idempotent)."""
        for url in list(self._urls):
            self._ports.pop(url, None)
            self._delete(self._urls.pop(url))
        self._session = None
        own, self._own = self._own, None
        if own is not None:
            own.close()

    def _machine_of(self, base_url: str) -> str:
        try:
            return self._urls[base_url.rstrip("/")]
        except KeyError:
            raise errors.InvalidRequest(
                f"{base_url} is not a session of this provider", field="base_url") from None

    def _delete(self, machine: str) -> None:
        with contextlib.suppress(errors.MachineNotFound):  # gone: the end state wanted
            self._client.machines.delete(machine)
