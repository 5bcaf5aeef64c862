-- boxd state schema, version 2: records say which node runs a machine and on which
-- engine, and the engine's own id of the VM process (a standby fork child is prepared
-- under its own id and later claimed by a machine record).
ALTER TABLE machines ADD COLUMN node_id TEXT NOT NULL DEFAULT 'local';
ALTER TABLE machines ADD COLUMN engine TEXT NOT NULL DEFAULT 'qemu';
ALTER TABLE machines ADD COLUMN vm_id TEXT;
UPDATE machines SET vm_id = id WHERE vm_id IS NULL;
