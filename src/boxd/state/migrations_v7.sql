-- boxd state schema, version 7: idempotency keys. A create or fork sent with an
-- ``Idempotency-Key`` claims (account, key) here before it starts: ``fingerprint`` is a
-- hash of what the request asked (route, source, body), ``response`` the JSON of what it
-- returned once it is done (NULL while it runs). A failed request deletes its row (the
-- key is released for a retry); a daemon that restarts deletes the rows of requests it
-- was running (their clients saw the connection drop). Rows expire at ``expires_at``
-- and are pruned by the next keyed request (control/idempotency.py bounds their number).
CREATE TABLE idempotency_keys (
    account_id   TEXT NOT NULL,
    key          TEXT NOT NULL,
    fingerprint  TEXT NOT NULL,
    response     TEXT,
    created_at   REAL NOT NULL,
    expires_at   REAL NOT NULL,
    PRIMARY KEY (account_id, key)
) WITHOUT ROWID;
CREATE INDEX idempotency_keys_by_expiry ON idempotency_keys (expires_at);
CREATE INDEX idempotency_keys_by_age ON idempotency_keys (account_id, created_at);
