-- Replay by status queue (contract §9: {"reply_to", "since"}) finds the
-- orders of one queue through this index rather than by scanning every
-- order. Partial: orders without a status queue are never replayed by queue.
-- An index on reply_to alone keeps the claim's and the sweeps' updates HOT
-- (reply_to never changes).
CREATE INDEX orders_reply_to ON orders (reply_to) WHERE reply_to IS NOT NULL;
