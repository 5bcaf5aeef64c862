-- boxd state schema, version 4: a machine's URL port is held by the daemon (``port``)
-- and relayed to the forward of its current VM process (``fwd_port``). Machines from
-- before had QEMU hold ``port`` itself: they keep it until their VM is next replaced.
ALTER TABLE machines ADD COLUMN fwd_port INTEGER;
UPDATE machines SET fwd_port = port;
