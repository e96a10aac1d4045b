"""Task states and the transitions allowed between them (LMSP §6)."""

from __future__ import annotations

QUEUED, LOADING, RUNNING, CANCELLING = "queued", "loading", "running", "cancelling"
COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"
UNFINISHED = (QUEUED, LOADING, RUNNING, CANCELLING)
TERMINAL = (COMPLETED, FAILED, CANCELLED)

# to-state -> the states it may be reached from
ALLOWED: dict[str, tuple[str, ...]] = {
    QUEUED: (QUEUED, LOADING, RUNNING),  # re-queued by recovery (retry/resume), or giving its slot away
    LOADING: (QUEUED,),
    RUNNING: (LOADING, RUNNING),
    CANCELLING: (LOADING, RUNNING),
    COMPLETED: (RUNNING,),
    FAILED: (QUEUED, LOADING, RUNNING),
    CANCELLED: (QUEUED, CANCELLING),
}
