-- Step requests handed to a live publisher stay in the outbox until their
-- reply (#58): the reply's write-back deletes the row, so that a hand-over
-- of requests alone costs no delete and holds no lock across the broker's
-- confirm. `handed_to` names the instance that publishes (or published)
-- the row; while that instance beats (`instances`), no relay or sweep
-- sends it again. A row whose step no longer waits for its dispatch is
-- never sent again by anyone.
ALTER TABLE outbox ADD COLUMN handed_to text;

-- Whether a relay may publish this row now: any message but a request
-- handed to an instance still alive (seen within three heartbeats) or a
-- request whose dispatch is no longer out (a step running or undoing
-- under it). The predicate of state_store::outbox::PUBLISHABLE.
CREATE OR REPLACE FUNCTION sas_outbox_publishable(kind text, order_id uuid,
  correlation_id text, handed_to text)
RETURNS boolean LANGUAGE sql STABLE AS $$
  SELECT kind <> 'request' OR (
    (handed_to IS NULL OR NOT EXISTS (SELECT 1 FROM instances i
       WHERE i.instance_id = handed_to AND i.last_seen > now() - interval '3 seconds'))
    AND EXISTS (SELECT 1 FROM steps s WHERE s.order_id = sas_outbox_publishable.order_id
       AND s.dispatch_id::text = correlation_id AND s.state IN ('running', 'compensating')))
$$;

-- As 20261206000001, publishing only what sas_outbox_publishable allows.
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
      AND sas_outbox_publishable(o.kind, o.order_id, o.correlation_id, o.handed_to)
    ORDER BY o.id NULLS LAST;
END
$$;
