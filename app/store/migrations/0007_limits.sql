-- Limits on stored requests (settings max_request_bytes_per_client, max_request_bytes): each
-- request's size in bytes, so that a client's total is summed from an index and never by
-- reading megabytes of prompts.

ALTER TABLE responses ADD COLUMN request_bytes INTEGER NOT NULL DEFAULT 0;
UPDATE responses SET request_bytes = length(CAST(request AS BLOB));
CREATE INDEX responses_bytes_by_client ON responses (client_id, request_bytes);
