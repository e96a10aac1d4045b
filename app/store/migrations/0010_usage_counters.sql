-- What the limits on queued work and stored requests count (app/tasks/limits.py), kept per
-- client by triggers in the very transaction that changes it, so that a request's checks read
-- one row per client instead of counting every unfinished task and summing every request.
-- A trigger cannot be forgotten by a new code path that inserts, moves or deletes a task.

CREATE TABLE client_usage (
    client_id     TEXT PRIMARY KEY,
    unfinished    INTEGER NOT NULL DEFAULT 0,  -- tasks queued, loading, running or cancelling
    request_bytes INTEGER NOT NULL DEFAULT 0   -- bytes of the requests stored (responses.request_bytes)
) WITHOUT ROWID;

INSERT INTO client_usage(client_id, unfinished, request_bytes)
    SELECT r.client_id,
           COALESCE(SUM(t.status IN ('queued', 'loading', 'running', 'cancelling')), 0),
           SUM(r.request_bytes)
    FROM responses r LEFT JOIN tasks t ON t.response_id = r.id GROUP BY r.client_id;

CREATE TRIGGER usage_request_stored AFTER INSERT ON responses BEGIN
    INSERT INTO client_usage(client_id, request_bytes) VALUES (NEW.client_id, NEW.request_bytes)
        ON CONFLICT(client_id) DO UPDATE SET request_bytes = request_bytes + excluded.request_bytes;
END;

-- BEFORE: the response's task, deleted by the cascade, still exists here (and the task's own
-- trigger below then finds no response, so nothing is counted twice).
CREATE TRIGGER usage_request_deleted BEFORE DELETE ON responses BEGIN
    UPDATE client_usage SET request_bytes = request_bytes - OLD.request_bytes,
        unfinished = unfinished - (SELECT COUNT(*) FROM tasks WHERE response_id = OLD.id
                                   AND status IN ('queued', 'loading', 'running', 'cancelling'))
        WHERE client_id = OLD.client_id;
END;

CREATE TRIGGER usage_request_resized AFTER UPDATE OF client_id, request_bytes ON responses BEGIN
    UPDATE client_usage SET request_bytes = request_bytes - OLD.request_bytes WHERE client_id = OLD.client_id;
    INSERT INTO client_usage(client_id, request_bytes) VALUES (NEW.client_id, NEW.request_bytes)
        ON CONFLICT(client_id) DO UPDATE SET request_bytes = request_bytes + excluded.request_bytes;
END;

CREATE TRIGGER usage_task_created AFTER INSERT ON tasks
    WHEN NEW.status IN ('queued', 'loading', 'running', 'cancelling') BEGIN
    UPDATE client_usage SET unfinished = unfinished + 1
        WHERE client_id = (SELECT client_id FROM responses WHERE id = NEW.response_id);
END;

-- Only a change between unfinished and finished counts; the per-token updates of a running
-- task do not set `status` and never fire it.
CREATE TRIGGER usage_task_moved AFTER UPDATE OF status ON tasks
    WHEN (OLD.status IN ('queued', 'loading', 'running', 'cancelling'))
      <> (NEW.status IN ('queued', 'loading', 'running', 'cancelling')) BEGIN
    UPDATE client_usage SET unfinished = unfinished
            + CASE WHEN NEW.status IN ('queued', 'loading', 'running', 'cancelling') THEN 1 ELSE -1 END
        WHERE client_id = (SELECT client_id FROM responses WHERE id = NEW.response_id);
END;

CREATE TRIGGER usage_task_deleted AFTER DELETE ON tasks
    WHEN OLD.status IN ('queued', 'loading', 'running', 'cancelling') BEGIN
    UPDATE client_usage SET unfinished = unfinished - 1
        WHERE client_id = (SELECT client_id FROM responses WHERE id = OLD.response_id);
END;
