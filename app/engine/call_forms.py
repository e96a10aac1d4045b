"""How a model writes a call to a function it is offered (`tool_choice` auto): one `Form` per
family of chat templates, each with its signs in a template's text, what opens an answer that is
a call, the lazy grammar that binds the call from there (app/engine/parent/prompt.py), how the
call is read back from the text (app/tasks/calls.py) and how an earlier call is shown to the model.

- Hermes' (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  also the form described to a model whose template writes no functions (`Request.prompt`).
- Llama 3.1 to 3.3's (Meta's templates: `Environment: ipython`, the functions in the first user
  message): `{"name": ..., "parameters": {...}}`, perhaps after `<|python_tag|>`.
- Mistral's: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (Mistral-Nemo's template, v3's),
  or `[TOOL_CALLS]name[ARGS]{...}` where the template writes `[ARGS]` (Mistral-Small 3.2,
  Devstral, Ministral 3).

The template's form is read when a request is accepted and stored with it (`Request.tool_form`),
so its output reads the same after a restart. One call an answer: the grammar ends it there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.engine.constraints import grammar
from app.engine.request import END, MARK, THOUGHT, Constraint, Request

NAMED = r'"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'  # a call's name, as JSON, up to its arguments' key
# The call object's own argument rules, as the schema converter names them (by the property's
# path) in the grammar of app/core/structured.py `call_schema`: one function, or alternatives.
ARGUMENT_KEY = re.compile(r'^((?:alternative-[0-9]+-)?arguments-kv ::= )"\\"arguments\\""', re.MULTILINE)


@dataclass(frozen=True)
class Form:
    name: str  # as `Request.tool_form` stores it ("": Hermes', the default)
    signs: tuple[str, ...]  # texts each template of the family holds
    opening: tuple[tuple[str, bool], ...]  # what opens a call: texts, each (optional?), whitespace between
    head: re.Pattern[str]  # a call up to its arguments; group 1 the function's name
    trigger: str  # a regex of what opens a call, its group where the grammar starts binding
    before: str  # the grammar before the call object
    after: str = ""  # and after it
    end: str = ""  # a mark after the call: the text is the call's up to it
    closers: str = "}"  # what closes the call after its arguments, in the order written
    key: str = "arguments"  # the arguments' key in the call object
    preserved: tuple[str, ...] = ()  # marks that are single tokens in the family's vocabularies
    lead: str = ""  # the marks before an earlier call's text, written by the template
    shown: str = "{}"  # an earlier call's text, {} its object

    def opens(self, text: str) -> bool | None:
        """Whether an answer is a call (it opens as one), not one (it cannot), or None while it
        may still be either."""
        rest = text
        for part, optional in self.opening:
            rest = rest.lstrip()
            if rest.startswith(part):
                rest = rest[len(part):]
            elif not rest or part.startswith(rest):
                return None
            elif not optional:
                return False
        return True

    def named(self, text: str) -> tuple[str, int] | None:
        """The function's name and where its arguments start, once the model has written them."""
        match = self.head.match(text)
        return (json.loads(match[1]), match.end()) if match else None

    def arguments(self, text: str, start: int) -> str:
        """The arguments as far as they can be told apart from what closes the call (`closers`,
        `end`): a trailing closer, or the start of `end`, is held back while it may be that."""
        rest = text[start:]
        if self.end:
            cut = rest.find(self.end)
            rest = rest[:cut] if cut >= 0 else rest[:len(rest) - held(rest, self.end)]
        rest = rest.rstrip()
        for closer in reversed(self.closers):
            if rest.endswith(closer):
                rest = rest[:-1].rstrip()
        return rest

    def grammar(self, offer: Constraint) -> str:
        """The grammar of a call the model is offered, from what opens it (the trigger's group) to
        its end, with nothing after it (llama.cpp allows only the end of the answer then)."""
        rules = _call_rules(offer)
        if self.key != "arguments":
            rules = ARGUMENT_KEY.sub(rf'\1"\\"{self.key}\\""', rules)
        return f"root ::= {self.before} call-object {self.after}\n{rules}"

    def triggers(self, reasoning: bool) -> list[str]:
        """Where a call opens: the answer's start, or after a thinking model's reasoning (each a
        search that stays linear: llama.cpp runs it over the whole output at every token)."""
        return [rf"^\s*({self.trigger})", *([rf"{re.escape(THOUGHT)}\s*({self.trigger})"] if reasoning else [])]

    def said(self, name: str, arguments: str) -> tuple[str, str]:
        """An earlier call as the model writes it: the marks before it, written by the template
        (so the model's own tokens), and the call's text (plain text: it is the client's)."""
        return self.lead, self.shown.format(f'{{"name": {json.dumps(name)}, "{self.key}": {arguments}}}')


class _Bare(Form):
    """Mistral's later form: the function's name bare, then its arguments' JSON object."""

    def named(self, text: str) -> tuple[str, int] | None:
        match = self.head.match(text)
        return (match[1], match.end()) if match else None

    def grammar(self, offer: Constraint) -> str:
        rules = _call_rules(offer)
        schema: dict[str, Any] = offer.get("schema", {})
        names = [c["properties"]["name"]["const"] for c in schema.get("anyOf", [schema])]
        # Each function's arguments, as the converter names their rule; names are letters,
        # digits, _ and - (app/core/structured.py NAME): safe in a grammar's literal.
        each = [f'"{n}" "[ARGS]" {"arguments" if len(names) == 1 else f"alternative-{i}-arguments"}'
                for i, n in enumerate(names)]
        return f'root ::= {self.before} ({" | ".join(each)})\n{rules}'

    def said(self, name: str, arguments: str) -> tuple[str, str]:
        return f"{self.lead}{name}[ARGS]", arguments  # the name is safe as the template's text


def _call_rules(offer: Constraint) -> str:
    """The offer's grammar (one call object: app/core/structured.py `call_schema`), its root
    renamed `call-object` for a form's root to hold."""
    return re.sub(r"^root ::=", "call-object ::=", grammar.gbnf(offer), count=1, flags=re.MULTILINE)


WS = "[ \\t\\n]*"  # whitespace in a grammar
HERMES = Form(
    "", signs=(MARK,), opening=((MARK, False),),
    head=re.compile(rf'\s*(?:{re.escape(MARK)}\s*)?\{{\s*{NAMED}"arguments"\s*:\s*'), trigger=re.escape(MARK),
    before=f'{WS} "{MARK}" {WS}', after=f'{WS} "{END}"', end=END, preserved=(MARK, END), shown=f"{MARK}\n{{}}\n{END}")
LLAMA3 = Form(
    "llama3", signs=("<|start_header_id|>ipython<|end_header_id|>",),
    opening=(("<|python_tag|>", True), ("{", False), ('"name"', False)),
    head=re.compile(rf'\s*(?:<\|python_tag\|>\s*)?\{{\s*{NAMED}"parameters"\s*:\s*'),
    # `{ ?"name"`: as the call object's grammar starts (one space at most), or it could not read it
    trigger=r'(?:<\|python_tag\|>\s*)?\{ ?"name"', before=f'("<|python_tag|>" {WS})?', key="parameters",
    preserved=("<|python_tag|>",))
MISTRAL_ARGS = _Bare(
    "mistral-args", signs=("[TOOL_CALLS]", "[ARGS]"), opening=(("[TOOL_CALLS]", False),),
    head=re.compile(r"\s*\[TOOL_CALLS\]\s*([A-Za-z0-9_-]+)\[ARGS\]\s*"), trigger=r"\[TOOL_CALLS\]",
    before='"[TOOL_CALLS]"', closers="", preserved=("[TOOL_CALLS]", "[ARGS]"), lead="[TOOL_CALLS]")
MISTRAL = Form(
    "mistral", signs=("[TOOL_CALLS]",), opening=(("[TOOL_CALLS]", False),),
    head=re.compile(rf'\s*\[TOOL_CALLS\]\s*\[\s*\{{\s*{NAMED}"arguments"\s*:\s*'), trigger=r"\[TOOL_CALLS\]",
    before=f'"[TOOL_CALLS]" {WS} "[" {WS}', after=f'{WS} "]"', closers="}]", preserved=("[TOOL_CALLS]",),
    lead="[TOOL_CALLS]", shown="[{}]")
# Looked for in this order: a template of a later form holds the signs of the one after it.
FORMS = (HERMES, MISTRAL_ARGS, MISTRAL, LLAMA3)
BY_NAME = {form.name: form for form in FORMS}


def family(text: str) -> Form | None:
    """The form whose signs the template's text holds (whether it writes functions is the
    template's to show: app/engine/template.py `ChatTemplate.form`)."""
    return next((form for form in FORMS if all(sign in text for sign in form.signs)), None)


def of(request: Request) -> Form:
    """The form an answer to `request` is read in: a forced call's JSON object (which Hermes'
    head reads, the mark being optional) and a described offer's are Hermes'."""
    return HERMES if request.call else BY_NAME.get(request.tool_form, HERMES)


def recalled(text: str) -> tuple[str, str] | None:
    """An earlier call as app/core/structured.py `item_message` writes it (in Hermes' form):
    its function's name and arguments, or None if `text` is not one."""
    found = HERMES.named(text)
    if found is None or not text.rstrip().endswith(END):
        return None
    return found[0], HERMES.arguments(text, found[1])


def held(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)
