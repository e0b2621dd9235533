-- Redrive (contract §9): how many times an operator has started this ended
-- order again. Redrive N sends every step it runs again with the
-- idempotency key `<order_id>:<step>:rN`, so a remote that remembers answers
-- by key never replays an old failure. 0 for an order never redriven (and
-- every order stored before): the keys of contract §4. A constant default
-- and no CHECK: the column is added without rewriting or scanning the table.
ALTER TABLE orders ADD COLUMN redrives integer NOT NULL DEFAULT 0;
