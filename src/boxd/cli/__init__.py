"""The ``boxd`` command line: parses, calls the sync SDK, renders with rich.

Every user error (any ``BoxdError``) prints one line, ``error: <message> (<hint>)``, to
stderr and exits 1; usage errors exit 2; ``machine exec`` and ``machine exec-result``
exit with the command's code.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from boxd import __version__, errors
from boxd.cli import _render
from boxd.config import Paths, parse_duration
from boxd.models import MAX_TIMEOUT, MAX_WAIT, MachineState
from boxd.sdk import Boxd

__all__ = ["main"]

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


#: `machine exec`'s exit status when the machine, its engine, agent or node (or the
#: daemon) failed: the command has no status of its own (as `docker run` exits 125).
EXIT_INFRASTRUCTURE = 125


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one ``error:`` line to stderr and exit."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class _Group(click.Group):
    """Root group: turns boxd errors into one line on stderr instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.BoxdError as exc:
            fail(str(exc))
        except OSError as exc:  # local files: upload source, download target, export
            where = f" {exc.filename}" if exc.filename else ""
            fail(f"{exc.strerror or exc}:{where}".rstrip(":"))


class _State:
    def __init__(self, url: str | None, api_key: str | None) -> None:
        self.url = url
        self.api_key = api_key
        self._client: Boxd | None = None

    @property
    def boxd(self) -> Boxd:
        if self._client is None:
            self._client = Boxd(api_key=self.api_key, base_url=self.url)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


pass_state = click.make_pass_decorator(_State)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


@click.group(cls=_Group, context_settings=_CONTEXT)
@click.option(
    "--url",
    metavar="URL",
    help="Daemon URL (http://HOST:PORT). Default: $BOXD_URL, else the local daemon, "
    "started on demand.",
)
@click.option(
    "--api-key", metavar="KEY", help="API key. Default: $BOXD_API_KEY, else the local key."
)
@click.version_option(__version__, "-V", "--version", prog_name="boxd")
@click.pass_context
def main(ctx: click.Context, url: str | None, api_key: str | None) -> None:
    """boxd: microVMs with cheap fork, checkpoint and snapshot, for reproducible RL.

    \b
    Quick start:
      boxd machine new rl-base
      boxd machine exec rl-base -- 'pip install gymnasium numpy'
      boxd machine fork rl-base rollout-1
      boxd snapshots save rl-base env-v3
    """
    state = _State(url, api_key)
    ctx.obj = state
    ctx.call_on_close(state.close)


# --- machine -------------------------------------------------------------------------


class _Duration(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """``90``, ``90s``, ``10m``, ``1h`` -> seconds (0: never)."""

    name = "duration"

    def convert(self, value: object, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a duration: use e.g. 60s, 10m, 1h or 0", param, ctx)


_DURATION = _Duration()


class _Lifetime(_Duration):
    """``90``, ``90s``, ``10m``, ``1h``, ``2d`` -> whole seconds, 1 to 30 days."""

    name = "lifetime"

    def convert(self, value: object, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        text = str(value)
        seconds = super().convert(int(text[:-1]) * 86400 if text.endswith("d")
                                  and text[:-1].isdigit() else value, param, ctx)
        if seconds != int(seconds) or not 1 <= seconds <= MAX_TIMEOUT:
            self.fail(f"{value!r}: a lifetime is whole seconds from 1s to 30d", param, ctx)
        return int(seconds)


_LIFETIME = _Lifetime()


def lifetime_options(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--timeout`` (a lifetime) and ``--on-timeout`` on new and fork."""
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--on-timeout", type=click.Choice(["delete", "hibernate"]),
                         default="delete", show_default=True,
                         help=f"What the end of {what} lifetime does.")(f)
        return click.option(
            "--timeout", "lifetime", type=_LIFETIME, metavar="DURATION",
            help=f"Give {what} a lifetime (90, 90s, 10m, 1h, 2d; at most 30d): at its end "
            "the daemon deletes it, or hibernates it with --on-timeout hibernate. "
            "`machine set-timeout` moves the end. Default: none.")(f)
    return wrap


def _labels(ctx: click.Context, param: click.Parameter,
            value: tuple[str, ...]) -> dict[str, str]:
    """Repeated ``--label K=V`` as a mapping (checked by the SDK and the daemon)."""
    out: dict[str, str] = {}
    for item in value:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected K=V, got {item!r}")
        if key in out:
            raise click.BadParameter(f"label {key!r} is given twice")
        out[key] = val
    return out


def idempotency_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--idempotency-key", metavar="KEY",
        help=f"A key of this request (e.g. a UUID), the same on each retry: a retry within "
        f"24 h returns the first request's {what}, never new ones (1-255 printable ASCII "
        "characters).")


def queue_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--queue", "queue", type=click.FloatRange(0, MAX_WAIT), default=0.0,
        metavar="SECONDS",
        help=f"When the account's quota or the nodes' room is used up, wait up to SECONDS "
        f"in the account's queue for room for {what} instead of failing at once "
        "(`boxd info` shows the queue). Default: 0, no wait.")


def label_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option("--label", "-l", "labels", multiple=True, metavar="K=V",
                        callback=_labels, help=help)


_STATES = click.Choice([s.value for s in MachineState])


def _egress(values: tuple[str, ...]) -> list[str] | None:
    """``--egress`` as the SDK's list: None when absent, [] for ``none``."""
    if not values:
        return None
    return [] if values == ("none",) else list(values)


@main.group(context_settings=_CONTEXT)
def machine() -> None:
    """Create, run commands in, fork, checkpoint and delete machines."""


@machine.command("new")
@click.argument("name")
@click.option("--from-snapshot", metavar="SNAPSHOT", help="Start from NAME, NAME@N or sha256:...")
@click.option("--image", metavar="REF",
              help="Run an image imported with `boxd image import` (NAME[:TAG] or "
              "sha256:DIGEST): its files are the root, its ENV and WORKDIR exec's defaults. "
              "gvisor only for now.")
@click.option(
    "--isolated", is_flag=True,
    help="No network: the machine reaches nothing. The boundary is the engine's "
    "(`boxd info`): KVM a hardware VM, gvisor a user-space kernel, QEMU/TCG emulation.",
)
@click.option("--expose-host", "expose_host", type=click.IntRange(1, 65535), multiple=True,
              metavar="PORT",
              help="Let it reach the host's 127.0.0.1:PORT at host.boxd.internal:PORT, and "
              "nothing else of the host (repeat; its forks inherit it).")
@click.option("--egress", "egress", multiple=True, metavar="DEST",
              help="Allow outbound connections to DEST only (repeat): a CIDR, an address "
              "or a host name (resolved now), each with an optional :PORT; `--egress none` "
              "allows none. Default: every public address.")
@click.option("--engine", type=click.Choice(["qemu", "gvisor"]),
              help="Engine to run it on (default: the daemon's; `boxd info` lists them).")
@click.option("--vcpus", type=click.IntRange(1), help="Virtual CPUs.")
@click.option("--memory", "memory_mib", type=click.IntRange(128), metavar="MIB", help="Memory.")
@click.option("--disk", "disk_gib", type=click.IntRange(1), metavar="GIB", help="Disk size.")
@click.option("--suspend-after", type=_DURATION, metavar="DURATION",
              help="Suspend after this long idle (60s, 10m, 1h; 0 never). Default: daemon's.")
@click.option("--hibernate-after", type=_DURATION, metavar="DURATION",
              help="Hibernate after this long idle (0 never). Default: daemon's.")
@click.option("--node", metavar="ID", help="Cluster node to place it on (`boxd nodes list`).")
@label_option("Label it KEY=VALUE (repeat); its forks inherit it; `machine list --label` "
              "and `machine delete --label` select by it.")
@idempotency_option("machine")
@lifetime_options("the machine")
@queue_option("it")
@click.option("--no-start", "no_start", is_flag=True,
              help="With --image: do not start the image's ENTRYPOINT + CMD as its service.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until ready.")
@click.option("--wait-timeout", type=float, default=120.0, show_default=True,
              metavar="SECONDS", help="Seconds to wait until ready.")
@json_option
@pass_state
def machine_new(
    state: _State,
    name: str,
    from_snapshot: str | None,
    image: str | None,
    isolated: bool,
    expose_host: tuple[int, ...],
    egress: tuple[str, ...],
    engine: str | None,
    vcpus: int | None,
    memory_mib: int | None,
    disk_gib: int | None,
    suspend_after: float | None,
    hibernate_after: float | None,
    node: str | None,
    labels: dict[str, str],
    idempotency_key: str | None,
    lifetime: int | None,
    on_timeout: str,
    queue: float,
    no_start: bool,
    wait: bool,
    wait_timeout: float,
    as_json: bool,
) -> None:
    """Create machine NAME and boot it (waits until it is ready unless --no-wait)."""
    b = state.boxd
    m = b.machines.new(
        name,
        vcpus=vcpus,
        memory_mib=memory_mib,
        disk_gib=disk_gib,
        isolated=isolated,
        from_snapshot=from_snapshot,
        suspend_after=suspend_after,
        hibernate_after=hibernate_after,
        engine=engine,
        node=node,
        labels=labels,
        idempotency_key=idempotency_key,
        timeout=lifetime,
        on_timeout=on_timeout,
        image=image,
        wait=queue,
        service=not no_start,
        expose_host=list(expose_host),
        egress=_egress(egress),
    )
    if wait:
        with _render.activity(f"waiting for {m.name} to boot", as_json=as_json):
            m = b.machines.wait_until_ready(m.id, timeout=wait_timeout)
    _show(m, as_json, _render.machine)


@machine.command("list")
@label_option("Only machines labelled KEY=VALUE (repeat: every label must match).")
@click.option("--state", "in_state", type=_STATES, help="Only machines in this state.")
@json_option
@pass_state
def machine_list(state: _State, labels: dict[str, str], in_state: str | None,
                 as_json: bool) -> None:
    """List machines (oldest first)."""
    _show(state.boxd.machines.list(labels=labels, state=in_state), as_json, _render.machines)


@machine.command("info")
@click.argument("name")
@json_option
@pass_state
def machine_info(state: _State, name: str, as_json: bool) -> None:
    """Show one machine (NAME is a name or an id)."""
    _show(state.boxd.machines.get(name), as_json, _render.machine)


@machine.command("url")
@click.argument("name")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True,
              help="the guest TCP port the URL reaches")
@pass_state
def machine_url(state: _State, name: str, port: int) -> None:
    """Print NAME's URL for a guest port (8080 unless --port): use it as given.

    Any HTTP or WebSocket client reaches the guest's server through it; a request wakes
    a suspended or hibernated machine and keeps it awake.
    """
    click.echo(state.boxd.machines.url(name, port=port))


@machine.command("tree")
@click.argument("name", required=False)
@json_option
@pass_state
def machine_tree(state: _State, name: str | None, as_json: bool) -> None:
    """Draw the fork lineage: machine -> forks, snapshots saved, snapshot it came from.

    With NAME, only that machine's subtree. --json prints the SDK's
    `machines.lineage()` (machines and snapshots).
    """
    _show(state.boxd.machines.lineage(name), as_json, _render.machine_tree)


@machine.command("suspend")
@click.argument("name")
@json_option
@pass_state
def machine_suspend(state: _State, name: str, as_json: bool) -> None:
    """Stop NAME's vCPUs; its memory stays resident. Any request wakes it."""
    _show(state.boxd.machines.suspend(name), as_json, _render.machine)


@machine.command("hibernate")
@click.argument("name")
@json_option
@pass_state
def machine_hibernate(state: _State, name: str, as_json: bool) -> None:
    """Write NAME's memory to disk and end its VM. Any request wakes it."""
    _show(state.boxd.machines.hibernate(name), as_json, _render.machine)


@machine.command("set-timeout")
@click.argument("name")
@click.argument("duration", type=_LIFETIME, required=False)
@click.option("--clear", is_flag=True, help="Drop its lifetime: it runs until deleted.")
@click.option("--on-timeout", type=click.Choice(["delete", "hibernate"]),
              help="What the end does. [default: what it was, delete if none]")
@json_option
@pass_state
def machine_set_timeout(state: _State, name: str, duration: int | None, clear: bool,
                        on_timeout: str | None, as_json: bool) -> None:
    """End NAME DURATION from now (90, 90s, 10m, 1h, 2d; at most 30d), extending or
    shortening its lifetime; --clear drops it.

    \b
      boxd machine set-timeout rollout-3 10m
      boxd machine set-timeout rl-base --clear
    """
    if (duration is None) == (not clear):
        raise click.UsageError("give a DURATION or --clear (not both)")
    _show(state.boxd.machines.set_timeout(name, duration, on_timeout=on_timeout), as_json,
          _render.machine)


@machine.command("resume")
@click.argument("name")
@json_option
@pass_state
def machine_resume(state: _State, name: str, as_json: bool) -> None:
    """Wake NAME from suspended or hibernated."""
    _show(state.boxd.machines.resume(name), as_json, _render.machine)


@machine.command("delete")
@click.argument("names", nargs=-1, metavar="[NAME]...")
@label_option("Delete every machine labelled KEY=VALUE (repeat: every label must match), "
              "instead of NAMEs: a crashed run's cleanup.")
@click.option("--state", "in_state", type=_STATES,
              help="With --label: only machines in this state.")
@json_option
@pass_state
def machine_delete(state: _State, names: tuple[str, ...], labels: dict[str, str],
                   in_state: str | None, as_json: bool) -> None:
    """Delete machines (their checkpoints go with them). Tries every NAME.

    \b
    With --label instead of names, deletes every machine that carries the labels:
      boxd machine delete --label boxd.rl/run=r-1a2b3c4d
    """
    if names and labels:
        raise click.UsageError("give NAMEs or --label, not both")
    if not names and not labels:
        raise click.UsageError("give the NAMEs to delete, or --label K=V to delete by "
                               "labels (an empty selector would delete every machine)")
    if in_state is not None and not labels:
        raise click.UsageError("--state selects with --label only")
    if labels:
        _delete_labelled(state, labels, in_state, as_json)
        return
    failed = 0
    for n in names:
        try:
            state.boxd.machines.delete(n)
        except errors.BoxdError as exc:
            if len(names) == 1:
                raise
            click.echo(f"error: {exc}", err=True)
            failed += 1
        else:
            click.echo(f"deleted {n}")
    if failed:
        sys.exit(1)


def _delete_labelled(state: _State, labels: dict[str, str], in_state: str | None,
                     as_json: bool) -> None:
    result = state.boxd.machines.delete_many(labels, state=in_state)
    if as_json:
        _render.print_json(result.model_dump(mode="json"))
    else:
        for m in result.deleted:
            click.echo(f"deleted {m.name} ({m.id})")
        if not result.deleted and not result.errors:
            click.echo("no machine carries those labels")
        for item in result.errors:
            click.echo(f"error: {item.machine.name}: {item.error.message}", err=True)
    if result.errors:
        sys.exit(1)


@machine.command("exec")
@click.argument("name")
@click.argument("command", nargs=-1, required=True)
@click.option("--timeout", type=float, help="Kill the command after this many seconds.")
@click.option("--env", "-e", "env", multiple=True, metavar="K=V", help="Set a variable (repeat).")
@click.option("--cwd", metavar="DIR", help="Working directory in the machine.")
@click.option("--user", "-u", metavar="USER[:GROUP]",
              help="Run as this user (name or uid); default: the image's USER, else root.")
@click.option("--id", "exec_id", metavar="ID",
              help="Run it as a durable exec with this id: it runs on if this command is "
              "interrupted, and `boxd machine exec-result NAME ID` reads its result. The "
              "output is printed at the end, not streamed.")
@pass_state
def machine_exec(
    state: _State,
    name: str,
    command: tuple[str, ...],
    timeout: float | None,
    env: tuple[str, ...],
    cwd: str | None,
    user: str | None,
    exec_id: str | None,
) -> None:
    """Run COMMAND in machine NAME, streaming its output; exit with its exit code
    (124: its --timeout passed; 125: the machine, its engine, agent or node failed, so
    the command has no exit code).

    \b
    One argument is a shell string; several are an argv:
      boxd machine exec rl-base -- 'pip install gymnasium numpy'
      boxd machine exec rl-base -- ls -la /home/boxd
      boxd machine exec --id job-1 rl-base -- make test
    Put options before `--`. At --timeout the command's process group gets SIGTERM,
    then SIGKILL 2 s later.
    """
    variables = _env_pairs(env)
    cmd: str | list[str] = command[0] if len(command) == 1 else list(command)
    if exec_id is not None:
        _durable_exec(state, name, cmd, variables, cwd, timeout, user, exec_id)
    exit_event = None
    try:
        for event in state.boxd.machines.exec_stream(
            name, cmd, env=variables or None, cwd=cwd, timeout=timeout, user=user
        ):
            if event.type == "stdout" and event.data:
                click.echo(event.data, nl=False)
            elif event.type == "stderr" and event.data:
                click.echo(event.data, nl=False, err=True)
            elif event.type == "exit":
                exit_event = event
    except errors.InfrastructureError as exc:
        # Not the command's status: the machine, engine, agent, node or daemon failed.
        fail(str(exc), EXIT_INFRASTRUCTURE)
    if exit_event is None:
        fail("the command's output stream ended without an exit status (see the daemon log)",
             EXIT_INFRASTRUCTURE)
    if exit_event.timed_out:
        fail(
            f"command timed out after {timeout:g} s and was killed"
            if timeout
            else "command timed out and was killed",
            124,
        )
    code = exit_event.exit_code if exit_event.exit_code is not None else 1
    sys.exit(code if 0 <= code <= 255 else 1)


def _env_pairs(env: tuple[str, ...]) -> dict[str, str]:
    """``--env K=V`` options as a mapping. Raises: click.BadParameter: not K=V."""
    variables: dict[str, str] = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected K=V, got {item!r}", param_hint="--env")
        variables[key] = value
    return variables


def _durable_exec(state: _State, name: str, cmd: str | list[str], variables: dict[str, str],
                  cwd: str | None, timeout: float | None, user: str | None,
                  exec_id: str) -> NoReturn:
    """`machine exec --id`: the whole output at the end; exit with the command's code."""
    try:
        res = state.boxd.machines.exec(name, cmd, env=variables or None, cwd=cwd,
                                       timeout=timeout, user=user, exec_id=exec_id)
    except errors.InfrastructureError as exc:
        fail(str(exc), EXIT_INFRASTRUCTURE)
    except errors.ExecTimeout as exc:
        click.echo(str(exc.details.get("stdout") or ""), nl=False)
        click.echo(str(exc.details.get("stderr") or ""), nl=False, err=True)
        fail(f"command timed out after {timeout or 0:g} s and was killed", 124)
    click.echo(res.stdout, nl=False)
    click.echo(res.stderr, nl=False, err=True)
    sys.exit(res.exit_code if 0 <= res.exit_code <= 255 else 1)


@machine.command("logs")
@click.argument("name")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output until the "
              "service exits (Ctrl-C stops).")
@pass_state
def machine_logs(state: _State, name: str, follow: bool) -> None:
    """Print machine NAME's service output: its image's ENTRYPOINT + CMD, stdout and
    stderr as written (the node keeps the last 64 KiB)."""
    b = state.boxd
    after: int | None = None
    while True:
        out = b.machines.logs(name, after=after, wait=30.0 if follow and after else 0.0)
        if out.start > (after or 0) and after is not None:
            click.echo(f"[{out.start - after} bytes dropped]", err=True)
        click.echo(out.data, nl=False)
        after = out.end
        if not follow or out.state == "exited":
            break
    if follow and out.state == "exited":
        click.echo(f"[the service exited: {out.exit_code}]", err=True)


@machine.command("metrics")
@click.argument("name")
@click.option("--since", type=click.FloatRange(0), default=None, metavar="SECONDS",
              help="Only the samples of the last SECONDS.")
@json_option
@pass_state
def machine_metrics(state: _State, name: str, since: float | None, as_json: bool) -> None:
    """Show machine NAME's CPU, memory and disk use, read inside its guest, oldest first.

    Asking takes a sample now if the machine runs and samples it every 5 s for the next
    5 minutes (the node keeps the last 120); a sleeping machine is not woken.
    """
    start = None if since is None else time.time() - since
    _show(state.boxd.machines.metrics(name, start=start), as_json, _render.metrics)


@machine.command("execs")
@click.argument("name")
@click.option("--limit", "-n", type=click.IntRange(1, 64), default=20, show_default=True,
              help="How many, newest first.")
@json_option
@pass_state
def machine_execs(state: _State, name: str, limit: int, as_json: bool) -> None:
    """List machine NAME's recent execs, newest first: id, exit, start, duration and
    command (`boxd machine exec-result NAME ID` prints one's output)."""
    _show(state.boxd.machines.execs(name, limit=limit), as_json, _render.execs)


@machine.command("exec-result")
@click.argument("name")
@click.argument("exec_id", metavar="ID")
@click.option("--wait", type=click.FloatRange(0, 600), default=0.0, show_default=True,
              help="Seconds to wait for a running exec to end.")
@json_option
@pass_state
def machine_exec_result(state: _State, name: str, exec_id: str, wait: float,
                        as_json: bool) -> None:
    """Print the output of exec ID (`boxd machine exec --id ID`) in machine NAME, running
    or finished, and exit with its exit code (3: it still runs).

    Only the last MiB of each stream is kept; results are kept 15 minutes after the exec
    ends (the last 64 per machine), not across a daemon restart.
    """
    st = state.boxd.machines.exec_result(name, exec_id, wait=wait)
    if as_json:
        click.echo(st.model_dump_json(indent=2))
    else:
        click.echo(st.stdout, nl=False)
        click.echo(st.stderr, nl=False, err=True)
        if st.stdout_truncated or st.stderr_truncated:
            click.echo("(earlier output was dropped: only the last MiB of each stream is "
                       "kept)", err=True)
    if st.running:
        if not as_json:
            click.echo(f"exec {exec_id} still runs", err=True)
        sys.exit(3)
    if st.error is not None:
        fail(f"the exec ended without an exit status: {st.error.message}")
    if st.timed_out:
        fail("command timed out and was killed", 124)
    code = st.exit_code if st.exit_code is not None else 1
    sys.exit(code if 0 <= code <= 255 else 1)


@machine.command("fork")
@click.argument("src")
@click.argument("new", nargs=-1, metavar="[NEW]...")
@click.option(
    "--count", "-n", type=click.IntRange(1, 64), help="Fork N children (names generated)."
)
@click.option("--node", default=None, help="Put the children on this cluster node "
              "(`boxd nodes list`; QEMU machines only). [default: the source's node while "
              "it has room, then the others]")
@label_option("Label the children KEY=VALUE (repeat), over the labels they inherit from SRC.")
@idempotency_option("children")
@lifetime_options("each child (not inherited from SRC):")
@queue_option("each child")
@json_option
@pass_state
def machine_fork(
    state: _State, src: str, new: tuple[str, ...], count: int | None, node: str | None,
    labels: dict[str, str], idempotency_key: str | None, lifetime: int | None,
    on_timeout: str, queue: float, as_json: bool,
) -> None:
    """Fork running machine SRC into NEW (the child continues from the same instruction).

    Several NEW names, or --count, fork a batch; each child is reported on its own.
    """
    b = state.boxd
    if count is None and len(new) <= 1:
        m = b.machines.fork(src, new[0] if new else None, node=node, labels=labels,
                            idempotency_key=idempotency_key, timeout=lifetime,
                            on_timeout=on_timeout, wait=queue)
        _show(m, as_json, _render.machine)
        return
    results = (
        b.machines.fork(src, names=list(new), count=count, node=node, labels=labels,
                        idempotency_key=idempotency_key, timeout=lifetime,
                        on_timeout=on_timeout, wait=queue)
        if new
        else b.machines.fork(src, count=count or 1, node=node, labels=labels,
                             idempotency_key=idempotency_key, timeout=lifetime,
                             on_timeout=on_timeout, wait=queue)
    )
    made = [r for r in results if not isinstance(r, errors.BoxdError)]
    errs = [r for r in results if isinstance(r, errors.BoxdError)]
    _show(made, as_json, _render.machines)
    for e in errs:
        click.echo(f"error: {e}", err=True)
    if errs:
        sys.exit(1)


@machine.command("warm")
@click.argument("name")
@click.option("--forks", "-n", type=click.IntRange(0, 64), required=True,
              help="Standby forks to keep ready (0 releases them).")
@json_option
@pass_state
def machine_warm(state: _State, name: str, forks: int, as_json: bool) -> None:
    """Prepare standby forks of NAME's current state; returns once they are ready.

    The next N forks of the unchanged machine claim them instead of starting children.
    They use no CPU while they wait; a change to NAME (an exec, an upload, a restore)
    discards them. They count against no quota until claimed, but an account holds no
    more than its quota would let it claim, and at most its share of the node's.
    """
    with _render.activity(f"preparing {forks} standby forks of {name}", as_json=as_json):
        s = state.boxd.machines.warm(name, forks=forks)
    _show(s, as_json, _render.standby)


@machine.group("files", context_settings=_CONTEXT)
def machine_files() -> None:
    """Copy files into and out of a machine."""


@machine_files.command("upload")
@click.argument("name")
@click.argument("local", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("remote")
@click.option("--mode", default="644", show_default=True, help="Permission bits, octal.")
@click.option("--user", default=None, metavar="NAME[:GROUP]",
              help="The file's owner (and that of the directories the upload makes), from "
              "the machine's /etc/passwd; default: root.")
@pass_state
def files_upload(state: _State, name: str, local: Path, remote: str, mode: str,
                 user: str | None) -> None:
    """Copy LOCAL file to absolute path REMOTE in machine NAME."""
    try:
        bits = int(mode, 8)
    except ValueError:
        raise click.BadParameter(f"not an octal mode: {mode!r}", param_hint="--mode") from None
    info = state.boxd.machines.files.upload(name, remote, local.read_bytes(), mode=bits,
                                            user=user)
    click.echo(f"uploaded {local} -> {name}:{info.path} ({info.size} bytes)")


@machine_files.command("download")
@click.argument("name")
@click.argument("remote")
@click.argument("local", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path))
@pass_state
def files_download(state: _State, name: str, remote: str, local: Path) -> None:
    """Copy REMOTE file of machine NAME to LOCAL ('-' for stdout)."""
    data = state.boxd.machines.files.download(name, remote)
    if str(local) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    local.write_bytes(data)
    click.echo(f"downloaded {name}:{remote} -> {local} ({len(data)} bytes)", err=True)


@machine.group("checkpoint", context_settings=_CONTEXT)
def machine_checkpoint() -> None:
    """Save a machine's moment and rewind it in place (checkpoints die with the machine)."""


@machine_checkpoint.command("save")
@click.argument("machine_ref", metavar="MACHINE")
@click.argument("name")
@pass_state
def checkpoint_save(state: _State, machine_ref: str, name: str) -> None:
    """Save checkpoint NAME of MACHINE."""
    c = state.boxd.machines.checkpoints.save(machine_ref, name)
    click.echo(f"saved checkpoint {c.name} of {machine_ref}")


@machine_checkpoint.command("restore")
@click.argument("machine_ref", metavar="MACHINE")
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@pass_state
def checkpoint_restore(state: _State, machine_ref: str, name: str, yes: bool) -> None:
    """Rewind MACHINE in place to checkpoint NAME (its current state is lost)."""
    if not yes:
        click.confirm(
            f"Rewind {machine_ref} to checkpoint {name}? Its current state is lost.",
            abort=True,
        )
    state.boxd.machines.checkpoints.restore(machine_ref, name)
    click.echo(f"restored {machine_ref} to checkpoint {name}")


@machine_checkpoint.command("list")
@click.argument("machine_ref", metavar="MACHINE")
@json_option
@pass_state
def checkpoint_list(state: _State, machine_ref: str, as_json: bool) -> None:
    """List the checkpoints of MACHINE."""
    _show(state.boxd.machines.checkpoints.list(machine_ref), as_json, _render.checkpoints)


@machine_checkpoint.command("delete")
@click.argument("machine_ref", metavar="MACHINE")
@click.argument("name")
@pass_state
def checkpoint_delete(state: _State, machine_ref: str, name: str) -> None:
    """Delete checkpoint NAME of MACHINE."""
    state.boxd.machines.checkpoints.delete(machine_ref, name)
    click.echo(f"deleted checkpoint {name} of {machine_ref}")


# --- snapshots -----------------------------------------------------------------------


@main.group(context_settings=_CONTEXT)
def snapshots() -> None:
    """Durable, named, versioned machine images (NAME, NAME@N or sha256:DIGEST)."""


@snapshots.command("save")
@click.argument("machine_ref", metavar="MACHINE")
@click.argument("name")
@click.option("--new-version", is_flag=True, help="Add a version if NAME exists already.")
@json_option
@pass_state
def snapshots_save(
    state: _State, machine_ref: str, name: str, new_version: bool, as_json: bool
) -> None:
    """Save MACHINE as snapshot NAME (the machine keeps running)."""
    # The daemon does the work in one request: a spinner with the elapsed time.
    with _render.activity(f"saving {machine_ref} as {name}", as_json=as_json):
        s = state.boxd.snapshots.save(machine_ref, name, new_version=new_version)
    _show(s, as_json, _render.snapshot)


@snapshots.command("list")
@json_option
@pass_state
def snapshots_list(state: _State, as_json: bool) -> None:
    """List snapshots (every version)."""
    _show(state.boxd.snapshots.list(), as_json, _render.snapshots)


@snapshots.command("tree")
@json_option
@pass_state
def snapshots_tree(state: _State, as_json: bool) -> None:
    """Draw snapshot lineage: name -> versions (digest, source machine) -> machines made.

    --json prints the SDK's `machines.lineage()` (machines and snapshots).
    """
    _show(state.boxd.machines.lineage(), as_json, _render.snapshot_tree)


@snapshots.command("info")
@click.argument("ref")
@json_option
@pass_state
def snapshots_info(state: _State, ref: str, as_json: bool) -> None:
    """Show snapshot REF."""
    _show(state.boxd.snapshots.get(ref), as_json, _render.snapshot)


@snapshots.command("delete")
@click.argument("refs", nargs=-1, required=True, metavar="REF...")
@pass_state
def snapshots_delete(state: _State, refs: tuple[str, ...]) -> None:
    """Delete snapshot versions."""
    for r in refs:
        state.boxd.snapshots.delete(r)
        click.echo(f"deleted snapshot {r}")


@snapshots.command("export")
@click.argument("ref")
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="File to write.",
)
@pass_state
def snapshots_export(state: _State, ref: str, output: Path) -> None:
    """Write snapshot REF to one file, for `boxd snapshots import` elsewhere."""
    with _render.transfer(f"exporting {ref}") as progress:
        path = state.boxd.snapshots.export(ref, output, progress=progress)
    click.echo(f"exported {ref} -> {path} ({_render.size(path.stat().st_size)})")


@snapshots.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
@pass_state
def snapshots_import(state: _State, file: Path, as_json: bool) -> None:
    """Import a snapshot file written by `boxd snapshots export`."""
    with _render.transfer(f"importing {file.name}", as_json=as_json) as progress:
        s = state.boxd.snapshots.import_(file, progress=progress)
    _show(s, as_json, _render.snapshot)


# --- keys, info, serve, image ----------------------------------------------------------


@main.group(context_settings=_CONTEXT)
def keys() -> None:
    """Create, list and revoke API keys."""


@keys.command("create")
@click.argument("name")
@click.option("--account", help="Account the key acts for (admin keys only).")
@json_option
@pass_state
def keys_create(state: _State, name: str, account: str | None, as_json: bool) -> None:
    """Create API key NAME and print its secret (shown only once)."""
    k = state.boxd.keys.create(name, account=account)
    if as_json:
        _render.print_json(k)
        return
    click.echo(k.secret)
    click.echo(f"created key {k.id} ({k.name}); the secret above is shown only once", err=True)


@keys.command("list")
@json_option
@pass_state
def keys_list(state: _State, as_json: bool) -> None:
    """List API keys."""
    _show(state.boxd.keys.list(), as_json, _render.keys)


@keys.command("revoke")
@click.argument("key_id", metavar="ID")
@pass_state
def keys_revoke(state: _State, key_id: str) -> None:
    """Revoke key ID."""
    state.boxd.keys.revoke(key_id)
    click.echo(f"revoked {key_id}")


@main.command("info")
@json_option
@pass_state
def info(state: _State, as_json: bool) -> None:
    """Show the host: accelerator (and why), QEMU version, data directory."""
    # The first call may take a while (the daemon probes the host and prepares its image).
    with _render.activity("asking the daemon about the host", as_json=as_json):
        host = state.boxd.info()
    _show(host, as_json, _render.host)


@main.command("demo")
@click.option("--reuse", is_flag=True, help="Use an existing rl-base (and add an env-v3 version).")
@click.option("--keep", is_flag=True, help="Keep the machines and snapshot it made.")
@pass_state
def demo(state: _State, reuse: bool, keep: bool) -> None:
    """Run the reproducible-RL spec end to end: warm rl-base, fork 8 rollouts, verify."""
    from boxd.demo import run_demo

    sys.exit(run_demo(state.boxd, reuse=reuse, keep=keep))


@main.command("serve")
@click.option("--listen", metavar="HOST:PORT", help="Also serve HTTP on TCP (e.g. 127.0.0.1:7070).")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Run the machines on a Ray cluster's boxd nodes (ADDRESS of its head, or "
              "auto); env BOXD_RAY_ADDRESS. See docs/cluster.md.")
def serve(listen: str | None, ray_address: str | None) -> None:
    """Run the daemon in the foreground (clients start one on demand otherwise).

    Needs the server extra: pip install 'boxd[server]' (and 'boxd[ray]' for --ray).
    """
    from boxd._server_deps import require_server

    require_server()  # a light install gets one line naming the extra, not a traceback
    from boxd.api.server import serve as run  # heavy: FastAPI, engine

    if ray_address:
        os.environ["BOXD_RAY_ADDRESS"] = ray_address
    run(Paths.default(), listen=listen)


@main.group("e2b", context_settings=_CONTEXT)
def e2b() -> None:
    """Run code written for E2B's SDKs on this daemon (docs/e2b.md)."""


@e2b.command("env")
@click.option("--e2b-url", metavar="URL",
              help="The daemon's E2B URL (for a daemon on another host: its BOXD_E2B_LISTEN). "
              "Default: the local daemon's, from <data dir>/e2b.url.")
@pass_state
def e2b_env(state: _State, e2b_url: str | None) -> None:
    """Print the shell exports that point E2B's SDKs at this daemon.

    \b
    eval "$(boxd e2b env)"
    python my_e2b_agent.py     # unchanged E2B code now runs on boxd

    E2B_API_KEY is an e2b_<hex> spelling of your boxd API key (same account; revoking
    the key revokes it). Starts the local daemon if needed.
    """
    from boxd.config import ClientSettings
    from boxd.e2b.env import to_e2b_key, url_file

    state.boxd.keys.list()  # the daemon answers (started if local) and the key is valid
    paths = Paths.default()
    client = ClientSettings.from_env()
    key = _api_key(state, paths)
    url = e2b_url
    if url is None:
        if state.url or client.url:
            fail("the daemon is remote: give its E2B URL with --e2b-url "
                 "(its BOXD_E2B_LISTEN, e.g. http://HOST:3000)")
        try:
            url = url_file(paths.home).read_text().strip()
        except OSError:
            fail(f"the daemon serves no E2B API (no {url_file(paths.home)}): see "
                 f"BOXD_E2B_LISTEN and its log {paths.log}")
    url = url.rstrip("/")
    for name, value in (("E2B_API_URL", url), ("E2B_SANDBOX_URL", url),
                        ("E2B_API_KEY", to_e2b_key(key))):
        click.echo(f"export {name}={value}")


@e2b.command("warm")
@click.argument("template")
@click.option("--forks", default=8, show_default=True, type=click.IntRange(0, 64),
              help="Standby forks to keep ready (0 releases them; the machine stays).")
@click.option("--isolated", is_flag=True,
              help="For sandboxes created with allow_internet_access=False.")
@json_option
@pass_state
def e2b_warm(state: _State, template: str, forks: int, isolated: bool,
             as_json: bool) -> None:
    """Make E2B creates of TEMPLATE forks of one running machine.

    \b
    boxd e2b warm base --forks 8
    boxd e2b warm my-snapshot          # a boxd snapshot name is an E2B template
    boxd e2b warm envs/tool:v1         # so is an image name (boxd image list)

    Starts (once) a machine of TEMPLATE labelled boxd.e2b/template=TEMPLATE and keeps
    FORKS standby forks of it: Sandbox.create(TEMPLATE) then claims one (a live
    copy-on-write fork, tens of ms) instead of booting or restoring a machine. Every
    sandbox starts from the same bytes. Undo it with
    `boxd machine delete --label boxd.e2b/template=TEMPLATE`.
    """
    import json
    import secrets

    from boxd.e2b.env import source_labels

    b = state.boxd
    labels = source_labels(template)
    found = [m for m in b.machines.list(labels=labels, state="running")
             if m.isolated == isolated]
    if found:
        src = found[0]
    else:
        # A source that sleeps forks slowly. As for a create of TEMPLATE: boxd's default
        # image for base, else the snapshot of that name, else the image of that name.
        kw: dict[str, Any] = {"isolated": isolated, "labels": labels, "suspend_after": 0,
                              "hibernate_after": 0}
        name = f"e2b-warm-{secrets.token_hex(4)}"
        try:
            src = b.machines.new(name, from_snapshot=None if template == "base"
                                 else template, **kw)
        except errors.SnapshotNotFound:
            try:
                src = b.machines.new(name, image=template, **kw)
            except errors.NotFound:
                fail(f"template {template!r} not found: no snapshot and no image has that "
                     "name (a built-in template such as code-interpreter-v1 is made by "
                     "its first Sandbox.create: warm it after that)")
        b.machines.wait_until_ready(src.id, timeout=300)
        # E2B's base template works in /home/user (what a cold create makes first).
        r = b.machines.exec(src.id, ["mkdir", "-p", "/home/user"], timeout=60)
        if r.exit_code != 0:
            fail(f"preparing {src.name} failed: {r.stderr.strip()}")
    standby = b.machines.warm(src.id, forks)
    if as_json:
        click.echo(json.dumps({"template": template, "machine": src.id, "name": src.name,
                               "forks": standby.forks,
                               "memory_bytes": standby.memory_bytes}))
        return
    click.echo(f"template {template} is warm: machine {src.name}, {standby.forks} standby "
               f"forks ({standby.memory_bytes / 2**20:.0f} MiB)")


def _api_key(state: _State, paths: Paths) -> str:
    """The API key the CLI uses: --api-key, BOXD_API_KEY, else the local key file."""
    from boxd.config import ClientSettings

    key = state.api_key or ClientSettings.from_env().api_key
    if key is None:
        try:
            key = (paths.home / "local.key").read_text().strip()
        except OSError as exc:
            fail(f"cannot read the local key {paths.home / 'local.key'}: {exc.strerror} "
                 "(pass --api-key or set BOXD_API_KEY)")
    return key


@main.command("console")
@click.option("--print-url", is_flag=True,
              help="Print the login URL and exit instead of opening a browser.")
@click.option("--console-url", metavar="URL",
              help="The daemon's console URL (for a daemon on another host: its "
              "BOXD_CONSOLE_LISTEN). Default: the local daemon's, from <data dir>/console.url.")
@pass_state
def console(state: _State, print_url: bool, console_url: str | None) -> None:
    """Open the web console (your account's machines, fork trees, snapshots) in a browser.

    \b
    boxd console               # opens it, logged in
    boxd console --print-url   # prints the login URL (good once, for a minute)

    The URL carries a one-time login token for your API key's account; the console
    trades it for a session cookie (docs/console.md). Starts the local daemon if needed.
    """
    import webbrowser

    from boxd.config import ClientSettings
    from boxd.console.login import login_url, url_file

    state.boxd.keys.list()  # the daemon answers (started if local) and the key is valid
    paths = Paths.default()
    key = _api_key(state, paths)
    url = console_url
    if url is None:
        if state.url or ClientSettings.from_env().url:
            fail("the daemon is remote: give its console URL with --console-url "
                 "(its BOXD_CONSOLE_LISTEN, e.g. http://HOST:7071)")
        try:
            url = url_file(paths.home).read_text().strip()
        except OSError:
            fail(f"the daemon serves no console (no {url_file(paths.home)}): see "
                 f"BOXD_CONSOLE_LISTEN and its log {paths.log}")
    login = login_url(url, key)
    if print_url or not webbrowser.open(login):
        click.echo(login)


@main.group(context_settings=_CONTEXT)
def nodes() -> None:
    """The nodes machines run on (one on a single host; each boxd node of a Ray cluster)."""


@nodes.command("list")
@json_option
@pass_state
def nodes_list(state: _State, as_json: bool) -> None:
    """List nodes: id, address, health, machines, cap and free memory."""
    _show(state.boxd.nodes.list(), as_json, _render.nodes)


@main.group(context_settings=_CONTEXT)
def accounts() -> None:
    """Accounts and their machine limits (the operator, account local, changes them)."""


@accounts.command("list")
@json_option
@pass_state
def accounts_list(state: _State, as_json: bool) -> None:
    """List accounts with their limits and the machines counting against them."""
    _show(state.boxd.accounts.list(), as_json, _render.accounts)


@accounts.command("update")
@click.argument("name")
@click.option("--max-machines", type=click.IntRange(0), required=True, metavar="N",
              help="Concurrent machines the account may have (hibernated ones do not count).")
@json_option
@pass_state
def accounts_update(state: _State, name: str, max_machines: int, as_json: bool) -> None:
    """Change account NAME's limit (operator only)."""
    _show(state.boxd.accounts.update(name, max_machines=max_machines), as_json,
          lambda a: _render.accounts([a]))


@main.group(context_settings=_CONTEXT)
def image() -> None:
    """Import container images, and build guest images (kernel, initramfs, root fs)."""


@image.command("build")
@click.argument("context", required=False,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-t", "--tag", "tag", metavar="NAME[:TAG]",
              help="Build the Dockerfile in CONTEXT into the image store as NAME[:TAG].")
@click.option("-f", "--file", "dockerfile", default="Dockerfile", show_default=True,
              metavar="PATH", help="The Dockerfile, relative to CONTEXT.")
@click.option("--build-arg", "build_args", multiple=True, metavar="K=V",
              help="An ARG value (repeat).")
@click.option("--target", metavar="STAGE", help="The stage to build (default: the last).")
@click.option("--apt", multiple=True, metavar="PKG",
              help="Recipe build: an extra Debian package (repeat).")
@click.option("--pip", multiple=True, metavar="PKG",
              help="Recipe build: an extra pip package (repeat).")
@click.option("--force", is_flag=True, help="Recipe build: rebuild even if the image exists.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def image_build(ctx: click.Context, context: Path | None, tag: str | None, dockerfile: str,
                build_args: tuple[str, ...], target: str | None, apt: tuple[str, ...],
                pip: tuple[str, ...], force: bool, as_json: bool) -> None:
    """Build an image: `-t NAME CONTEXT` builds a Dockerfile (through the daemon, with
    buildah); without -t, the guest image for a recipe (--apt/--pip; cached: a second
    build is instant)."""
    if tag is not None or context is not None:
        if tag is None or context is None or apt or pip or force:
            raise click.UsageError("a Dockerfile build takes -t NAME[:TAG] and CONTEXT "
                                   "(and no --apt, --pip or --force)")
        args = {}
        for item in build_args:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise click.BadParameter(f"{item!r} is not K=V", param_hint="--build-arg")
            args[key] = value
        ctx.invoke(_dockerfile_build, context=context, tag=tag, dockerfile=dockerfile,
                   build_args=args, target=target, as_json=as_json)
        return
    from boxd.images import Recipe, ensure_image

    with _render.activity("building guest image", as_json=as_json) as progress:
        img = ensure_image(
            Paths.default(), Recipe(apt=apt, pip=pip), progress=progress, force=force
        )
    if as_json:
        _render.print_json(img)
        return
    _render.details([("key", img.key), ("kernel", img.kernel_version), ("dir", img.dir)])


@click.command()
@pass_state
def _dockerfile_build(state: _State, context: Path, tag: str, dockerfile: str,
                      build_args: dict[str, str], target: str | None, as_json: bool) -> None:
    with _render.activity(f"building {tag}", as_json=as_json):
        img = state.boxd.images.build(context, tag, dockerfile=dockerfile,
                                      build_args=build_args, target=target)
    _show(img, as_json, _render.oci_image)


@image.command("import")
@click.argument("source")
@click.argument("name")
@click.option("--creds", metavar="USER:PASSWORD",
              help="Registry credentials (default: ~/.docker/config.json of the daemon's user).")
@click.option("--insecure", is_flag=True, help="Allow a registry on plain HTTP.")
@json_option
@pass_state
def image_import(state: _State, source: str, name: str, creds: str | None, insecure: bool,
                 as_json: bool) -> None:
    """Import a container image as NAME[:TAG]; layers are stored once.

    SOURCE: oci:DIR[:REF], oci-archive:FILE[:REF], docker-archive:FILE[:REPO:TAG] or
    docker://HOST[:PORT]/REPO[:TAG|@DIGEST] (paths are on the daemon's host).
    """
    with _render.activity(f"importing {source}", as_json=as_json) as progress:
        img = state.boxd.images.import_(source, name, creds=creds, insecure=insecure,
                                        progress=progress)
    _show(img, as_json, _render.oci_image)


@image.command("list")
@click.option("--recipes", is_flag=True,
              help="List the guest images built from recipes (`boxd image build`) instead.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def image_list(ctx: click.Context, recipes: bool, as_json: bool) -> None:
    """List imported container images (with --recipes: built guest images)."""
    if not recipes:
        ctx.invoke(_oci_image_list, as_json=as_json)
        return
    from boxd.images import list_images

    imgs = list_images(Paths.default())
    if as_json:
        _render.print_json(imgs)
        return
    _render.table(
        ["KEY", "KERNEL", "APT", "PIP", "DIR"],
        (
            [
                i.key,
                i.kernel_version,
                " ".join(i.recipe.apt) or "-",
                " ".join(i.recipe.pip) or "-",
                str(i.dir),
            ]
            for i in imgs
        ),
        "no images (run `boxd image build`)",
    )


@click.command()
@json_option
@pass_state
def _oci_image_list(state: _State, as_json: bool) -> None:
    _show(state.boxd.images.list(), as_json, _render.oci_images)


@image.command("inspect")
@click.argument("name")
@json_option
@pass_state
def image_inspect(state: _State, name: str, as_json: bool) -> None:
    """Show image NAME[:TAG]: digest, layers and its run config."""
    _show(state.boxd.images.get(name), as_json, _render.oci_image)


@image.command("rm")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@pass_state
def image_rm(state: _State, names: tuple[str, ...]) -> None:
    """Remove images; layers no other image holds are freed."""
    for n in names:
        img = state.boxd.images.remove(n)
        click.echo(f"removed image {img.name} ({img.digest[:19]})")


def _show(obj: Any, as_json: bool, render: Any) -> None:
    if as_json:
        _render.print_json(obj)
    else:
        render(obj)


# --- rl (boxd.rl; gymnasium is imported only when a command runs) -------------------

from boxd.cli._rl import rl as _rl_group  # noqa: E402 - after main, to register on it

main.add_command(_rl_group)


def run(argv: Sequence[str] | None = None) -> None:
    """Entry point for embedding: ``run(["machine", "list"])``."""
    main.main(args=list(argv) if argv is not None else None, prog_name="boxd")
