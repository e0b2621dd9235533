-- Fails the statement that calls it: the transitions' write-back
-- (state_store::unit) calls it when a guard finds a row changed under its
-- lock, so that nothing of the statement stays and the COMMIT sent in the
-- same round trip cannot commit the rest.
CREATE OR REPLACE FUNCTION sas_fail(message text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION USING MESSAGE = message, ERRCODE = 'SAS01';
END
$$;
