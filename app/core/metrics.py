"""`GET /metrics` in the Prometheus text format: what the service is doing, from the core's state."""

from __future__ import annotations

import bisect
import sqlite3
from typing import Any

from app.tasks.states import TERMINAL, UNFINISHED

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LatencyHistogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(BUCKETS, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        running += self.counts[-1]
        out += [f'{name}_bucket{{le="+Inf"}} {running}', f"{name}_sum {self.total:.6f}", f"{name}_count {running}"]
        return out


def task_counts(conn: sqlite3.Connection) -> dict[str, int]:
    return {r["status"]: r["n"] for r in conn.execute("SELECT status, count(*) AS n FROM tasks GROUP BY status")}


def model_ids(conn: sqlite3.Connection) -> dict[str, str]:
    """Each local model's id, by its file's path."""
    return {r["path"]: r["id"] for r in conn.execute("SELECT id, path FROM models WHERE path IS NOT NULL")}


def slot_lines(slots: dict[str, tuple[int, int]], ids: dict[str, str]) -> list[str]:
    """Slots busy and in all, per loaded model (`EnginePool.slots`, by path)."""
    lines = ["# HELP lmsp_slots_busy Tasks a loaded model is decoding now.", "# TYPE lmsp_slots_busy gauge"]
    lines += [f'lmsp_slots_busy{{model="{ids.get(path, path)}"}} {busy}' for path, (busy, _) in sorted(slots.items())]
    lines += ["# HELP lmsp_slots_total Tasks a loaded model can decode at once (its copies' parallel slots).",
              "# TYPE lmsp_slots_total gauge"]
    lines += [f'lmsp_slots_total{{model="{ids.get(path, path)}"}} {n}' for path, (_, n) in sorted(slots.items())]
    return lines


def render(counts: dict[str, int], *, tokens: int, tokens_per_second: float | None, load_seconds: float | None,
           recovery: dict[str, int], latency: LatencyHistogram, commits: int, transactions: int,
           slots: list[str]) -> str:
    lines: list[Any] = ["# HELP lmsp_tasks Tasks in the database by state.", "# TYPE lmsp_tasks gauge"]
    lines += [f'lmsp_tasks{{state="{s}"}} {counts.get(s, 0)}' for s in (*UNFINISHED, *TERMINAL)]
    lines += ["# HELP lmsp_queue_depth Tasks waiting to run.", "# TYPE lmsp_queue_depth gauge",
              f"lmsp_queue_depth {counts.get('queued', 0)}",
              "# HELP lmsp_tokens_generated_total Output tokens generated since the service started.",
              "# TYPE lmsp_tokens_generated_total counter", f"lmsp_tokens_generated_total {tokens}",
              "# HELP lmsp_decode_tokens_per_second Decode speed of the last finished generation.",
              "# TYPE lmsp_decode_tokens_per_second gauge",
              f"lmsp_decode_tokens_per_second {tokens_per_second or 0}",
              "# HELP lmsp_model_load_seconds Time the last explicit model load took.",
              "# TYPE lmsp_model_load_seconds gauge", f"lmsp_model_load_seconds {load_seconds or 0}",
              "# HELP lmsp_recovered_tasks Tasks moved by recovery at the last start, by move.",
              "# TYPE lmsp_recovered_tasks gauge"]
    lines += [f'lmsp_recovered_tasks{{move="{move}"}} {n}' for move, n in sorted(recovery.items())]
    lines += ["# HELP lmsp_store_commits_total Commits of write transactions to disk (one fsync each).",
              "# TYPE lmsp_store_commits_total counter", f"lmsp_store_commits_total {commits}",
              "# HELP lmsp_store_transactions_total Writes committed; writes that arrive together share a commit.",
              "# TYPE lmsp_store_transactions_total counter", f"lmsp_store_transactions_total {transactions}"]
    lines += slots
    lines += ["# HELP lmsp_request_seconds HTTP request latency (to the first byte of the answer).",
              "# TYPE lmsp_request_seconds histogram", *latency.lines("lmsp_request_seconds")]
    return "\n".join(lines) + "\n"
