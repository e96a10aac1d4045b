-- Remote models (LMSP §11): a model served by other OpenAI-compatible servers has a row in
-- `models` with format 'remote' and no file (path, size, mtime and digest NULL), and its
-- endpoints in `model_endpoints`, tried in the order of `position`. API keys are never here:
-- `key_ref` names the secret that holds one (the keyring, else a user-only file: app/secrets.py).
-- SQLite cannot drop NOT NULL in place: the table is rebuilt (nothing references it).

CREATE TABLE models_new (
    id             TEXT PRIMARY KEY,
    format         TEXT NOT NULL DEFAULT 'gguf' CHECK (format IN ('gguf', 'remote')),
    path           TEXT,
    size_bytes     INTEGER,
    mtime_ns       INTEGER,
    digest         TEXT,                     -- "sha256:<hex>"
    context_length INTEGER,
    metadata       TEXT NOT NULL DEFAULT '{}',
    created_at     REAL NOT NULL,
    device         INTEGER,
    inode          INTEGER,
    CHECK ((format = 'gguf') = (path IS NOT NULL AND size_bytes IS NOT NULL AND mtime_ns IS NOT NULL
                                AND digest IS NOT NULL))
);
INSERT INTO models_new (id, path, size_bytes, mtime_ns, digest, context_length, metadata, created_at, device, inode)
    SELECT id, path, size_bytes, mtime_ns, digest, context_length, metadata, created_at, device, inode FROM models;
DROP TABLE models;
ALTER TABLE models_new RENAME TO models;

CREATE TABLE model_endpoints (
    model_id       TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
    position       INTEGER NOT NULL,
    base_url       TEXT NOT NULL,
    upstream_model TEXT NOT NULL,
    key_ref        TEXT,                     -- NULL: the endpoint needs no API key
    PRIMARY KEY (model_id, position)
);
