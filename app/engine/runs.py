"""What a task needs of an engine (`Runs`), local (a `Seat` on app/engine/parent/engine.py's `Engine`)
or remote (app/engine/net/remote.py): a `Generation` to run, `Message`s back, an `EngineError`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.engine.request import Request

Message = dict[str, Any]
CRASHED = {"code": "engine_crashed", "message": "The inference engine stopped unexpectedly; the task stopped."}


class EngineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None, final: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param  # the request field at fault, if the request was
        self.final = final  # the engine already spent the crashes a task may cost: no retry


@dataclass(frozen=True)
class Generation:
    """One run of a request: the request as stored, its task's limit, and where to pick up from (resume)."""
    request: Request
    max_tokens: int | None
    prefix_ids: list[int] = field(default_factory=list)  # the output so far: the token ids streamed
    prefix_text: str = ""                # its text
    prefix_tokens: int = 0               # and how many tokens it counted


Waiting = Callable[[str], Awaitable[None]]  # told why a task waits for its engine, before each pause


class Runs(Protocol):
    """What a task needs of an engine, local (a `Seat` on an `Engine`) or remote (app/engine/net/remote.py)."""
    name: str

    async def open(self, model: Any, gen: Generation, waiting: Waiting) -> bool:
        """Get ready to run `gen` on the model of this `models` row; True when it had to be loaded."""

    def generate(self, gen: Generation) -> AsyncIterator[Message]:
        """`chunk` messages (`ids`, `text`, `tokens`), a `reset` when the output starts again from
        nothing, then one `done`. Raises EngineError."""

    def cancel(self) -> None:
        """Stop what runs: `generate` ends with a `done` of reason `cancelled`."""
