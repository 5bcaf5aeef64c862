-- boxd state schema, version 5: a machine's URL carries a per-machine token
-- (``url_token``, new with each machine) that the daemon's proxy requires, unless the
-- machine was made public (``url_public``). Machines from before get a token now.
ALTER TABLE machines ADD COLUMN url_token TEXT;
ALTER TABLE machines ADD COLUMN url_public INTEGER NOT NULL DEFAULT 0;
UPDATE machines SET url_token = lower(hex(randomblob(16)));
