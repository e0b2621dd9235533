-- Recurring orders (contract §4b): one row per schedule, its mark. Every
-- tick at or before `last_tick` has been dealt with (ordered, or passed over
-- by its catch_up); the leading supervisor orders the ticks after it, then
-- moves it on, guarded by the mark it loaded. The orders themselves are
-- ordinary orders, whose ids are the UUIDv5 of (name, tick).
CREATE TABLE schedules (
    name          text        PRIMARY KEY,
    last_tick     timestamptz NOT NULL,
    -- The order of the latest tick ordered (none yet: null).
    last_order_id uuid,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
