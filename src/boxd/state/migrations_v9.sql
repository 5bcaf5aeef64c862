-- boxd state schema, version 9: a machine started from an imported container image
-- (`boxd machine new --image REF`) records it: a JSON object with the image's name (as
-- the account gave it), its manifest digest and the config that sets exec's defaults
-- (env, working_dir, user). NULL: the default guest image. Forks copy it.
ALTER TABLE machines ADD COLUMN run_image TEXT;
