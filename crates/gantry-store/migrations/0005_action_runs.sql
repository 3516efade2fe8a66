-- The web UI's action page lists every run of one action (retries, hedge copies, the
-- runs of earlier builds), newest first, and links the action to its shape's size-class
-- statistics (the key the scheduler learned it under; empty when it did not learn).
CREATE INDEX action_executions_action ON action_executions (action_digest, completed_unix_ms);
ALTER TABLE action_executions ADD COLUMN shape_key TEXT NOT NULL DEFAULT '';
CREATE INDEX action_executions_shape ON action_executions (shape_key, completed_unix_ms);
-- Who may see an invocation depends on the instance its build used.
ALTER TABLE invocations ADD COLUMN instance_name TEXT NOT NULL DEFAULT '';
