-- The outbox holds each message's body as the bytes to publish: the
-- transition encodes it once, and neither Postgres (jsonb parsing) nor the
-- relay (decoding and encoding again) spends time on it.
ALTER TABLE outbox ALTER COLUMN body TYPE bytea USING convert_to(body::text, 'UTF8');
