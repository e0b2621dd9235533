-- A step's write-back changes an order's `complete_by` (the next step's
-- deadline) and nothing else that an index covers, so without an index on
-- it the update is HOT: a new row version on the same page and no new
-- entry in any of the orders' indexes. The supervisor finds expired orders
-- among those in flight through `orders_state` (process_state), a few
-- thousand rows at most (scheduler.max_in_flight per scheduler).
DROP INDEX orders_expiring;
-- HOT needs room on the page for the new version. A write-back updates a
-- batch of orders and their steps together, and an old version is pruned
-- only once the transaction that replaced it has committed, so a page
-- needs room for a new version of most of its rows at once: at 80% full,
-- about two thirds of the updates found it.
ALTER TABLE orders SET (fillfactor = 50);
ALTER TABLE steps SET (fillfactor = 50);
