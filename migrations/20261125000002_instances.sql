-- Who is alive (contract §8): every service instance records a heartbeat,
-- so that an order held by a scheduler that stopped beating can say so
-- (`scheduler_gone`).
CREATE TABLE instances (
    instance_id text PRIMARY KEY,
    role        text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    last_seen   timestamptz NOT NULL DEFAULT now()
);
