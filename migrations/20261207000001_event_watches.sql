-- Orders whose status events an open HTTP event stream waits for (contract
-- §9a): a write-back that adds events to one of them notifies
-- `sas_order_events` with the order's id, so that a stream waits without
-- polling and the database's load does not grow with the streams. One row
-- per order and submission instance; an instance that dies leaves its rows
-- until `until`, after which any instance deletes them. Unlogged: a crash
-- or a failover loses them, and each instance stores its own again when its
-- listener connects anew.
CREATE UNLOGGED TABLE event_watches (
    order_id uuid        NOT NULL,
    watcher  text        NOT NULL,
    until    timestamptz NOT NULL,
    PRIMARY KEY (order_id, watcher)
);
