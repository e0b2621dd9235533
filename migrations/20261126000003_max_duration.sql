-- Long-running remote operations (contract §4b): how far `202 Accepted`
-- heartbeats may move a step's complete-by from its first dispatch. NULL for
-- steps stored before: an hour.
ALTER TABLE steps ADD COLUMN max_duration_ms bigint;
