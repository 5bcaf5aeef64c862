-- boxd state schema, version 10: a machine's network policy (issue 42 item 7), a JSON
-- object {"expose_host": [PORT, ...], "egress": [RULE, ...] | null}: the host loopback
-- ports it reaches at host.boxd.internal and its egress allow-list, names resolved to
-- addresses at create time (boxd.net_policy). NULL: the default policy. Forks copy it.
ALTER TABLE machines ADD COLUMN net_policy TEXT;
