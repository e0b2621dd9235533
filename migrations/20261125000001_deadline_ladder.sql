-- The deadline ladder (contract §8): how many of `supervisor.warn_at`'s
-- rungs the step's current dispatch has been warned of. Each dispatch
-- starts again at 0, so every dispatch is warned once per rung.
ALTER TABLE steps ADD COLUMN warned smallint NOT NULL DEFAULT 0;
