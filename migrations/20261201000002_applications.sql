-- Application identities (contract §1b). With `[applications]` configured,
-- an application's order `x` is stored under an id of its own namespace
-- (so the same `x` from two applications is two orders), and its status
-- events still say `x`: `app_order_id` keeps it. Null for orders of no
-- application (before any is configured, and recurring orders).
ALTER TABLE orders ADD COLUMN application text, ADD COLUMN app_order_id uuid;
