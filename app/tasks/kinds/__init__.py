"""The task kinds, one module each, behind the one scheduler (app/tasks/scheduler.py).

A new kind (an embedding batch, a model conversion) is a module with a `Kind` subclass
(app/tasks/kinds/base.py) and one line in KINDS; its tasks are rows of `tasks` with its name.
"""

from __future__ import annotations

from app.tasks.kinds.base import Kind, Needs
from app.tasks.kinds.download import Downloads
from app.tasks.kinds.generation import Generations

__all__ = ["KINDS", "TERMINAL_EVENTS", "Kind", "Needs", "build"]

# In the order a claim tries them: generations first, someone is waiting for them.
KINDS: tuple[type[Kind], ...] = (Generations, Downloads)
TERMINAL_EVENTS = tuple(event for kind in KINDS for event in kind.terminal_events)


def build(needs: Needs) -> list[Kind]:
    return [kind(needs) for kind in KINDS]
