-- Steps in doubt (contract §4c): dispatched, and no answer decided them (a
-- deadline passed, the agent went silent, or the order was given up or
-- cancelled while they ran). A remote may have applied them, so they are
-- undone with the completed steps. Cleared when a later dispatch completes
-- or fails permanently. `false` for steps stored before (ALTER TABLE with a
-- constant default rewrites nothing).
ALTER TABLE steps ADD COLUMN in_doubt boolean NOT NULL DEFAULT false;

-- An undo went out and no answer decided it (its deadline passed): the
-- remote may have undone the step. Such a step is undone again (the same
-- key; an undo is idempotent) before anything else may happen to it: a
-- retry or a redrive is refused until a cancel finishes the undo.
ALTER TABLE steps ADD COLUMN undo_in_doubt boolean NOT NULL DEFAULT false;
