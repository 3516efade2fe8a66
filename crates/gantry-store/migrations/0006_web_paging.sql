-- The web pages list builds and queue changes newest first, one page at a time; these
-- indexes let a page read its rows from the newest end instead of sorting the table.
CREATE INDEX batch_builds_created ON batch_builds (created_unix_ms, build_id);
CREATE INDEX queue_changes_seq ON queue_changes (seq);
CREATE INDEX queue_changes_state ON queue_changes (state, seq);
CREATE INDEX queue_builds_seq ON queue_builds (seq);
