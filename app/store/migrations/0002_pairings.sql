-- Pairing requests from local apps (LMSP §3). The token an approval creates is never stored:
-- it is handed to the requester once, from memory; only its hash goes into `clients`.

CREATE TABLE pairings (
    id          TEXT PRIMARY KEY,            -- pair_ + 128 random bits: only the requester knows it
    client_name TEXT NOT NULL,
    scopes      TEXT NOT NULL,               -- JSON list
    code        TEXT NOT NULL,               -- shown by the app and by the tray, to match them up
    status      TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'denied')),
    client_id   TEXT REFERENCES clients(id),
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    token_given INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX pairings_pending ON pairings (status, expires_at);
