-- Which client registered each model: an app with `models:write` may remove only the models it
-- registered itself (a download registers the downloading app's); others' need `admin`. The
-- default model, and every model registered before this version, are the owner's.

ALTER TABLE models ADD COLUMN created_by TEXT NOT NULL DEFAULT 'client_owner';
