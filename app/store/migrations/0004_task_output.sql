-- A task's output, append-only: each write of a running task adds one chunk (the token ids and
-- the text they produced), so writing output costs the same at token 4000 as at token 1, where
-- the columns tasks.output_ids / output_text were rewritten whole on every flush. The text of
-- a response is its chunks in order; `resume` continues from their ids; `retry` deletes them.

CREATE TABLE task_output (
    task_id TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    chunk   INTEGER NOT NULL,                -- 0, 1, 2... per task
    ids     TEXT NOT NULL,                   -- JSON list of the chunk's token ids
    text    TEXT NOT NULL,                   -- the text those tokens added
    PRIMARY KEY (task_id, chunk)
) WITHOUT ROWID;

INSERT INTO task_output(task_id, chunk, ids, text)
    SELECT id, 0, output_ids, output_text FROM tasks WHERE output_ids <> '[]' OR output_text <> '';

ALTER TABLE tasks DROP COLUMN output_ids;
ALTER TABLE tasks DROP COLUMN output_text;
