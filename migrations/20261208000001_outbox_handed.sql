-- Messages handed to a live publisher (#58): `handed_to` names the
-- instance that publishes (or published) the row; while it beats
-- (`instances`), no relay or sweep sends it again. A step request stays
-- until its reply's write-back deletes it, so that a hand-over of requests
-- costs no delete and holds no lock across the broker's confirm; the
-- events of an order that ended are deleted by their publisher in a batch,
-- once confirmed. A request whose step
-- no longer waits for its dispatch is never sent again by anyone.
ALTER TABLE outbox ADD COLUMN handed_to text;

-- Whether `instance`, to which outbox rows were handed, still beats (seen
-- within three heartbeats).
CREATE OR REPLACE FUNCTION sas_outbox_alive(instance text)
RETURNS boolean LANGUAGE sql STABLE AS $$
  SELECT instance IS NOT NULL AND EXISTS (SELECT 1 FROM instances i
    WHERE i.instance_id = instance AND i.last_seen > now() - interval '3 seconds')
$$;

-- Whether a relay may publish this row now: not while it is handed to an
-- instance that beats (a status event or alert for up to 30 seconds, its
-- publisher deletes it in a batch once confirmed; a step request until its
-- reply), and never a request whose dispatch is no longer out (no step
-- running or undoing under it). The predicate of
-- state_store::outbox::PUBLISHABLE.
CREATE OR REPLACE FUNCTION sas_outbox_publishable(kind text, order_id uuid,
  correlation_id text, handed_to text, created_at timestamptz)
RETURNS boolean LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN kind = 'request' THEN
      NOT sas_outbox_alive(handed_to)
      AND EXISTS (SELECT 1 FROM steps s WHERE s.order_id = sas_outbox_publishable.order_id
        AND s.dispatch_id::text = correlation_id AND s.state IN ('running', 'compensating'))
    ELSE NOT sas_outbox_alive(handed_to) OR created_at < now() - interval '30 seconds' END
$$;

-- As 20261206000001, publishing only what sas_outbox_publishable allows,
-- and taking no order with a message that applications see still handed
-- to a publisher (its later messages wait for it: they stay in order).
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
    WHERE NOT EXISTS (SELECT 1 FROM outbox h WHERE h.order_id = t.id
        AND h.kind <> 'request' AND NOT sas_outbox_publishable(h.kind, h.order_id,
          h.correlation_id, h.handed_to, h.created_at))
      AND pg_advisory_lock(hashtextextended('sas.outbox:' || t.id::text, 0))::text IS NOT NULL;
  ELSE
    SELECT coalesce(array_agg(t.id ORDER BY t.n), '{}') INTO got
    FROM unnest(ids) WITH ORDINALITY AS t(id, n)
    WHERE NOT EXISTS (SELECT 1 FROM outbox h WHERE h.order_id = t.id
        AND h.kind <> 'request' AND NOT sas_outbox_publishable(h.kind, h.order_id,
          h.correlation_id, h.handed_to, h.created_at))
      AND pg_try_advisory_lock(hashtextextended('sas.outbox:' || t.id::text, 0));
  END IF;
  RETURN QUERY
    SELECT t.id, o.id, o.kind, o.routing_key, o.correlation_id, o.reply_to, o.traceparent, o.body
    FROM unnest(got) AS t(id) LEFT JOIN outbox o ON o.order_id = t.id
      AND sas_outbox_publishable(o.kind, o.order_id, o.correlation_id, o.handed_to, o.created_at)
    ORDER BY o.id NULLS LAST;
END
$$;
