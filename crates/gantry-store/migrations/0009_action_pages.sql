-- An invocation's page lists its actions dearest first and draws its longest runs, a
-- page at a time: these indexes give both orders ready-sorted, so a page of an
-- invocation with 100,000 actions reads its rows without sorting them all (the last page
-- steps over the index, not over a sort of every row). The dearest order is
-- ActionRecord::esu_seconds: the expression must stay the one sql_execution_log.rs's
-- esu_sql() writes, which a test checks.
CREATE INDEX action_executions_dearest ON action_executions (tool_invocation_id,
    (wall_seconds * (CASE WHEN (peak_memory_bytes / 2500000000.0) > (CASE WHEN size_class < 1 THEN 1 ELSE size_class END) THEN (peak_memory_bytes / 2500000000.0) ELSE (CASE WHEN size_class < 1 THEN 1 ELSE size_class END) END)) DESC,
    completed_unix_ms, operation);
CREATE INDEX action_executions_longest ON action_executions (tool_invocation_id, wall_seconds DESC, completed_unix_ms, operation);
