-- Invocations received by the Build Event Service. The list page reads only the header
-- columns; an invocation's targets, tests, patterns, options and metadata are one JSON
-- document, written with the header in one statement, so an invocation is stored whole
-- or not at all.
CREATE TABLE invocations (
    invocation_id TEXT NOT NULL PRIMARY KEY,
    build_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    user_name TEXT NOT NULL,
    command TEXT NOT NULL,
    started_unix_ms BIGINT NOT NULL,
    finished_unix_ms BIGINT NOT NULL,
    exit_code BIGINT NOT NULL,
    exit_name TEXT NOT NULL,
    target_count BIGINT NOT NULL,
    failed_targets BIGINT NOT NULL,
    patterns TEXT NOT NULL,
    document TEXT NOT NULL
);
CREATE INDEX invocations_started ON invocations (started_unix_ms);
