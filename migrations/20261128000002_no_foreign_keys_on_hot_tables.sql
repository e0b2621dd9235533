-- Every insert into `steps` and `order_events` fired a foreign-key trigger
-- that looked up and key-share-locked (a WAL record) the order's row: four
-- to nine per order, inside the write-back that inserts them. That
-- statement already inserts an order's steps and events only with the order
-- (new orders: only those it inserted; others: only when the version-guarded
-- update of the order row succeeded), so the keys guarded nothing; their one
-- other use, ON DELETE CASCADE, is done by `orders prune` itself.
ALTER TABLE steps DROP CONSTRAINT steps_order_id_fkey;
ALTER TABLE order_events DROP CONSTRAINT order_events_order_id_fkey;
