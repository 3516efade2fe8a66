-- A lease names a role that only one gantry process may play at a time against this
-- database (the submit queue, which owns a mainline). The holder renews it; another
-- process may take it only after it expires.
CREATE TABLE leases (
    name TEXT NOT NULL PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_unix_ms BIGINT NOT NULL
);
