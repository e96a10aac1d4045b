-- Downloads from the Hugging Face hub (LMSP §13) are tasks of another kind: the same states,
-- events, cancel, recovery and retention as a generation. Their request lives in `responses`
-- like a generation's (who asked, what, when), so ownership, listing and retention stay one
-- code path; its id starts with `dl_` and it is never served as a response.

ALTER TABLE tasks ADD COLUMN kind TEXT NOT NULL DEFAULT 'response' CHECK (kind IN ('response', 'download'));

CREATE TABLE downloads (
    task_id          TEXT PRIMARY KEY REFERENCES tasks(id) ON DELETE CASCADE,
    repo             TEXT NOT NULL,
    file             TEXT NOT NULL,
    revision         TEXT NOT NULL,
    commit_hash      TEXT NOT NULL,          -- what `revision` pointed at when the download was asked for
    sha256           TEXT NOT NULL,          -- the hub's LFS digest: the bytes must hash to it
    total_bytes      INTEGER NOT NULL,
    partial_path     TEXT NOT NULL,          -- where the bytes so far are kept, across restarts
    bytes            INTEGER NOT NULL DEFAULT 0,
    bytes_per_second REAL,
    model_id         TEXT                    -- the model it became
);
CREATE INDEX downloads_by_file ON downloads (repo, file, revision);
