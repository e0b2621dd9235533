-- Leave room on each page so that updates which touch no indexed column
-- (a step's result, an order's event counter) stay on the page as HOT
-- updates, without new index entries.
ALTER TABLE orders SET (fillfactor = 80);
ALTER TABLE steps SET (fillfactor = 80);
