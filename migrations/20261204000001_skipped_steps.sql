-- A step whose `when` is false is skipped (contract §4d). The check is
-- added NOT VALID and validated apart, so that a large steps table is
-- scanned without blocking writes.
ALTER TABLE steps DROP CONSTRAINT steps_state_check;
ALTER TABLE steps ADD CONSTRAINT steps_state_check CHECK (state IN
    ('not_started', 'running', 'completed', 'failed', 'compensating', 'compensated', 'skipped'))
    NOT VALID;
ALTER TABLE steps VALIDATE CONSTRAINT steps_state_check;
