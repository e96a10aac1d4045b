"""The child's generations when its model serves several at once (`parallel` > 1).

Each `generate` is admitted to the `Batch` (app/engine/child/batch.py) and every step of the
child's loop decodes one token for each of them in one llama_decode; each job's tokens go to
the parent as `chunk`s and its end as `done`, exactly as a job of its own would. A job that
arrives while every slot is taken (the parent counts a job free once it has its `done`, the
batch one step later) waits for the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from app.engine.child.batch import Batch, Full, Params, Stream
from app.engine.child.faults import fault
from app.engine.child.sampling import DEAD_END
from app.engine.child.text import Text
from app.engine.constraints import grammar
from app.engine.request import Request

Message = dict[str, Any]


class Batched:
    def __init__(self, llm: Any, parallel: int, n_ctx: int, n_threads: int, send: Callable[[Message], None],
                 doing: Callable[[int], None], fast: bool) -> None:
        def faults(points: set[str]) -> None:
            for point in points:
                fault(point, fast)

        self.llm = llm
        self.send = send
        self.batch = Batch(llm, parallel, n_ctx, n_threads, doing=doing, before=faults)
        self.jobs: dict[str, tuple[Stream, Text]] = {}
        self.waiting: deque[tuple[Message, list[int]]] = deque()  # jobs that found every slot taken

    def close(self) -> None:
        self.batch.close()

    def busy(self) -> bool:
        return bool(self.waiting) or self.batch.busy()

    def admit(self, msg: Message, prompt: list[int]) -> None:
        """Take a job whose prompt is tokenized (and fits) into the batch, or the queue for a slot."""
        job, request = msg["job"], msg["request"]
        assert isinstance(request, Request)
        prefix: list[int] = msg["prefix_ids"]
        gbnf = grammar.gbnf(request.constraint) if request.constraint else None
        params = Params(msg.get("max_tokens"), float(request.temperature), float(request.top_p), request.seed,
                        gbnf, tuple(prefix))
        try:
            stream = self.batch.admit(job, prompt, params)
        except Full:
            self.waiting.append((msg, prompt))
            return
        except ValueError as exc:  # a grammar llama.cpp cannot parse (a request stored before they were checked)
            self.send({"ev": "error", "job": job, "code": "unsupported_schema", "message": str(exc)})
            return
        self.jobs[job] = stream, Text(self.llm, prompt, prefix, request.stop, msg["emitted_chars"])

    def cancel(self, job: str) -> None:
        for waiting in self.waiting:
            if waiting[0]["job"] == job:
                self.waiting.remove(waiting)
                self.send({"ev": "done", "job": job, "reason": "cancelled", "input_tokens": len(waiting[1]),
                           "output_tokens": len(waiting[0]["prefix_ids"])})
                return
        self.batch.cancel(job)

    def stop_all(self) -> None:
        """Every job ends now, cancelled (the model is about to go)."""
        for msg, _ in list(self.waiting):
            self.cancel(msg["job"])
        for job in list(self.jobs):
            self.batch.cancel(job)
        while self.batch.busy():
            self.step()

    def step(self) -> None:
        """One step of the batch: admit who waits, decode, send what each job produced."""
        while self.waiting and len(self.batch.streams) < len(self.batch.slots):
            self.admit(*self.waiting.popleft())
        for out in self.batch.step():
            job = str(out.seq)
            if job not in self.jobs:
                continue  # it ended at a stop sequence: the batch reports its cancel now
            stream, text = self.jobs[job]
            if out.finished == "dead_end":  # the task fails; what it wrote so far stays written
                del self.jobs[job]
                self.send({"ev": "error", "job": job, "code": "unsupported_schema", "message": DEAD_END})
                continue
            reason = out.finished
            if out.token is not None:
                piece, stopped = text.add(out.token)
                self.send({"ev": "chunk", "job": job, "ids": [out.token], "text": piece,
                           "last": stopped or reason is not None})
                if stopped:
                    self.batch.cancel(job, keep=True)  # its cells stay: a next turn reuses them
                    reason = "stop"
            if reason is not None:
                del self.jobs[job]
                finish(self.send, job, text, reason, stream.prompt_tokens, stream.reused, stream.output_tokens)


def finish(send: Callable[[Message], None], job: str, text: Text, reason: str, input_tokens: int, cached: int,
           output_tokens: int) -> None:
    """A job's last text, if any was held back, and its `done`."""
    rest = text.rest()
    if rest:
        send({"ev": "chunk", "job": job, "ids": [], "text": rest, "last": True})
    send({"ev": "done", "job": job, "reason": reason, "input_tokens": input_tokens, "cached_tokens": cached,
          "output_tokens": output_tokens})
