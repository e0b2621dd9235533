-- Contract §2a: an order asks for every status event ('all', the default)
-- or only its terminal one ('terminal'); the event log keeps every event
-- either way, for replay. A constant default: no table rewrite.
ALTER TABLE orders ADD COLUMN events text NOT NULL DEFAULT 'all'
  CHECK (events IN ('all', 'terminal'));
