-- The apps that share one client (the Ollama listener's apps without a token) each have a share
-- of its limits on queued tasks and stored bytes (app/tasks/limits.py): a request records which
-- of them sent it (app/server/peer.py `party`: a page's origin, a process, a user).

ALTER TABLE responses ADD COLUMN party TEXT;  -- NULL: the client's own request, not one of its parties'

CREATE INDEX responses_by_party ON responses(client_id, party) WHERE party IS NOT NULL;
