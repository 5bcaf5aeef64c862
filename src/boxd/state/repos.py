"""Repositories: every SQL statement of the daemon's domain, returning frozen records.

Plain SQL, so a server database can replace SQLite. Layers above call these methods
and never see a connection or a row.
"""

from __future__ import annotations

import builtins
import functools
import json
import secrets
import sqlite3
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import ParamSpec, TypeVar

from boxd.errors import AlreadyExists, Conflict, QuotaExceeded
from boxd.models import MachineState
from boxd.net_policy import DEFAULT as DEFAULT_POLICY
from boxd.net_policy import NetPolicy
from boxd.state._db import Database, new_id
from boxd.state.records import (
    AccountRecord,
    CheckpointRecord,
    Garbage,
    IdempotencyRecord,
    KeyRecord,
    LayerRecord,
    MachineRecord,
    RunImage,
    SnapshotRecord,
    TemplateRecord,
)

# Machine columns a node runtime writes (the rest is the control plane's).
_RUNTIME_COLUMNS = frozenset(
    {"layer_id", "template_id", "ram_shared", "pid", "vm_id", "port", "fwd_port", "error",
     "accel", "last_active"}
)
# States that hold a quota slot: every state but these.
_FREE_STATES = "('deleting','hibernated')"
_FREE = frozenset({MachineState.DELETING, MachineState.HIBERNATED})  # (the same, as a set)


def _json_or_null(value: object) -> str | None:
    return None if value is None else json.dumps(value)


def _nothing() -> None:
    pass

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _writes(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """A write whose constraint failed is a typed `Conflict`, never a bare sqlite3 error.

    A foreign key fails when the row a write refers to went meanwhile (a layer on a
    template's layer collected by a concurrent delete, a machine deleted while its
    checkpoint was recorded); a unique key when a concurrent write took the name. The
    caller's own checks come first, so this is the last line: a 409 naming the write.
    """

    @functools.wraps(fn)
    def guarded(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except sqlite3.IntegrityError as exc:
            what = fn.__qualname__.lower().replace(".", " ")
            raise Conflict(
                f"cannot record it ({what}): {exc}; a record it refers to was deleted or "
                "changed meanwhile", hint="retry; a concurrent request deleted or changed it",
            ) from exc

    return guarded


class Machines:
    """The ``machines`` table."""

    def __init__(self, db: Database) -> None:
        self._db = db
        #: Called (from any thread) after a machine left its account's quota: deleted,
        #: or moved to a state that does not count (the control plane's admission).
        self.on_free: Callable[[], None] = _nothing

    def get(self, machine_id: str) -> MachineRecord | None:
        row = self._db.one("SELECT * FROM machines WHERE id=?", (machine_id,))
        return MachineRecord.of(row) if row else None

    def find(self, account: str, ref: str) -> MachineRecord | None:
        """A machine of ``account`` by id or name (deleting ones included)."""
        row = self._db.one(
            "SELECT * FROM machines WHERE account_id=? AND (id=? OR name=?)", (account, ref, ref)
        )
        return MachineRecord.of(row) if row else None

    def run_image_digests(self) -> set[str]:
        """The manifest digest of every container image a machine runs (any account,
        any state: a machine being deleted still has its disk on it)."""
        rows = self._db.all(
            "SELECT DISTINCT json_extract(run_image, '$.digest') AS d FROM machines "
            "WHERE run_image IS NOT NULL", ())
        return {str(r["d"]) for r in rows if r["d"]}

    def list(self, account: str) -> builtins.list[MachineRecord]:
        rows = self._db.all(
            "SELECT * FROM machines WHERE account_id=? AND state!='deleting' ORDER BY created_at",
            (account,),
        )
        return [MachineRecord.of(r) for r in rows]

    def page(
        self, account: str, *, labels: Mapping[str, str] | None = None,
        state: MachineState | None = None, after: tuple[float, str] | None = None,
        limit: int = 100,
    ) -> builtins.list[MachineRecord]:
        """Up to ``limit`` machines of ``account`` (deleting ones excluded) after the
        key ``after`` (``(created_at, id)`` of the last one of the previous page), in that
        order, that carry every label of ``labels`` and are in ``state`` if given.

        One indexed query per page (``machines_by_account`` from the key, each label an
        ``EXISTS`` on the ``machine_labels`` primary key): a page costs the same at the
        10,000th machine as at the first.
        """
        where = ["m.account_id=?", "m.state!='deleting'"]
        params: builtins.list[object] = [account]
        if state is not None:
            where.append("m.state=?")
            params.append(state.value)
        if after is not None:
            where.append("(m.created_at, m.id) > (?, ?)")
            params.extend(after)
        for key, value in sorted((labels or {}).items()):
            where.append("EXISTS (SELECT 1 FROM machine_labels l WHERE l.machine_id=m.id"
                         " AND l.key=? AND l.value=?)")
            params.extend((key, value))
        rows = self._db.all(
            f"SELECT m.* FROM machines m WHERE {' AND '.join(where)}"
            " ORDER BY m.created_at, m.id LIMIT ?", (*params, limit))
        return [MachineRecord.of(r) for r in rows]

    def in_states(
        self, states: Iterable[MachineState], node_id: str
    ) -> builtins.list[MachineRecord]:
        names = [st.value for st in states]
        rows = self._db.all(
            f"SELECT * FROM machines WHERE node_id=? AND state IN ({','.join('?' * len(names))})"
            " ORDER BY created_at",
            (node_id, *names),
        )
        return [MachineRecord.of(r) for r in rows]

    def ids(self) -> set[str]:
        return {r["id"] for r in self._db.all("SELECT id FROM machines")}

    def vm_ids(self) -> set[str]:
        return {r["vm_id"] for r in self._db.all("SELECT vm_id FROM machines")}

    @_writes
    def claim(
        self, account: str, name: str, *, machine_id: str, vcpus: int, memory_mib: int,
        disk_gib: int, isolated: bool, image: str, node_id: str, engine: str,
        parent_id: str | None = None, snapshot: str | None = None,
        default_quota: int, suspend_after: float | None = None,
        hibernate_after: float | None = None, url_public: bool = False,
        labels: Mapping[str, str] | None = None, end_at: float | None = None,
        on_timeout: str | None = None, run_image: RunImage | None = None,
        net: NetPolicy = DEFAULT_POLICY,
    ) -> MachineRecord:
        """Claim a name and a quota slot and insert the record (state ``starting``),
        with a new URL token (a machine's own: a new one even for the same name), its
        ``labels`` (checked by the caller) and its lifetime's end, in one transaction.

        Raises:
            QuotaExceeded: the account's concurrent machines would exceed its quota.
            AlreadyExists: the account has a machine of that name.
        """
        with self._db.transaction() as conn:
            _check_quota(conn, account, default_quota)
            if conn.execute(
                "SELECT 1 FROM machines WHERE account_id=? AND name=?", (account, name)
            ).fetchone():
                raise AlreadyExists(
                    f"a machine named {name!r} already exists", kind="machine", name=name,
                    hint="pick another name or delete the existing machine",
                )
            conn.execute(
                "INSERT INTO machines (id, account_id, name, state, vcpus, memory_mib, disk_gib,"
                " isolated, image, parent_id, snapshot, created_at, node_id, engine, vm_id,"
                " last_active, suspend_after, hibernate_after, url_token, url_public, labels,"
                " end_at, on_timeout, run_image, net_policy)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (machine_id, account, name, MachineState.STARTING.value, vcpus, memory_mib,
                 disk_gib, int(isolated), image, parent_id, snapshot, time.time(), node_id,
                 engine, machine_id, time.time(), suspend_after, hibernate_after,
                 secrets.token_hex(16), int(url_public), json.dumps(dict(labels or {})),
                 end_at, on_timeout if end_at is not None else None,
                 json.dumps(run_image.to_json()) if run_image is not None else None,
                 _json_or_null(net.to_json())),
            )
            conn.executemany(
                "INSERT INTO machine_labels (machine_id, key, value) VALUES (?,?,?)",
                [(machine_id, k, v) for k, v in (labels or {}).items()])
        rec = self.get(machine_id)
        assert rec is not None
        return rec

    @_writes
    def compare_and_set(
        self, machine_id: str, expected: Collection[MachineState], new: MachineState,
        error: str | None = None, *, quota: tuple[str, int] | None = None,
    ) -> bool:
        """Move a machine to ``new`` if it is in one of ``expected``; False if it was not.

        The one writer of the ``state`` column (``UPDATE … WHERE state IN …``): two
        operations racing for one machine cannot both win. With ``quota`` (account,
        default limit) the move also takes a quota slot, in the same transaction (a
        hibernated machine waking up).

        Raises:
            QuotaExceeded: ``quota`` was given and the account has no free slot.
        """
        names = [s.value for s in expected]
        sql = (f"UPDATE machines SET state=?, error=? WHERE id=? AND state IN "
               f"({','.join('?' * len(names))})")
        if quota is None:
            moved = self._db.execute(sql, (new.value, error, machine_id, *names)) == 1
            if moved and new in _FREE:
                self.on_free()
            return moved
        with self._db.transaction() as conn:
            _check_quota(conn, quota[0], quota[1])
            changed: int = conn.execute(sql, (new.value, error, machine_id, *names)).rowcount
        return changed == 1

    def touch(self, machine_id: str, when: float) -> None:
        """Record activity (a request that needed the machine) at ``when``."""
        self._db.execute("UPDATE machines SET last_active=? WHERE id=?", (when, machine_id))

    @_writes
    def update(self, machine_id: str, **fields: object) -> None:
        """Write a machine's runtime columns (never its state: see `compare_and_set`)."""
        bad = set(fields) - _RUNTIME_COLUMNS
        if bad:
            raise ValueError(f"not runtime columns: {sorted(bad)}")
        cols = ", ".join(f"{k}=?" for k in fields)
        values = [int(v) if isinstance(v, bool) else v for v in fields.values()]
        self._db.execute(f"UPDATE machines SET {cols} WHERE id=?", (*values, machine_id))

    def set_end(self, machine_id: str, end_at: float | None, on_timeout: str | None) -> bool:
        """Give a machine a new end (None: no lifetime); False if it is gone or being
        deleted. The control plane's columns: `update` does not write them."""
        return self._db.execute(
            "UPDATE machines SET end_at=?, on_timeout=? WHERE id=? AND state!='deleting'",
            (end_at, on_timeout if end_at is not None else None, machine_id)) == 1

    def clear_end(self, machine_id: str, end_at: float) -> bool:
        """Drop a machine's lifetime if its end is still ``end_at`` (a ``set_timeout``
        meanwhile wins); False if it changed or the machine is gone."""
        return self._db.execute(
            "UPDATE machines SET end_at=NULL, on_timeout=NULL WHERE id=? AND end_at=?",
            (machine_id, end_at)) == 1

    def due(self, now: float, limit: int) -> builtins.list[MachineRecord]:
        """Up to ``limit`` machines whose end is at or before ``now``, earliest first
        (deleting ones excluded): one indexed query (``machines_by_end``)."""
        rows = self._db.all(
            "SELECT * FROM machines WHERE end_at IS NOT NULL AND end_at<=?"
            " AND state!='deleting' ORDER BY end_at LIMIT ?", (now, limit))
        return [MachineRecord.of(r) for r in rows]

    def next_end(self) -> float | None:
        """The earliest end of any machine not being deleted (None: no lifetime)."""
        row = self._db.one("SELECT end_at FROM machines WHERE end_at IS NOT NULL"
                           " AND state!='deleting' ORDER BY end_at LIMIT 1")
        return None if row is None else float(row[0])

    def bump_generation(self, machine_id: str) -> None:
        self._db.execute("UPDATE machines SET generation=generation+1 WHERE id=?", (machine_id,))

    @_writes
    def delete(self, machine_id: str) -> None:
        if self._db.execute("DELETE FROM machines WHERE id=?", (machine_id,)):
            self.on_free()

    def on_node(self, node_id: str) -> builtins.list[MachineRecord]:
        """Every machine placed on ``node_id`` (deleting ones included)."""
        rows = self._db.all("SELECT * FROM machines WHERE node_id=? ORDER BY created_at",
                            (node_id,))
        return [MachineRecord.of(r) for r in rows]

    def count_by_node(self) -> dict[str, int]:
        rows = self._db.all("SELECT node_id, COUNT(*) AS n FROM machines GROUP BY node_id")
        return {r["node_id"]: r["n"] for r in rows}

    @_writes
    def adopt(self, rec: MachineRecord, quota: int) -> None:
        """Insert a record the control plane made (a cluster node's own database; its
        account row carries the account's quota, which the node applies to wakes).

        Called by `Lifecycle.adopt` only: the record's state is the one the control
        plane's claim gave it, the node's moves start from there.
        """
        with self._db.transaction() as conn:
            conn.execute(
                "INSERT INTO accounts (id, name, machine_quota, created_at) VALUES (?,?,?,?)"
                " ON CONFLICT(id) DO UPDATE SET machine_quota=excluded.machine_quota",
                (rec.account_id, rec.account_id, quota, time.time()),
            )
            conn.execute(
                "INSERT OR REPLACE INTO machines (id, account_id, name, state, vcpus, memory_mib,"
                " disk_gib, isolated, image, parent_id, snapshot, created_at, node_id, engine,"
                " vm_id, last_active, suspend_after, hibernate_after, port, url_token,"
                " url_public, labels, run_image, net_policy)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (rec.id, rec.account_id, rec.name, rec.state.value, rec.vcpus, rec.memory_mib,
                 rec.disk_gib, int(rec.isolated), rec.image, rec.parent_id, rec.snapshot,
                 rec.created_at, rec.node_id, rec.engine, rec.vm_id, rec.last_active,
                 rec.suspend_after, rec.hibernate_after, rec.port, rec.url_token,
                 int(rec.url_public), json.dumps(rec.labels),
                 json.dumps(rec.run_image.to_json()) if rec.run_image is not None else None,
                 _json_or_null(rec.net.to_json())),
            )

    @_writes
    def mirror(self, rec: MachineRecord, *, keep: Collection[MachineState]) -> bool:
        """Copy a cluster node's view of a machine (state and runtime columns; its disk
        layers and templates are the node's alone) into the control plane's record,
        unless that record is in one of ``keep``; False if it is gone or kept.

        Called by `Lifecycle.mirror` only (it names the states the copy keeps).
        """
        names = [s.value for s in keep]
        copied = self._db.execute(
            "UPDATE machines SET state=?, error=?, port=?, fwd_port=?, pid=?, vm_id=?, accel=?,"
            " last_active=?, ram_shared=?, generation=?"
            f" WHERE id=? AND state NOT IN ({','.join('?' * len(names))})",
            (rec.state.value, rec.error, rec.port, rec.fwd_port, rec.pid, rec.vm_id, rec.accel,
             rec.last_active, int(rec.ram_shared), rec.generation, rec.id, *names),
        ) == 1
        if copied and rec.state in _FREE:
            self.on_free()
        return copied

    @_writes
    def compare_and_set_node(
        self, node_id: str, expected: Collection[MachineState], new: MachineState, error: str
    ) -> builtins.list[str]:
        """Move every machine of ``node_id`` that is in one of ``expected`` to ``new`` (with
        ``error``), in one transaction; returns their ids.

        Called by `Lifecycle.mark_lost` only (a cluster node died).
        """
        names = [s.value for s in expected]
        where = f"node_id=? AND state IN ({','.join('?' * len(names))})"
        with self._db.transaction() as conn:
            ids = [r[0] for r in conn.execute(
                f"SELECT id FROM machines WHERE {where}", (node_id, *names)).fetchall()]
            conn.execute(f"UPDATE machines SET state=?, error=? WHERE {where}",
                         (new.value, error, node_id, *names))
        return ids

    def snapshot_digests(self) -> set[str]:
        rows = self._db.all("SELECT DISTINCT snapshot FROM machines WHERE snapshot IS NOT NULL")
        return {r["snapshot"] for r in rows}


def _check_quota(conn: sqlite3.Connection, account: str, default_quota: int) -> None:
    """Raise QuotaExceeded unless the account has a free concurrent-machine slot."""
    quota_row = conn.execute(
        "SELECT machine_quota FROM accounts WHERE id=?", (account,)
    ).fetchone()
    quota = quota_row[0] if quota_row else default_quota
    used = conn.execute(
        f"SELECT COUNT(*) FROM machines WHERE account_id=? AND state NOT IN {_FREE_STATES}",
        (account,),
    ).fetchone()[0]
    if used + 1 > quota:
        raise QuotaExceeded(
            f"machine quota reached: {used} of {quota} concurrent machines in use "
            "(hibernated machines do not count)",
            limit=quota, used=used,
            hint="delete or hibernate machines you no longer need; the operator raises the "
            "limit with `boxd accounts update ACCOUNT --max-machines N`",
        )


class Layers:
    """Disk layers, templates and the garbage collection of both."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @_writes
    def new(self, parent_id: str | None, base: str, layer_id: str | None = None) -> str:
        layer_id = layer_id or new_id("l")
        self._db.execute(
            "INSERT INTO layers (id, parent_id, base, frozen, created_at) VALUES (?,?,?,0,?)",
            (layer_id, parent_id, base, time.time()),
        )
        return layer_id

    @_writes
    def drop(self, layer_id: str) -> None:
        """Forget a layer no one refers to yet (a launch that failed)."""
        self._db.execute("DELETE FROM layers WHERE id=?", (layer_id,))

    def get(self, layer_id: str) -> LayerRecord | None:
        row = self._db.one("SELECT * FROM layers WHERE id=?", (layer_id,))
        return LayerRecord.of(row) if row else None

    def ids(self) -> set[str]:
        return {r["id"] for r in self._db.all("SELECT id FROM layers")}

    def chain(self, layer_id: str | None) -> builtins.list[LayerRecord]:
        """The layers from ``layer_id`` down to the one on the base image."""
        out: builtins.list[LayerRecord] = []
        while layer_id is not None and len(out) < 10_000:
            layer = self.get(layer_id)
            if layer is None:
                break
            out.append(layer)
            layer_id = layer.parent_id
        return out

    @_writes
    def freeze(self, machine_id: str, frozen_id: str, new_active: str) -> None:
        """``frozen_id`` becomes read-only; the machine now writes ``new_active``."""
        with self._db.transaction() as conn:
            conn.execute("UPDATE layers SET frozen=1 WHERE id=?", (frozen_id,))
            conn.execute("UPDATE machines SET layer_id=? WHERE id=?", (new_active, machine_id))

    @_writes
    def received(self, layer_id: str, parent_id: str | None, base: str) -> None:
        """Record a frozen layer another node sent (a cross-node fork's template)."""
        self._db.execute(
            "INSERT OR IGNORE INTO layers (id, parent_id, base, frozen, created_at)"
            " VALUES (?,?,?,1,?)", (layer_id, parent_id, base, time.time()),
        )

    @_writes
    def rebase(self, layer_id: str, base: str) -> None:
        """After a collapse: ``layer_id`` sits directly on the base image."""
        self._db.execute("UPDATE layers SET parent_id=NULL, base=? WHERE id=?", (base, layer_id))

    # -------------------------------------------------------------- templates

    @_writes
    def add_template(
        self, source_id: str, layer_id: str, mem_path: Path, state_path: Path, generation: int,
        template_id: str | None = None,
    ) -> TemplateRecord:
        template_id = template_id or new_id("t")
        self._db.execute(
            "INSERT INTO templates (id, source_id, layer_id, mem_path, state_path, generation,"
            " created_at) VALUES (?,?,?,?,?,?,?)",
            (template_id, source_id, layer_id, str(mem_path), str(state_path), generation,
             time.time()),
        )
        tpl = self.template(template_id)
        assert tpl is not None
        return tpl

    def template(self, template_id: str) -> TemplateRecord | None:
        row = self._db.one("SELECT * FROM templates WHERE id=?", (template_id,))
        return TemplateRecord.of(row) if row else None

    def template_for(self, source_id: str, generation: int) -> TemplateRecord | None:
        """The newest template of ``source_id`` taken at ``generation``."""
        row = self._db.one(
            "SELECT * FROM templates WHERE source_id=? AND generation=? "
            "ORDER BY created_at DESC LIMIT 1", (source_id, generation),
        )
        return TemplateRecord.of(row) if row else None

    def template_dirs(self) -> set[str]:
        return {Path(r["mem_path"]).parent.name for r in self._db.all(
            "SELECT mem_path FROM templates")}

    _CURRENT = (
        " EXISTS (SELECT 1 FROM machines s WHERE s.id=t.source_id"
        "   AND s.generation=t.generation AND s.state NOT IN ('failed','deleting')"
        "   AND t.created_at=(SELECT MAX(created_at) FROM templates WHERE source_id=s.id))"
    )

    def template_is_current(self, template_id: str) -> bool:
        """True while the next fork of the template's source would use it."""
        row = self._db.one(f"SELECT 1 FROM templates t WHERE t.id=? AND {self._CURRENT}",
                           (template_id,))
        return row is not None

    @_writes
    def bases(self) -> set[str]:
        """What the bottom layers sit on (each layer chain's base)."""
        return {r["base"] for r in self._db.all("SELECT DISTINCT base FROM layers")}

    def collect(
        self, keep: Collection[str] = (), keep_templates: Collection[str] = ()
    ) -> Garbage:
        """Drop templates and layers nothing refers to; return what the files were.

        A template lives while a child maps it, or while it is its living source's
        current one (the next fork reuses it). A layer lives while a machine writes
        it, a template or checkpoint froze it, a living layer is backed by it, or it is
        in ``keep`` (layers of operations in flight that nothing refers to yet).
        Templates in ``keep_templates`` live too (templates received from another node).
        """
        with self._db.transaction() as conn:
            dead_templates = conn.execute(
                "SELECT t.id, t.mem_path FROM templates t WHERE"
                " NOT EXISTS (SELECT 1 FROM machines m WHERE m.template_id=t.id)"
                f" AND NOT {self._CURRENT}"
            ).fetchall()
            dead_templates = [t for t in dead_templates if t["id"] not in keep_templates]
            for t in dead_templates:
                conn.execute("DELETE FROM templates WHERE id=?", (t["id"],))
            live: set[str] = set()
            roots = conn.execute(
                "SELECT layer_id FROM machines WHERE layer_id IS NOT NULL"
                " UNION SELECT layer_id FROM templates UNION SELECT layer_id FROM checkpoints"
            ).fetchall()
            parents: dict[str, str | None] = dict(
                conn.execute("SELECT id, parent_id FROM layers").fetchall()
            )
            for lid in [r[0] for r in roots] + [k for k in keep if k in parents]:
                while lid is not None and lid not in live:
                    live.add(lid)
                    lid = parents.get(lid)
            dead_layers = [lid for lid in parents if lid not in live]
            # children before parents so the foreign key holds at every step
            for lid in sorted(dead_layers, key=lambda x: -_depth(x, parents)):
                conn.execute("DELETE FROM layers WHERE id=?", (lid,))
        return Garbage(
            tuple(Path(t["mem_path"]).parent for t in dead_templates), tuple(dead_layers)
        )


def _depth(lid: str, parents: dict[str, str | None]) -> int:
    d = 0
    cur: str | None = lid
    while cur is not None and d < 10_000:
        cur = parents.get(cur)
        d += 1
    return d


class Checkpoints:
    """The ``checkpoints`` table: checkpoints belong to their machine."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def get(self, machine_id: str, name: str) -> CheckpointRecord | None:
        row = self._db.one(
            "SELECT * FROM checkpoints WHERE machine_id=? AND name=?", (machine_id, name)
        )
        return CheckpointRecord.of(row) if row else None

    def list(self, machine_id: str) -> builtins.list[CheckpointRecord]:
        rows = self._db.all(
            "SELECT * FROM checkpoints WHERE machine_id=? ORDER BY created_at", (machine_id,)
        )
        return [CheckpointRecord.of(r) for r in rows]

    @_writes
    def add(
        self, checkpoint_id: str, machine_id: str, name: str, layer_id: str,
        mem_path: Path | None, state_path: Path,
    ) -> CheckpointRecord:
        self._db.execute(
            "INSERT INTO checkpoints (id, machine_id, name, layer_id, mem_path, state_path,"
            " created_at) VALUES (?,?,?,?,?,?,?)",
            (checkpoint_id, machine_id, name, layer_id, str(mem_path) if mem_path else "",
             str(state_path), time.time()),
        )
        ck = self.get(machine_id, name)
        assert ck is not None
        return ck

    @_writes
    def delete(self, checkpoint_id: str) -> None:
        self._db.execute("DELETE FROM checkpoints WHERE id=?", (checkpoint_id,))

    @_writes
    def delete_for(self, machine_id: str) -> builtins.list[str]:
        """Drop every checkpoint of a machine; return their ids (for their files)."""
        ids = [c.id for c in self.list(machine_id)]
        self._db.execute("DELETE FROM checkpoints WHERE machine_id=?", (machine_id,))
        return ids

    def ids(self) -> set[str]:
        return {r["id"] for r in self._db.all("SELECT id FROM checkpoints")}


class Snapshots:
    """The ``snapshots`` table: names and versions per account, bytes by digest."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def by_digest(self, account: str, digest: str) -> SnapshotRecord | None:
        row = self._db.one(
            "SELECT * FROM snapshots WHERE account_id=? AND digest=? "
            "ORDER BY version DESC LIMIT 1", (account, digest),
        )
        return SnapshotRecord.of(row) if row else None

    def by_version(self, account: str, name: str, version: int) -> SnapshotRecord | None:
        row = self._db.one(
            "SELECT * FROM snapshots WHERE account_id=? AND name=? AND version=?",
            (account, name, version),
        )
        return SnapshotRecord.of(row) if row else None

    def latest(self, account: str, ref: str) -> SnapshotRecord | None:
        """The newest version of the snapshot named (or with id) ``ref``."""
        row = self._db.one(
            "SELECT * FROM snapshots WHERE account_id=? AND (name=? OR id=?) "
            "ORDER BY version DESC LIMIT 1", (account, ref, ref),
        )
        return SnapshotRecord.of(row) if row else None

    def named(self, account: str, name: str, digest: str) -> SnapshotRecord | None:
        row = self._db.one(
            "SELECT * FROM snapshots WHERE account_id=? AND digest=? AND name=?",
            (account, digest, name),
        )
        return SnapshotRecord.of(row) if row else None

    def list(self, account: str) -> builtins.list[SnapshotRecord]:
        rows = self._db.all(
            "SELECT * FROM snapshots WHERE account_id=? ORDER BY name, version", (account,)
        )
        return [SnapshotRecord.of(r) for r in rows]

    def latest_version(self, account: str, name: str) -> int:
        row = self._db.one(
            "SELECT MAX(version) AS v FROM snapshots WHERE account_id=? AND name=?",
            (account, name),
        )
        return int(row["v"]) if row and row["v"] is not None else 0

    @staticmethod
    def _taken(name: str, latest: int) -> AlreadyExists:
        return AlreadyExists(
            f"snapshot {name!r} exists (version {latest}); a name keeps meaning the same bytes",
            kind="snapshot", name=name,
            hint=f"save with --new-version to add version {latest + 1}, or pick another name",
        )

    def check_name(self, account: str, name: str, *, new_version: bool) -> None:
        """Raises: AlreadyExists: ``name`` exists and ``new_version`` is false."""
        latest = self.latest_version(account, name)
        if latest and not new_version:
            raise self._taken(name, latest)

    @_writes
    def add(self, account: str, name: str, digest: str, *, new_version: bool) -> SnapshotRecord:
        """Record the next version of ``name`` (atomically).

        Raises:
            AlreadyExists: ``name`` exists and ``new_version`` is false.
        """
        snap_id = new_id("s")
        with self._db.transaction() as conn:
            latest = conn.execute(
                "SELECT MAX(version) FROM snapshots WHERE account_id=? AND name=?",
                (account, name),
            ).fetchone()[0]
            if latest and not new_version:
                raise self._taken(name, latest)
            conn.execute(
                "INSERT INTO snapshots (id, account_id, name, version, digest, created_at)"
                " VALUES (?,?,?,?,?,?)",
                (snap_id, account, name, (latest or 0) + 1, digest, time.time()),
            )
        row = self._db.one("SELECT * FROM snapshots WHERE id=?", (snap_id,))
        assert row is not None
        return SnapshotRecord.of(row)

    @_writes
    def delete(self, snapshot_id: str) -> None:
        self._db.execute("DELETE FROM snapshots WHERE id=?", (snapshot_id,))

    def digest_used(self, digest: str) -> bool:
        return self._db.one("SELECT 1 FROM snapshots WHERE digest=?", (digest,)) is not None


class Accounts:
    """The ``accounts`` table: names, quotas, and the machines that count against them."""

    def __init__(self, db: Database) -> None:
        self._db = db

    _SELECT = (
        "SELECT a.id, a.name, a.machine_quota, a.created_at,"
        f" (SELECT COUNT(*) FROM machines m WHERE m.account_id=a.id"
        f"  AND m.state NOT IN {_FREE_STATES}) AS used FROM accounts a"
    )

    def list(self) -> builtins.list[AccountRecord]:
        return [AccountRecord.of(r) for r in self._db.all(self._SELECT + " ORDER BY a.name")]

    def get(self, name_or_id: str) -> AccountRecord | None:
        row = self._db.one(self._SELECT + " WHERE a.name=? OR a.id=?", (name_or_id, name_or_id))
        return AccountRecord.of(row) if row else None

    def set_quota(self, account_id: str, max_machines: int) -> None:
        self._db.execute("UPDATE accounts SET machine_quota=? WHERE id=?",
                         (max_machines, account_id))


class Keys:
    """The ``api_keys`` table, and accounts by name (keys create accounts on demand)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def account_id(self, name: str) -> str | None:
        row = self._db.one("SELECT id FROM accounts WHERE name = ?", (name,))
        return str(row["id"]) if row else None

    def account_name(self, account_id: str) -> str | None:
        row = self._db.one("SELECT name FROM accounts WHERE id = ?", (account_id,))
        return str(row["name"]) if row else None

    @_writes
    def add_account(self, name: str, max_machines: int) -> str:
        """Create the account ``name`` unless it exists; return its id either way."""
        self._db.execute(
            "INSERT INTO accounts (id, name, created_at, machine_quota) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(name) DO NOTHING",
            (new_id("a"), name, time.time(), max_machines),
        )
        found = self.account_id(name)
        assert found is not None  # inserted just above, or by a concurrent caller
        return found

    @_writes
    def add(
        self, key_id: str, account_id: str, name: str, prefix: str, secret_hash: str,
        created_at: float, owner_uid: int | None,
    ) -> None:
        self._db.execute(
            "INSERT INTO api_keys (id, account_id, name, prefix, secret_hash, created_at, "
            "owner_uid) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key_id, account_id, name, prefix, secret_hash, created_at, owner_uid),
        )

    def list(self, account_id: str) -> builtins.list[KeyRecord]:
        rows = self._db.all(
            "SELECT * FROM api_keys WHERE account_id = ? ORDER BY created_at, id", (account_id,)
        )
        return [KeyRecord.of(r) for r in rows]

    def get(self, account_id: str, key_id: str) -> KeyRecord | None:
        row = self._db.one(
            "SELECT * FROM api_keys WHERE id = ? AND account_id = ?", (key_id, account_id)
        )
        return KeyRecord.of(row) if row else None

    def by_secret_hash(self, secret_hash: str) -> KeyRecord | None:
        row = self._db.one("SELECT * FROM api_keys WHERE secret_hash = ?", (secret_hash,))
        return KeyRecord.of(row) if row else None

    def revoke(self, key_id: str) -> None:
        self._db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
            (time.time(), key_id),
        )

    def revoke_owned(self, account_id: str, uid: int) -> None:
        """Revoke the default keys an OS user owns in an account."""
        self._db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE account_id = ? AND owner_uid = ? "
            "AND revoked_at IS NULL",
            (time.time(), account_id, uid),
        )


class IdempotencyKeys:
    """The ``idempotency_keys`` table: one row per (account, key) a keyed create or fork
    claimed, until it expires."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def claim(
        self, account: str, key: str, fingerprint: str, *, now: float, ttl: float
    ) -> IdempotencyRecord | None:
        """Take ``key`` for a new request (None), or return the live row that holds it
        (an expired one is replaced), in one transaction: of two concurrent claims one
        takes the key and the other sees its row."""
        with self._db.transaction() as conn:
            conn.execute("DELETE FROM idempotency_keys WHERE account_id=? AND key=? "
                         "AND expires_at<=?", (account, key, now))
            row = conn.execute("SELECT * FROM idempotency_keys WHERE account_id=? AND key=?",
                               (account, key)).fetchone()
            if row is not None:
                return IdempotencyRecord.of(row)
            conn.execute(
                "INSERT INTO idempotency_keys (account_id, key, fingerprint, response, "
                "created_at, expires_at) VALUES (?,?,?,NULL,?,?)",
                (account, key, fingerprint, now, now + ttl))
            return None

    def get(self, account: str, key: str) -> IdempotencyRecord | None:
        row = self._db.one("SELECT * FROM idempotency_keys WHERE account_id=? AND key=?",
                           (account, key))
        return IdempotencyRecord.of(row) if row else None

    def finish(self, account: str, key: str, response: str) -> None:
        """The request is done: keep what it returned for its retries."""
        self._db.execute("UPDATE idempotency_keys SET response=? WHERE account_id=? AND key=?",
                         (response, account, key))

    def release(self, account: str, key: str) -> None:
        """Forget the key (its request failed): a retry runs anew."""
        self._db.execute("DELETE FROM idempotency_keys WHERE account_id=? AND key=?",
                         (account, key))

    def release_running(self) -> int:
        """Forget every key whose request is not done (the daemon that ran them is gone)."""
        return self._db.execute("DELETE FROM idempotency_keys WHERE response IS NULL")

    def prune(self, now: float) -> int:
        """Delete the expired keys; how many."""
        return self._db.execute("DELETE FROM idempotency_keys WHERE expires_at<=?", (now,))

    def count(self, account: str) -> int:
        row = self._db.one("SELECT COUNT(*) FROM idempotency_keys WHERE account_id=?",
                           (account,))
        return int(row[0]) if row else 0

    def trim(self, account: str, keep: int, created_before: float) -> int:
        """Delete the account's oldest done keys created before ``created_before`` until at
        most ``keep`` remain; how many went."""
        excess = self.count(account) - keep
        if excess <= 0:
            return 0
        return self._db.execute(
            "DELETE FROM idempotency_keys WHERE account_id=? AND key IN (SELECT key FROM "
            "idempotency_keys WHERE account_id=? AND response IS NOT NULL AND created_at<? "
            "ORDER BY created_at LIMIT ?)", (account, account, created_before, excess))


class Repos:
    """All repositories over one database."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.machines = Machines(db)
        self.layers = Layers(db)
        self.checkpoints = Checkpoints(db)
        self.snapshots = Snapshots(db)
        self.accounts = Accounts(db)
        self.keys = Keys(db)
        self.idempotency = IdempotencyKeys(db)


__all__ = ["Accounts", "Checkpoints", "IdempotencyKeys", "Keys", "Layers", "Machines", "Repos",
           "Snapshots"]
