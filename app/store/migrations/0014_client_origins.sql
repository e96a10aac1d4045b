-- Web pages as clients (LMSP §16): a pairing request made from a page records the page's origin;
-- allowing it lets that origin call the service with that client's token, and only with it.
-- Revoking the client removes its origins.

ALTER TABLE pairings ADD COLUMN origin TEXT;     -- the request's Origin header; NULL: not from a page

CREATE TABLE client_origins (
    client_id TEXT NOT NULL REFERENCES clients(id),
    origin    TEXT NOT NULL,                     -- scheme://host[:port], as a browser sends it
    PRIMARY KEY (client_id, origin)
) WITHOUT ROWID;
