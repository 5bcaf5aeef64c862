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
#: The port of a session of an image that EXPOSEs none: OpenEnv's images serve on it.
IMAGE_PORT = 8000
#: The name of the machine a boxd image's sessions fork: one per image digest.
BASELINE_PREFIX = "openenv-"
#: Seconds a baseline started from an image may take to be ready and answer /health.
BASELINE_TIMEOUT = 300.0
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
        engine: the engine of the baseline machine it starts from a boxd image (None:
            the daemon's default); machines and snapshots keep their own.

    Example:
        >>> env = MyEnv.from_docker_image("echo-warm", provider=BoxdProvider())
    """

    def __init__(self, client: Boxd | None = None, *, engine: str | None = None) -> None:
        self._given = client
        self._engine = engine
        self._baseline: str | None = None  # the image baseline the session forked
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

    @property
    def baseline(self) -> str | None:
        """Id of the machine started from a boxd image whose fork is the session (None
        when ``image`` named a machine or a snapshot). It outlives the session: the
        next session of that image forks it too (delete it to free it)."""
        return self._baseline

    def start_container(
        self,
        image: str,
        port: int | None = None,
        env_vars: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> str:
        """Start a session: fork the machine ``image``; when no machine has that name,
        start one from the snapshot ``image``; when there is no such snapshot either, fork
        the baseline machine of the boxd image ``image`` (started from it on first use,
        and kept); return the new machine's URL.

        Args:
            image: a machine name or id whose OpenEnv server is listening, a snapshot
                (``NAME``, ``NAME@N``, ``sha256:...``) saved from one, or a boxd image
                (``NAME[:TAG]``, ``boxd image list``) whose ENTRYPOINT/CMD serves it.
            port: the guest port the server listens on: the session's URL reaches it
                (default: 8080 for a machine or snapshot; for an image its first
                EXPOSEd port, else 8000, where OpenEnv's images serve).
            env_vars: must be empty: the server already runs in the source, with the
                environment it was started with.
            **kwargs: ``name``, the new machine's name (generated if absent).

        Returns:
            The session's base URL (``http://127.0.0.1:PORT/TOKEN[.N]``, N: guest port).

        Raises:
            InvalidRequest: a session is already started, or ``port``, ``env_vars`` or
                a keyword cannot be honoured.
            NotFound: no machine, no snapshot and no image has the name ``image``.
            StateError, TimeoutError: an image's baseline was not ready, or did not
                answer ``/health``, in time (``boxd machine logs`` says why).
            BoxdError: the fork or start failed (its own type: QuotaExceeded...).
        """
        if self._session is not None:
            raise errors.InvalidRequest(
                f"this provider already holds session machine {self._session}; "
                "use one BoxdProvider per session (or call stop_container first)",
                field="image")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 1 <= port <= 65535):
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
        machine, default_port = self._launch(image, name, port)
        self._session = machine.id
        try:
            return self._record(machine, default_port if port is None else port)
        except BaseException:  # no half-started session: the machine goes too
            self._session = None
            self._delete(machine.id)
            raise

    def _launch(self, image: str, name: str | None,
                port: int | None) -> tuple[models.Machine, int]:
        """The session's machine and the guest port its server listens on by default."""
        machines = self._client.machines
        try:
            return machines.fork(image, name), GUEST_PORT
        except errors.NotFound:  # MachineNotFound; or no route: "NAME:TAG" is no ref
            pass
        try:
            return machines.new(name, from_snapshot=image), GUEST_PORT
        except errors.SnapshotNotFound:
            pass
        try:
            found = self._client.images.get(image)
        except errors.NotFound:
            raise errors.NotFound(
                f"no machine, no snapshot and no image named {image!r}",
                hint="prepare a source with its OpenEnv server listening "
                     "(examples/openenv/), snapshot one, or build its Dockerfile "
                     "(boxd image build -t NAME DIR)") from None
        served = image_port(found) if port is None else port
        baseline = self._start_baseline(found, served)
        self._baseline = baseline.id
        return machines.fork(baseline.id, name), served

    def _start_baseline(self, image: models.Image, port: int) -> models.Machine:
        """The running machine of ``image`` whose server answers ``/health`` on ``port``:
        started on first use (by whichever session gets there first; the others wait
        for it) and kept, so every session of the image is a fork of one warm server.
        One that this call started and that never becomes ready is deleted."""
        machines = self._client.machines
        name = baseline_name(image.digest)
        try:
            made = machines.new(name, image=image.digest, engine=self._engine)
        except errors.AlreadyExists:
            made = None  # another session started it: wait for it as that one does
        try:
            ready = machines.wait_until_ready(made.id if made else name,
                                              timeout=BASELINE_TIMEOUT)
            if ready.url is None:
                raise errors.InternalError(f"machine {ready.id} is ready but has no URL")
            self.wait_for_ready(ready.url_for(port), timeout_s=BASELINE_TIMEOUT)
            return ready
        except BaseException:
            if made is not None:
                self._delete(made.id)
            raise

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
        """Delete the session's machine and every branch made of it (idempotent). An
        image's baseline stays, for the image's next session."""
        for url in list(self._urls):
            self._ports.pop(url, None)
            self._delete(self._urls.pop(url))
        self._session = None
        self._baseline = None
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


def baseline_name(digest: str) -> str:
    """The name of the baseline machine of the image with manifest digest ``digest``:
    ``openenv-`` and its first 12 hex digits (a rebuilt image gets a new baseline)."""
    return BASELINE_PREFIX + digest.removeprefix("sha256:")[:12]


def image_port(image: models.Image) -> int:
    """The guest port an image's OpenEnv server listens on: its first EXPOSEd TCP port,
    else `IMAGE_PORT`."""
    for exposed in image.config.exposed_ports:
        number, _, proto = exposed.partition("/")
        if number.isdigit() and proto in ("", "tcp") and 1 <= int(number) <= 65535:
            return int(number)
    return IMAGE_PORT
