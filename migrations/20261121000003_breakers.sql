-- Circuit-breaker state per agent endpoint, as each agent instance last
-- reported it, for the operator dashboard. Agents upsert their row on every
-- state change and as a heartbeat every few seconds; a row whose `seen_at` is
-- old belongs to an instance that stopped reporting.
CREATE TABLE agent_breakers (
    agent                 text        NOT NULL,
    -- The reporting process, `<host>:<pid>`: several agent instances serve one agent.
    instance              text        NOT NULL,
    -- The remote URL the agent calls.
    endpoint              text        NOT NULL,
    state                 text        NOT NULL CHECK (state IN ('closed', 'half_open', 'open')),
    consecutive_failures  integer     NOT NULL DEFAULT 0,
    -- When `state` last changed (database clock).
    changed_at            timestamptz NOT NULL DEFAULT now(),
    -- The last report (database clock).
    seen_at               timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent, instance, endpoint)
);

-- The dashboard's throughput and latency charts read the terminal events of
-- the last minutes; without this index each refresh would scan the whole
-- event log. Partial: only the one terminal event per run of an order is indexed.
CREATE INDEX order_events_terminal_at ON order_events (at)
    WHERE event IN ('processed', 'compensated', 'failed');
