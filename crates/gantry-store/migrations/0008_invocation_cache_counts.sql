-- Remote cache lookups and hits per invocation as each gantry process counted them (its
-- running totals, replaced at each flush): a build's lookups may go to several frontends,
-- so an invocation's counts are the sum of its rows here (plus the columns of the
-- invocations table, which older gantry filled from one process's counts).
CREATE TABLE invocation_cache_counts (
    invocation_id TEXT NOT NULL,
    process_id TEXT NOT NULL,
    lookups BIGINT NOT NULL,
    hits BIGINT NOT NULL,
    updated_unix_ms BIGINT NOT NULL,
    PRIMARY KEY (invocation_id, process_id)
);
CREATE INDEX invocation_cache_counts_updated ON invocation_cache_counts (updated_unix_ms);
