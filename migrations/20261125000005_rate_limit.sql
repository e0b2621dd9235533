-- Rate limits per agent across the deployment (contract §4b): a token
-- bucket per agent, refilled at `rate_per_sec` up to `burst`; each dispatch
-- takes a token, in the write-back that makes it. An agent may have a rate
-- limit, an in-flight limit, or both.
ALTER TABLE agent_flow
    ALTER COLUMN max_in_flight DROP NOT NULL,
    ADD COLUMN rate_per_sec double precision CHECK (rate_per_sec > 0),
    ADD COLUMN burst        double precision NOT NULL DEFAULT 1 CHECK (burst >= 1),
    ADD COLUMN tokens       double precision NOT NULL DEFAULT 1,
    ADD COLUMN refilled_at  timestamptz      NOT NULL DEFAULT now();
