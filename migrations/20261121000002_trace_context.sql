-- W3C trace context: each order keeps its trace id, and each queued message
-- carries the traceparent it is published with.
ALTER TABLE orders ADD COLUMN trace_id text;
ALTER TABLE outbox ADD COLUMN traceparent text;
