-- Steps in parallel (contract §4b): the indices of the steps a step starts
-- after. NULL for steps stored before: the step before it, as it was.
ALTER TABLE steps ADD COLUMN after_steps int[];
