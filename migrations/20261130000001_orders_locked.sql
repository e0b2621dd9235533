-- A scheduler's claim counts the orders it holds (`locked_by = me`) so as
-- to stay under `scheduler.max_in_flight`. Without an index that count read
-- the whole orders table, ended orders included, on every claim: 0.3 ms at
-- a few thousand orders, 300 ms at a million. Only orders in flight have a
-- holder, so the index stays as small as they are. A step's write-back by
-- the order's holder leaves `locked_by` as it was, so it stays heap-only;
-- claiming and ending an order change `process_state`, which other indexes
-- cover already.
CREATE INDEX orders_locked ON orders (locked_by) WHERE locked_by IS NOT NULL;
