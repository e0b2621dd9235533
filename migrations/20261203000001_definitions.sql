-- Contract §4d, versions: every order keeps the whole definition it was
-- submitted under (steps, policies, expressions) until it ends. A
-- definition is stored once per content (its id is a UUIDv5 of its JSON)
-- by the services that submit orders, at start-up; an order names it.
-- Orders stored before this have none, and follow the configuration.
CREATE TABLE definitions (
    id uuid PRIMARY KEY,
    workflow text NOT NULL,
    version text,
    spec jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE orders ADD COLUMN definition uuid;
