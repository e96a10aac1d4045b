-- How llama.cpp runs each model on each CPU (LMSP §11 "Local engine modes"): a row exists once
-- the engine crashed in fast mode and fell back to safe mode, so the next start does not crash
-- again. The CPU is named by its model and a digest of its feature flags.

CREATE TABLE engine_modes (
    digest     TEXT NOT NULL,                -- the model file's sha256, as in models.digest
    cpu        TEXT NOT NULL,
    mode       TEXT NOT NULL CHECK (mode IN ('fast', 'safe')),
    reason     TEXT,
    decided_at REAL NOT NULL,
    PRIMARY KEY (digest, cpu)
);

-- Prompt tokens the engine reused from its cache instead of computing again (OpenAI's
-- usage.input_tokens_details.cached_tokens).
ALTER TABLE tasks ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0;
