-- The submit queue's planner saved as of one journal entry: with it, the journal entries
-- before it are no longer needed to resume, and retention deletes them.
CREATE TABLE queue_snapshots (seq BIGINT NOT NULL PRIMARY KEY, at_ms BIGINT NOT NULL, state TEXT NOT NULL);
