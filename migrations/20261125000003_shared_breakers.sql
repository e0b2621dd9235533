-- A breaker shared by the deployment (contract §8): one row per agent,
-- written by every instance of that agent. While it is open, no step for the
-- agent is dispatched: the orders that need it are held (`orders.held_for`).
CREATE TABLE breakers (
    agent        text        PRIMARY KEY,
    state        text        NOT NULL DEFAULT 'closed'
                             CHECK (state IN ('closed', 'open', 'half_open')),
    -- Consecutive transient failures, counted by all instances together.
    failures     integer     NOT NULL DEFAULT 0,
    -- When it last opened: the outage's start, kept through its probes.
    opened_at    timestamptz,
    -- Open: the end of the cool-down. Half-open: when the probe is given up
    -- and another may go.
    open_until   timestamptz,
    -- Half-open: the held order whose step is the probe.
    probe_order  uuid,
    -- An operator's override ('open' or 'closed'), and who set it.
    forced       text        CHECK (forced IN ('open', 'closed')),
    forced_by    text,
    -- The agent's policy, as its instances last wrote it (database clock
    -- decides; these only size the waits).
    threshold    integer     NOT NULL DEFAULT 5,
    cooldown_ms  bigint      NOT NULL DEFAULT 5000,
    max_hold_ms  bigint      NOT NULL DEFAULT 86400000,
    changed_at   timestamptz NOT NULL DEFAULT now()
);

-- Every change of a breaker's state, and who made it (an agent instance,
-- or an operator forcing it): the audit trail `sasctl agents` and the
-- dashboard show.
CREATE TABLE breaker_events (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    agent       text        NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    from_state  text        NOT NULL,
    to_state    text        NOT NULL,
    actor       text        NOT NULL,
    reason      text        NOT NULL
);
CREATE INDEX breaker_events_agent ON breaker_events (agent, id);

-- A held order: pending (or compensating with nobody driving it), waiting
-- for `held_for`'s breaker to close; handled as a failure again after
-- `hold_until` (the agent's max_hold).
ALTER TABLE orders
    ADD COLUMN held_for   text,
    ADD COLUMN held_since timestamptz,
    ADD COLUMN hold_until timestamptz;
CREATE INDEX orders_held ON orders (held_for, held_since) WHERE held_for IS NOT NULL;
CREATE INDEX orders_hold_until ON orders (hold_until) WHERE hold_until IS NOT NULL;

-- Every load of orders reads the breakers that are not closed: an index
-- serves it where sequential scans are priced as disabled (the services').
CREATE INDEX breakers_not_closed ON breakers (agent) WHERE state <> 'closed';
