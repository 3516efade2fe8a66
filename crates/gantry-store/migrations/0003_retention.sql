-- Retention deletes the oldest rows of the history tables in small batches; these
-- indexes let each batch find its rows without scanning the table. (batch_builds is
-- already indexed on finished_unix_ms.)
CREATE INDEX action_cache_updated ON action_cache (updated_at);
CREATE INDEX action_executions_completed ON action_executions (completed_unix_ms);
