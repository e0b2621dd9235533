-- The dashboard's order search lists orders newest first and pages by
-- (created_at, order_id), optionally within a time range: without this
-- index each page would sort the whole table.
CREATE INDEX orders_created ON orders (created_at, order_id);
