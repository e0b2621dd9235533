-- Child workflow steps (contract §4d): per child order (id UUIDv5 of the
-- parent's order id and step), the newest request of the parent's step for
-- it, forward or undo, which the child's end answers (its fence), and the
-- newest fencing token seen, so that an older request is refused.
CREATE TABLE children (
    child_id     uuid        PRIMARY KEY,
    request      jsonb       NOT NULL,
    newest_token bigint      NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
