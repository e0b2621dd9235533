-- The state store of sas (contract §3): orders with the pattern's fields,
-- their steps, the event log, and the outbox of messages still to publish.

CREATE TABLE orders (
    order_id       uuid PRIMARY KEY,
    workflow       text        NOT NULL,
    payload        jsonb       NOT NULL,
    reply_to       text,
    priority       smallint    NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 9),
    not_before     timestamptz,
    process_state  text        NOT NULL DEFAULT 'pending' CHECK (process_state IN
                   ('pending', 'processing', 'processed', 'error', 'compensating', 'compensated')),
    -- The scheduler instance driving the order, or null when nobody is.
    locked_by      text,
    -- Deadline of the step now running; the supervisor acts once it has passed.
    complete_by    timestamptz,
    failure_count  integer     NOT NULL DEFAULT 0,
    -- Expiries while compensating; counted apart so undoing has its own budget.
    compensation_failures integer NOT NULL DEFAULT 0,
    -- Last status event number handed out; events are numbered 1, 2, 3 …
    last_seq       integer     NOT NULL DEFAULT 0,
    last_error     text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02);

-- What a scheduler may claim: pending orders, and compensating orders that nobody drives.
CREATE INDEX orders_claimable ON orders (priority DESC, created_at)
    WHERE process_state = 'pending'
       OR (process_state = 'compensating' AND locked_by IS NULL);

-- What the supervisor sweeps.
CREATE INDEX orders_expiring ON orders (complete_by)
    WHERE locked_by IS NOT NULL;

CREATE INDEX orders_state ON orders (process_state, workflow);

CREATE TABLE steps (
    order_id     uuid        NOT NULL REFERENCES orders ON DELETE CASCADE,
    idx          integer     NOT NULL,
    name         text        NOT NULL,
    agent        text        NOT NULL,
    compensate   text,
    timeout_ms   bigint      NOT NULL,
    state        text        NOT NULL DEFAULT 'not_started' CHECK (state IN
                 ('not_started', 'running', 'completed', 'failed', 'compensating', 'compensated')),
    -- Dispatches of this step so far (forward and compensation).
    dispatches   integer     NOT NULL DEFAULT 0,
    -- The current dispatch; a reply with any other id is stale.
    dispatch_id  uuid,
    complete_by  timestamptz,
    result       jsonb,
    error        text,
    started_at   timestamptz,
    finished_at  timestamptz,
    PRIMARY KEY (order_id, idx)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02);

-- Every transition of an order: who, when, from, to, why. Rows with `seq` are
-- the status events of contract §2.
CREATE TABLE order_events (
    order_id    uuid        NOT NULL REFERENCES orders ON DELETE CASCADE,
    seq         integer     NOT NULL,
    event       text        NOT NULL,
    from_state  text,
    to_state    text        NOT NULL,
    step        text,
    attempt     integer     NOT NULL,
    actor       text        NOT NULL,
    reason      text,
    detail      jsonb       NOT NULL DEFAULT '{}',
    at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, seq)
);

-- Messages committed with a transition and not yet confirmed by the broker.
CREATE TABLE outbox (
    id              bigserial   PRIMARY KEY,
    order_id        uuid        NOT NULL,
    -- 'status', 'request' or 'alert'.
    kind            text        NOT NULL,
    routing_key     text        NOT NULL,
    correlation_id  text,
    reply_to        text,
    body            jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
) WITH (autovacuum_vacuum_scale_factor = 0.01);

CREATE INDEX outbox_order ON outbox (order_id, id);
