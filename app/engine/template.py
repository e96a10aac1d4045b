"""A model's chat template (the Jinja text in its GGUF's `tokenizer.chat_template`), rendered as
llama-cpp-python renders it (its `Jinja2ChatFormatter`: the same sandbox, options, extensions and
functions), for the engine (app/engine/parent/prompt.py) and for the check made when a request is accepted
(app/core/templates.py). Both render the same input, so what one refuses the other does.

Templates may refuse a conversation: Mistral-Instruct's, Gemma's and Llama 2's call
`raise_exception` when roles do not alternate, Gemma 1/2's on any system message. A refusal, or
any other error of the template, is `Refused`: one request's error, never the engine's.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from app.engine import call_forms
from app.engine.call_forms import Form
from app.engine.request import THINK, THOUGHT, ChatMessage, Request, Tool, chat_tools

# Stands in for each message's text while the template renders (the engine tokenizes the text
# itself as plain text); NUL never comes from a template.
SLOT = "\x00{}\x00"
SLOTS = re.compile("\x00([0-9]+)\x00")
# Where the template's text is tokenized apart: before an earlier call's marks (`leads`), so they
# are the tokens the model writes them in, from the start of its answer, not merged with the
# turn's opening before them (where the marks are not special tokens of the vocabulary).
BREAK = "\x01"
# A function the template is asked to write, to see whether it writes functions at all.
PROBE: Tool = {"type": "function", "name": "lmsp_probe_function", "description": None,
               "parameters": {"type": "object", "properties": {}}, "strict": False}


class Refused(Exception):
    """The template refused the conversation, or failed on it; str() says so to a person."""


class _Generation(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}` tag, passed through (as llama-cpp-python does)."""
    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(form: str) -> str:
    return datetime.now().strftime(form)


def _raise_exception(message: str) -> None:
    raise Refused(f"This model's chat template refuses this conversation: {message}")


class ChatTemplate:
    def __init__(self, text: str, bos_token: str = "", eos_token: str = "") -> None:
        """`bos_token`, `eos_token`: the texts of the model's own tokens (the check made when a
        request is accepted has none: what a template refuses never depends on them)."""
        self.text, self.bos_token, self.eos_token = text, bos_token, eos_token
        environment = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[_Generation, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        self.compiled: jinja2.Template | None = None
        self.broken = ""  # why it did not compile: then it refuses every conversation
        try:
            self.compiled = environment.from_string(text)
        except jinja2.TemplateError as exc:
            self.broken = f"This model's chat template cannot be read: {exc}"

    @functools.cached_property
    def form(self) -> Form | None:
        """The form in which the template writes the functions a request offers itself and teaches
        the model to call them (app/engine/call_forms.py: Qwen's and Hermes' templates, Llama
        3.1-3.3's, Mistral's); None where it writes none: the system message describes them
        (`Request.prompt`)."""
        form = call_forms.family(self.text)
        if form is None:
            return None
        try:
            return form if PROBE["name"] in self.render([{"role": "user", "content": ""}], chat_tools([PROBE])) \
                else None
        except Refused:
            return None

    def prompt(self, request: Request) -> tuple[str, list[ChatMessage]]:
        """The prompt of `request`, and the messages whose texts are its SLOTs. The functions
        offered are the template's to write in its own form, the one the request was accepted
        for (`Request.tool_form`); earlier calls are shown in that form too."""
        form = self.form
        native = request.offer is not None and form is not None and form.name == request.tool_form
        messages = request.prompt(native)
        leads: dict[int, str] = {}
        if form is not None and form is not call_forms.HERMES:  # earlier calls are kept in Hermes' form
            messages = list(messages)
            for i, message in enumerate(messages):
                found = call_forms.recalled(message["content"]) if message["role"] == "assistant" else None
                if found is not None:
                    leads[i], text = form.said(*found)
                    messages[i] = {"role": "assistant", "content": text}
        tools = chat_tools(request.tools) if native else None
        return self.render(messages, tools, request.effort, leads), messages

    def reasoning(self, prompt: str) -> str:
        """How an answer to `prompt` holds the model's reasoning (`Request.reasoning`): a template
        that knows THINK and THOUGHT has the model reason between them, or opens the reasoning
        itself, at the end of the prompt (DeepSeek-R1's)."""
        if THINK not in self.text or THOUGHT not in self.text:
            return ""
        return "open" if prompt.rstrip().endswith(THINK) else "marked"

    def render(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None, effort: str = "",
               leads: dict[int, str] | None = None) -> str:
        """The prompt, each message's text as its SLOT, after its `leads` (template text: the
        marks of an earlier call). Refused if the template refuses it. `effort`
        (`Request.effort`) reaches the variables thinking templates read: Qwen3's
        `enable_thinking`, GPT-OSS's `reasoning_effort`."""
        leads = leads or {}
        if self.compiled is None:
            raise Refused(self.broken)
        thinking = {} if not effort else {"enable_thinking": effort != "none", "reasoning_effort": effort}
        try:
            return self.compiled.render(
                messages=[{"role": m["role"], "content": (BREAK + leads[i] if i in leads else "") + SLOT.format(i)}
                          for i, m in enumerate(messages)],
                eos_token=self.eos_token, bos_token=self.bos_token, raise_exception=_raise_exception,
                add_generation_prompt=True, functions=None, function_call=None, tools=tools, tool_choice=None,
                strftime_now=_strftime_now, **thinking)
        except Refused:
            raise
        except Exception as exc:  # whatever else a template does wrong (a sandbox refusal, a bad type)
            raise Refused(f"This model's chat template failed on this conversation: {type(exc).__name__}: {exc}") \
                from exc


@functools.lru_cache(maxsize=16)
def compiled(text: str) -> ChatTemplate:
    """The template compiled once for the checks (a model's text is the same for every request)."""
    return ChatTemplate(text)
