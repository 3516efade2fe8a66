-- The tables gantry created before its schema was versioned. `IF NOT EXISTS` adopts a
-- database written by that gantry; `{blob}` is the dialect's bytes type.
CREATE TABLE IF NOT EXISTS action_cache (
    instance_name TEXT NOT NULL,
    digest_function TEXT NOT NULL,
    action_hash TEXT NOT NULL,
    action_size BIGINT NOT NULL,
    result {blob} NOT NULL,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (instance_name, digest_function, action_hash, action_size)
);
CREATE TABLE IF NOT EXISTS action_executions (
    operation TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    action_digest TEXT NOT NULL,
    tool_invocation_id TEXT NOT NULL,
    action_mnemonic TEXT NOT NULL,
    target_id TEXT NOT NULL,
    worker TEXT NOT NULL,
    size_class BIGINT NOT NULL,
    exit_code BIGINT NOT NULL,
    status_code BIGINT NOT NULL,
    peak_memory_bytes BIGINT NOT NULL,
    user_cpu_seconds DOUBLE PRECISION NOT NULL,
    system_cpu_seconds DOUBLE PRECISION NOT NULL,
    wall_seconds DOUBLE PRECISION NOT NULL,
    queued_seconds DOUBLE PRECISION NOT NULL,
    metering TEXT NOT NULL,
    completed_unix_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS action_executions_invocation ON action_executions (tool_invocation_id, completed_unix_ms);
CREATE TABLE IF NOT EXISTS size_class_stats (
    stats_key TEXT NOT NULL PRIMARY KEY,
    stats TEXT NOT NULL,
    updated_unix_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS batch_builds (
    build_id TEXT NOT NULL PRIMARY KEY,
    stream_id TEXT NOT NULL,
    parent_id TEXT,
    state TEXT NOT NULL,
    created_unix_ms BIGINT NOT NULL,
    finished_unix_ms BIGINT,
    document TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batch_builds_stream ON batch_builds (stream_id, created_unix_ms);
CREATE INDEX IF NOT EXISTS batch_builds_finished ON batch_builds (finished_unix_ms);
CREATE TABLE IF NOT EXISTS queue_changes (
    id TEXT NOT NULL PRIMARY KEY, seq BIGINT NOT NULL, state TEXT NOT NULL, document TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS queue_builds (
    id TEXT NOT NULL PRIMARY KEY, seq BIGINT NOT NULL, state TEXT NOT NULL, document TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS queue_events (
    seq BIGINT NOT NULL PRIMARY KEY, at_ms BIGINT NOT NULL, dedup_key TEXT UNIQUE, event TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS queue_landings (
    version BIGINT NOT NULL PRIMARY KEY, change_id TEXT NOT NULL, old_commit TEXT NOT NULL,
    new_commit TEXT NOT NULL, state TEXT NOT NULL, document TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS queue_graphs (commit_id TEXT NOT NULL PRIMARY KEY, graph TEXT NOT NULL);
