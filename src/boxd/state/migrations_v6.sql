-- boxd state schema, version 6: labels. A machine's labels (string keys and values,
-- `boxd.models.check_labels` bounds them) are kept twice: as a JSON object in
-- ``machines.labels`` (what a record shows) and one row per label in
-- ``machine_labels`` (what a selector matches, through its index). Both are written
-- in the claim's transaction; the rows go with their machine (ON DELETE CASCADE).
ALTER TABLE machines ADD COLUMN labels TEXT NOT NULL DEFAULT '{}';
CREATE TABLE machine_labels (
    machine_id  TEXT NOT NULL REFERENCES machines(id) ON DELETE CASCADE,
    key         TEXT NOT NULL,
    value       TEXT NOT NULL,
    PRIMARY KEY (machine_id, key)
) WITHOUT ROWID;
CREATE INDEX machine_labels_by_value ON machine_labels (key, value, machine_id);
-- A list walks an account's machines in (created_at, id) order from its cursor.
CREATE INDEX machines_by_account ON machines (account_id, created_at, id);
