-- What each client used, per UTC day and model (LMSP §17, GET /v1/usage): one row a day, client
-- and model, however many tasks, so a year of heavy use stays a few megabytes. Kept by triggers,
-- as client_usage is (0010): a task's end is counted by the very UPDATE that ends it, in its
-- transaction, whichever code path ends it (a generation, a download, a cancel of a queued task,
-- recovery after a crash): a crash can neither lose nor double a count, and a new path cannot
-- forget it. Deleting tasks (retention, DELETE /v1/responses) leaves the counts: they are history.
--
-- `requests` counts the requests that asked for work (a response, a chat completion, an Ollama
-- generation, a download), in the transaction that creates the task: the request's own commit,
-- no other. Reads, polls and embeddings (which store nothing) are not counted.

CREATE TABLE usage_days (
    day                INTEGER NOT NULL,           -- UTC days since 1970-01-01
    client_id          TEXT NOT NULL,
    model_id           TEXT NOT NULL,              -- as the request named it (a download: repo/file)
    requests           INTEGER NOT NULL DEFAULT 0, -- tasks created that day
    tasks_completed    INTEGER NOT NULL DEFAULT 0, -- tasks ended that day, by outcome
    tasks_failed       INTEGER NOT NULL DEFAULT 0,
    tasks_cancelled    INTEGER NOT NULL DEFAULT 0,
    input_tokens       INTEGER NOT NULL DEFAULT 0, -- of the tasks ended that day
    output_tokens      INTEGER NOT NULL DEFAULT 0,
    generation_seconds REAL NOT NULL DEFAULT 0,    -- from a generation's start to its end
    downloaded_bytes   INTEGER NOT NULL DEFAULT 0, -- of the downloads ended that day
    PRIMARY KEY (day, client_id, model_id)
) WITHOUT ROWID;

-- A task's usage once it has ended: what its end adds (the triggers below), and the backfill.
-- A generation resumed after a restart counts from its first start (its `started_at` stays).
CREATE VIEW task_usage AS
    SELECT t.id AS task_id, CAST(t.finished_at / 86400 AS INTEGER) AS day, r.client_id, r.model_id,
           t.status = 'completed' AS tasks_completed, t.status = 'failed' AS tasks_failed,
           t.status = 'cancelled' AS tasks_cancelled, t.input_tokens, t.output_tokens,
           CASE WHEN t.kind = 'response' AND t.started_at IS NOT NULL
                THEN MAX(t.finished_at - t.started_at, 0) ELSE 0 END AS generation_seconds,
           COALESCE(d.bytes, 0) AS downloaded_bytes
    FROM tasks t JOIN responses r ON r.id = t.response_id LEFT JOIN downloads d ON d.task_id = t.id
    WHERE t.status IN ('completed', 'failed', 'cancelled') AND t.finished_at IS NOT NULL;

-- What the tasks still in the database say: each one's request, and the end of those ended.
INSERT INTO usage_days(day, client_id, model_id, requests)
    SELECT CAST(t.created_at / 86400 AS INTEGER) AS d, r.client_id, r.model_id, COUNT(*)
    FROM tasks t JOIN responses r ON r.id = t.response_id GROUP BY d, r.client_id, r.model_id;
INSERT INTO usage_days(day, client_id, model_id, tasks_completed, tasks_failed, tasks_cancelled, input_tokens,
                       output_tokens, generation_seconds, downloaded_bytes)
    SELECT day, client_id, model_id, SUM(tasks_completed), SUM(tasks_failed), SUM(tasks_cancelled),
           SUM(input_tokens), SUM(output_tokens), SUM(generation_seconds), SUM(downloaded_bytes)
    FROM task_usage WHERE true GROUP BY day, client_id, model_id
    ON CONFLICT DO UPDATE SET tasks_completed = excluded.tasks_completed, tasks_failed = excluded.tasks_failed,
        tasks_cancelled = excluded.tasks_cancelled, input_tokens = excluded.input_tokens,
        output_tokens = excluded.output_tokens, generation_seconds = excluded.generation_seconds,
        downloaded_bytes = excluded.downloaded_bytes;

CREATE TRIGGER usage_day_request AFTER INSERT ON tasks BEGIN
    INSERT INTO usage_days(day, client_id, model_id, requests)
        SELECT CAST(NEW.created_at / 86400 AS INTEGER), client_id, model_id, 1 FROM responses
        WHERE id = NEW.response_id
        ON CONFLICT DO UPDATE SET requests = requests + 1;
END;

-- Only the move from unfinished to ended, which happens once: a task never leaves an end state.
CREATE TRIGGER usage_day_end AFTER UPDATE OF status ON tasks
    WHEN NEW.status IN ('completed', 'failed', 'cancelled')
     AND OLD.status NOT IN ('completed', 'failed', 'cancelled') BEGIN
    INSERT INTO usage_days(day, client_id, model_id, tasks_completed, tasks_failed, tasks_cancelled, input_tokens,
                           output_tokens, generation_seconds, downloaded_bytes)
        SELECT day, client_id, model_id, tasks_completed, tasks_failed, tasks_cancelled, input_tokens,
               output_tokens, generation_seconds, downloaded_bytes FROM task_usage WHERE task_id = NEW.id
        ON CONFLICT DO UPDATE SET tasks_completed = tasks_completed + excluded.tasks_completed,
            tasks_failed = tasks_failed + excluded.tasks_failed,
            tasks_cancelled = tasks_cancelled + excluded.tasks_cancelled,
            input_tokens = input_tokens + excluded.input_tokens, output_tokens = output_tokens + excluded.output_tokens,
            generation_seconds = generation_seconds + excluded.generation_seconds,
            downloaded_bytes = downloaded_bytes + excluded.downloaded_bytes;
END;
