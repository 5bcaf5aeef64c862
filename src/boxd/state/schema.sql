-- boxd state schema, version 1. Plain SQL so a server database can replace SQLite.
CREATE TABLE accounts (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    machine_quota INTEGER NOT NULL DEFAULT 50,
    created_at  REAL NOT NULL
);

CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,            -- k_..., shown to users; not secret
    account_id  TEXT NOT NULL REFERENCES accounts(id) ON DELETE CASCADE,
    name        TEXT NOT NULL,
    prefix      TEXT NOT NULL,               -- first characters of the secret, for display
    secret_hash TEXT NOT NULL UNIQUE,        -- sha256 of the secret
    created_at  REAL NOT NULL,
    revoked_at  REAL,
    owner_uid   INTEGER                      -- set on the default local key of an OS user
);

-- A disk layer: a qcow2 file in disks/. A machine writes to its active layer; a fork or
-- checkpoint freezes it. A frozen layer lives while a machine, layer, template or
-- checkpoint refers to it.
CREATE TABLE layers (
    id          TEXT PRIMARY KEY,
    parent_id   TEXT REFERENCES layers(id),   -- backing layer, NULL when backed by base image
    base        TEXT NOT NULL,                -- base image file (image rootfs or snapshot disk)
    frozen      INTEGER NOT NULL DEFAULT 0,
    created_at  REAL NOT NULL
);

-- Frozen memory + device state that fork children map copy-on-write.
CREATE TABLE templates (
    id          TEXT PRIMARY KEY,
    source_id   TEXT,                         -- machine it was taken from (may be gone)
    layer_id    TEXT NOT NULL REFERENCES layers(id),
    mem_path    TEXT NOT NULL,
    state_path  TEXT NOT NULL,
    generation  INTEGER NOT NULL,             -- source's generation when taken
    created_at  REAL NOT NULL
);

CREATE TABLE machines (
    id          TEXT PRIMARY KEY,             -- m_...
    account_id  TEXT NOT NULL REFERENCES accounts(id),
    name        TEXT NOT NULL,
    state       TEXT NOT NULL,
    vcpus       INTEGER NOT NULL,
    memory_mib  INTEGER NOT NULL,
    disk_gib    INTEGER NOT NULL,
    isolated    INTEGER NOT NULL DEFAULT 0,
    port        INTEGER,                      -- host port forwarded to the guest's HTTP port
    image       TEXT NOT NULL,                -- image recipe hash
    layer_id    TEXT REFERENCES layers(id),   -- active (writable) disk layer
    template_id TEXT REFERENCES templates(id),-- RAM mapped copy-on-write from this template
    ram_shared  INTEGER NOT NULL DEFAULT 1,   -- 1: owns its RAM file; 0: maps an image privately
    pid         INTEGER,
    generation  INTEGER NOT NULL DEFAULT 0,   -- bumped by every mutating request
    parent_id   TEXT,                         -- forked from
    snapshot    TEXT,                         -- created from this snapshot digest
    error       TEXT,
    accel       TEXT,
    created_at  REAL NOT NULL,
    UNIQUE (account_id, name)
);

CREATE TABLE checkpoints (
    id          TEXT PRIMARY KEY,             -- c_...
    machine_id  TEXT NOT NULL REFERENCES machines(id) ON DELETE CASCADE,
    name        TEXT NOT NULL,
    layer_id    TEXT NOT NULL REFERENCES layers(id),
    mem_path    TEXT NOT NULL,
    state_path  TEXT NOT NULL,
    created_at  REAL NOT NULL,
    UNIQUE (machine_id, name)
);

CREATE TABLE snapshots (
    id          TEXT PRIMARY KEY,             -- s_...
    account_id  TEXT NOT NULL REFERENCES accounts(id),
    name        TEXT NOT NULL,
    version     INTEGER NOT NULL,
    digest      TEXT NOT NULL,                -- sha256 of the manifest
    created_at  REAL NOT NULL,
    UNIQUE (account_id, name, version)
);
