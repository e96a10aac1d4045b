-- Before this version a non-streamed chat completion stored its key with the chat body it
-- answered (id "chatcmpl-..."); chat keys now store the response and replay it in either
-- shape. An old one would not replay: dropping it lets a retry run anew.
DELETE FROM idempotency_keys WHERE response_id LIKE 'chatcmpl-%';
