-- Takes orders for publishing their outbox messages (state_store::outbox::take):
-- the orders whose outbox lock (a session-level advisory lock per order) it
-- gets, at once or, with `wait`, once their publishers let them go; then
-- their messages. A publisher lets its locks go only once its delete of the
-- published rows has committed (it holds a transaction-level lock on the same
-- keys until then). The messages are read by a statement of their own, whose
-- snapshot (a volatile function's statement takes a fresh one) is taken after
-- the locks: it never sees rows the previous publisher deleted, and it needs
-- no row lock, so a take writes nothing.
CREATE OR REPLACE FUNCTION sas_outbox_take(ids uuid[], wait boolean)
RETURNS TABLE (taken uuid, id bigint, kind text, routing_key text, correlation_id text,
  reply_to text, traceparent text, body bytea)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
  got uuid[];
BEGIN
  IF wait THEN
    -- A publisher holds a lock for a publish and a delete: milliseconds.
    PERFORM set_config('lock_timeout', '30s', true);
    -- In the order given (sorted by the caller): two waiters cannot deadlock.
    SELECT coalesce(array_agg(t.id ORDER BY t.n), '{}') INTO got
    FROM unnest(ids) WITH ORDINALITY AS t(id, n)
    WHERE pg_advisory_lock(hashtextextended('sas.outbox:' || t.id::text, 0))::text IS NOT NULL;
  ELSE
    SELECT coalesce(array_agg(t.id ORDER BY t.n), '{}') INTO got
    FROM unnest(ids) WITH ORDINALITY AS t(id, n)
    WHERE pg_try_advisory_lock(hashtextextended('sas.outbox:' || t.id::text, 0));
  END IF;
  RETURN QUERY
    SELECT t.id, o.id, o.kind, o.routing_key, o.correlation_id, o.reply_to, o.traceparent, o.body
    FROM unnest(got) AS t(id) LEFT JOIN outbox o ON o.order_id = t.id
    ORDER BY o.id NULLS LAST;
END
$$;
