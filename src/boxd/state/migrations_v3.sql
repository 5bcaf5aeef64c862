-- boxd state schema, version 3: idle timers. ``last_active`` is the last request that
-- needed the machine (status reads do not count); NULL timers mean the daemon default.
ALTER TABLE machines ADD COLUMN last_active REAL;
ALTER TABLE machines ADD COLUMN suspend_after REAL;
ALTER TABLE machines ADD COLUMN hibernate_after REAL;
UPDATE machines SET last_active = created_at WHERE last_active IS NULL;
