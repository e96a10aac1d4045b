"""The engine child process: keeps one model loaded and generates on request.

It runs in its own process so that a bad model file or a crash inside llama.cpp cannot take
the app down. It speaks plain dicts over a multiprocessing pipe:

  parent -> child  {"op": "load", "path", "n_ctx"} | {"op": "generate", "job", ...}
                   {"op": "cancel", "job"} | {"op": "shutdown"}
  child -> parent  {"ev": "loaded", ...} | {"ev": "chunk", "job", "ids", "text"}
                   {"ev": "done", "job", "reason", "input_tokens", "output_tokens"}
                   {"ev": "error", "job"?, "code", "message"}
"""

from __future__ import annotations

import codecs
import os
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

Message = dict[str, Any]


class Child:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.llm: Any = None
        self.formatter: Any = None
        self.inbox: deque[Message] = deque()

    def next_message(self) -> Message:
        return self.inbox.popleft() if self.inbox else self.conn.recv()

    def serve(self) -> None:
        while True:
            msg = self.next_message()
            op = msg["op"]
            if op == "shutdown":
                return
            if op == "load":
                self.load(msg)
            elif op == "unload":
                self.llm = self.formatter = None
                self.conn.send({"ev": "unloaded"})
            elif op == "generate":
                self.generate(msg)
            # a cancel for a job that already ended needs no answer

    def load(self, msg: Message) -> None:
        from llama_cpp import Llama

        from app.engine import backend
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        started = time.monotonic()
        self.llm = self.formatter = None
        try:
            backend.load()
            llm = Llama(model_path=msg["path"], n_ctx=msg.get("n_ctx", 4096), n_threads=msg.get("n_threads") or os.cpu_count(),
                        verbose=False)
        except Exception as exc:  # llama.cpp reports a bad file as a ValueError/RuntimeError
            self.conn.send({"ev": "error", "code": "model_load_failed", "message": str(exc)})
            return
        template = llm.metadata.get("tokenizer.chat_template")
        if template:
            def token_text(tok: int) -> str:
                return llm._model.token_get_text(tok) if tok != -1 else ""
            self.formatter = Jinja2ChatFormatter(template=template, eos_token=token_text(llm.token_eos()),
                                                 bos_token=token_text(llm.token_bos()),
                                                 add_generation_prompt=True)
        self.llm = llm
        self.conn.send({"ev": "loaded", "n_ctx": llm.n_ctx(), "n_ctx_train": llm._model.n_ctx_train(),
                        "load_seconds": time.monotonic() - started})

    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        if self.formatter is not None:
            prompt = self.formatter(messages=messages)
            return self.llm.tokenize(prompt.prompt.encode(), add_bos=not prompt.added_special, special=True)
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant: "
        return self.llm.tokenize(text.encode(), add_bos=True, special=False)

    def cancelled(self, job: str) -> bool:
        while self.conn.poll():
            msg = self.conn.recv()
            if msg["op"] == "cancel" and msg["job"] == job:
                return True
            if msg["op"] != "cancel":
                self.inbox.append(msg)
        return False

    def generate(self, msg: Message) -> None:
        from llama_cpp import llama_vocab_is_eog

        job = msg["job"]
        llm = self.llm
        if llm is None:
            self.conn.send({"ev": "error", "job": job, "code": "model_not_loaded", "message": "No model is loaded."})
            return
        prompt = self.prompt_tokens(msg["messages"])
        prefix: list[int] = list(msg.get("prefix_ids") or [])
        room = llm.n_ctx() - len(prompt)
        if room <= 0:
            self.conn.send({"ev": "error", "job": job, "code": "context_length_exceeded",
                            "message": f"The input is {len(prompt)} tokens; the model's context holds {llm.n_ctx()}."})
            return
        limit = min(msg.get("max_tokens") or room, room)
        stops: list[str] = msg.get("stop") or []
        hold = max((len(s) for s in stops), default=1) - 1  # text that could still become a stop

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        history = prompt[:]
        text = ""
        for tok in prefix:  # rebuild the text state the snapshot was taken from
            text += decoder.decode(llm.detokenize([tok], prev_tokens=history))
            history.append(tok)
        emitted = int(msg.get("emitted_chars", len(text)))
        count, reason = len(prefix), "length"

        # Rebuild the context exactly as an uninterrupted run built it: the prompt in one batch,
        # then each earlier output token on its own. Batch shapes change the floating-point
        # results, so reusing a cache or batching the prefix could flip a near-tie at
        # temperature 0 and break the promise that a resumed task ends with the same text.
        # The prompt goes in the same n_batch slices llama.cpp's own eval uses (same numbers),
        # one slice at a time so that a cancel is seen during a long prompt too.
        llm.reset()
        steps = [prompt[i:i + llm.n_batch] for i in range(0, len(prompt), llm.n_batch)] + [[t] for t in prefix]
        for step in steps:
            llm.eval(step)
            if self.cancelled(job):
                self.conn.send({"ev": "done", "job": job, "reason": "cancelled", "input_tokens": len(prompt),
                                "output_tokens": count})
                return
        if msg.get("seed") is not None:
            llm.set_seed(int(msg["seed"]))
        temperature = float(msg.get("temperature", 1.0))
        if count < limit:
            for tok in llm.generate(history, temp=temperature, top_p=float(msg.get("top_p", 1.0)),
                                    top_k=0, min_p=0.0, repeat_penalty=1.0, reset=True):
                if self.cancelled(job):
                    reason = "cancelled"
                    break
                if llama_vocab_is_eog(llm._model.vocab, tok):
                    reason = "stop"
                    break
                count += 1
                text += decoder.decode(llm.detokenize([tok], prev_tokens=history))
                history.append(tok)
                cut = min((i for i in (text.find(s, max(0, emitted - hold)) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    self.conn.send({"ev": "chunk", "job": job, "ids": [tok], "text": text[emitted:cut]})
                    text, emitted, reason = text[:cut], cut, "stop"
                    break
                safe = max(emitted, len(text) - hold)
                self.conn.send({"ev": "chunk", "job": job, "ids": [tok], "text": text[emitted:safe]})
                emitted = safe
                if count >= limit:
                    break
        text += decoder.decode(b"", final=True)
        if len(text) > emitted:
            self.conn.send({"ev": "chunk", "job": job, "ids": [], "text": text[emitted:]})
        self.conn.send({"ev": "done", "job": job, "reason": reason, "input_tokens": len(prompt),
                        "output_tokens": count})


def main(conn: Connection) -> None:
    """Entry point of the child process."""
    try:
        Child(conn).serve()
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the parent went away: nothing left to serve
