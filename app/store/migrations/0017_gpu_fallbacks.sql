-- Models that failed on the GPU (LMSP §18): a load that failed on the device, the device lost or
-- out of memory. They run on the CPU from then on, so a broken driver costs one failure, not a
-- crash at every load; remembered per llama.cpp release (as safe mode is, §11), and forgotten
-- when the person asks for the GPU again (DELETE /v1/models/{id}/engine-mode).
CREATE TABLE gpu_fallbacks (
    digest     TEXT PRIMARY KEY,  -- the model file's sha256, as in models.digest
    llama      TEXT NOT NULL,     -- the llama.cpp release it failed under
    reason     TEXT NOT NULL,
    decided_at REAL NOT NULL
);
