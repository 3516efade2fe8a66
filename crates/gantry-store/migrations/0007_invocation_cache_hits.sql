-- The invocation list shows each invocation's remote cache hit rate, so the counts are
-- header columns (the list never reads the document). Rows stored before have none: 0.
ALTER TABLE invocations ADD COLUMN cache_lookups BIGINT NOT NULL DEFAULT 0;
ALTER TABLE invocations ADD COLUMN cache_hits BIGINT NOT NULL DEFAULT 0;
