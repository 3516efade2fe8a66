-- The submit queue's graph cache is bounded (`[retention] queue_graphs`): the graphs
-- stored longest ago go first. Graphs cached before this version count as the oldest.
ALTER TABLE queue_graphs ADD COLUMN stored_ms BIGINT NOT NULL DEFAULT 0;
CREATE INDEX queue_graphs_stored ON queue_graphs (stored_ms);
