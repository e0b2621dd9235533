-- OpenTelemetry export (#25): the span id of an order's submission span, the
-- root its transitions' spans nest under. NULL when nothing was exported.
ALTER TABLE orders ADD COLUMN trace_span text;
