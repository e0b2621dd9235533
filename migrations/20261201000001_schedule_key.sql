-- The deployment's secret from which recurring orders' ids are derived
-- (contract §1b): with ids any application could compute (the UUIDv5 of a
-- public namespace, schedule name and tick), an application could submit
-- a coming tick's order first, with its own payload, and the schedule
-- would find its order "already there". Random per database, readable by
-- sas only. Ticks already ordered keep their ids: the schedule's mark says
-- which ticks are dealt with, whatever their ids.
CREATE TABLE schedule_key (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    key uuid NOT NULL DEFAULT gen_random_uuid()
);
INSERT INTO schedule_key DEFAULT VALUES;
