-- Flow control per agent across the deployment (contract §4b): steps
-- dispatched to the agent and not yet answered, counted by every
-- transition's write-back in the same statement as the steps it changes,
-- and refused there past `max_in_flight`. Only agents with a limit have a row.
CREATE TABLE agent_flow (
    agent          text    PRIMARY KEY,
    max_in_flight  integer NOT NULL CHECK (max_in_flight > 0),
    in_flight      integer NOT NULL DEFAULT 0 CHECK (in_flight >= 0)
);

-- Why a held order waits: `breaker_open` (its agent's breaker; handled as a
-- failure after `hold_until`) or `rate_limited` (flow control; no bound).
ALTER TABLE orders ADD COLUMN held_reason text;
