"""One generation's output text on its way to the parent (engine child only).

Tokens become text through an incremental UTF-8 decoder (a character may span tokens). Text
that could still become a stop sequence is held back; at the first stop sequence the text is
cut and nothing after it is sent. A resumed task's output so far is decoded again first, so
the state is the one its snapshot was taken from and `emitted` (what the parent has) holds.
"""

from __future__ import annotations

import codecs
from typing import Any


class Text:
    def __init__(self, llm: Any, prompt: list[int], prefix: list[int], stops: list[str], emitted: int) -> None:
        self.llm = llm
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # text that could still become a stop
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.history = prompt + list(prefix)
        self.text = ""
        for i, tok in enumerate(prefix):
            self.text += self.decoder.decode(llm.detokenize([tok], prev_tokens=self.history[:len(prompt) + i]))
        self.emitted = emitted

    def add(self, tok: int) -> tuple[str, bool]:
        """The text to send for a new token, and whether a stop sequence ended the output there."""
        self.text += self.decoder.decode(self.llm.detokenize([tok], prev_tokens=self.history))
        self.history.append(tok)
        text, emitted = self.text, self.emitted
        cut = min((i for i in (text.find(s, max(0, emitted - self.hold)) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.emitted = text[:cut], cut
            self.decoder.reset()  # bytes of a character after the stop are not output either
            return text[emitted:cut], True
        self.emitted = max(emitted, len(text) - self.hold)
        return text[emitted:self.emitted], False

    def rest(self) -> str:
        """What is left once no token follows: held-back text, an unfinished character."""
        self.text += self.decoder.decode(b"", final=True)
        rest, self.emitted = self.text[self.emitted:], len(self.text)
        return rest
