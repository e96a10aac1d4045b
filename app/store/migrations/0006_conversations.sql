-- Conversation state (LMSP §12): a response may continue an earlier one. The request column
-- already holds the whole message list the model saw (the chain is resolved when the request
-- is accepted); these columns say where it came from and whether the response may be kept.

ALTER TABLE responses ADD COLUMN previous_response_id TEXT;   -- no foreign key: an ancestor may be deleted later
ALTER TABLE responses ADD COLUMN store INTEGER NOT NULL DEFAULT 1;  -- 0: purged shortly after it ends
CREATE INDEX responses_unstored ON responses (id) WHERE store = 0;
