-- LMSP 1.0 §11.1: the tables of the service. Model files never go in here: only their metadata.

CREATE TABLE service_config (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL                      -- JSON
);

CREATE TABLE clients (
    id           TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    token_hash   TEXT NOT NULL UNIQUE,       -- sha256 of the token; the token itself is never stored
    scopes       TEXT NOT NULL,              -- JSON list
    is_owner     INTEGER NOT NULL DEFAULT 0,
    created_at   REAL NOT NULL,
    last_used_at REAL,
    revoked_at   REAL
);

CREATE TABLE models (
    id             TEXT PRIMARY KEY,
    path           TEXT NOT NULL,
    size_bytes     INTEGER NOT NULL,
    mtime_ns       INTEGER NOT NULL,
    digest         TEXT NOT NULL,            -- "sha256:<hex>"
    context_length INTEGER,
    metadata       TEXT NOT NULL DEFAULT '{}',
    created_at     REAL NOT NULL
);

CREATE TABLE responses (
    id         TEXT PRIMARY KEY,
    client_id  TEXT NOT NULL,
    model_id   TEXT NOT NULL,
    request    TEXT NOT NULL,                -- JSON: the generation request as accepted
    background INTEGER NOT NULL,
    metadata   TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL
);

CREATE TABLE tasks (
    id                   TEXT PRIMARY KEY,
    response_id          TEXT NOT NULL UNIQUE REFERENCES responses(id) ON DELETE CASCADE,
    status               TEXT NOT NULL CHECK (status IN
        ('queued', 'loading', 'running', 'cancelling', 'completed', 'failed', 'cancelled')),
    on_restart           TEXT NOT NULL CHECK (on_restart IN ('fail', 'retry', 'resume')),
    attempt              INTEGER NOT NULL DEFAULT 1,
    created_at           REAL NOT NULL,
    started_at           REAL,
    finished_at          REAL,
    max_output_tokens    INTEGER,
    input_tokens         INTEGER NOT NULL DEFAULT 0,
    -- The snapshot: the tokens produced so far and their text, committed with the deltas.
    output_ids           TEXT NOT NULL DEFAULT '[]',
    output_text          TEXT NOT NULL DEFAULT '',
    output_tokens        INTEGER NOT NULL DEFAULT 0,
    tokens_per_second    REAL,
    finish_reason        TEXT,
    error_code           TEXT,
    error_message        TEXT,
    last_sequence_number INTEGER NOT NULL DEFAULT -1
);
CREATE INDEX tasks_by_status ON tasks (status, created_at);
CREATE INDEX tasks_by_finish ON tasks (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE task_events (
    task_id         TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    sequence_number INTEGER NOT NULL,
    type            TEXT NOT NULL,
    data            TEXT NOT NULL,           -- JSON: the whole event as clients see it
    created_at      REAL NOT NULL,
    UNIQUE (task_id, sequence_number)
);

CREATE TABLE idempotency_keys (
    client_id      TEXT NOT NULL,
    key            TEXT NOT NULL,
    request_digest TEXT NOT NULL,
    status_code    INTEGER,                  -- NULL while the first request is in flight
    response_body  TEXT,
    response_id    TEXT,
    created_at     REAL NOT NULL,
    PRIMARY KEY (client_id, key)
);
