-- boxd state schema, version 8: lifetimes. A machine's end (``end_at``, UTC epoch
-- seconds; NULL: it has none) and what the end does (``on_timeout``: 'delete' or
-- 'hibernate'). They are the control plane's columns: a cluster node's mirror never
-- writes them. The reaper (`boxd.control.lifetimes`) asks for the earliest ends
-- through the partial index, so its query costs the same at any number of machines.
ALTER TABLE machines ADD COLUMN end_at REAL;
ALTER TABLE machines ADD COLUMN on_timeout TEXT;
CREATE INDEX machines_by_end ON machines (end_at) WHERE end_at IS NOT NULL;
