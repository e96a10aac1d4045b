"""Whether a model can always finish a grammar it has started (GBNF, as llama.cpp reads it).

llama.cpp's parser checks a grammar's syntax, not that text exists to match it. A `pattern`
such as `^[\\x00]$` or `^[^\\x00-\\U0010FFFF]$` converts to a rule no token can match (llama.cpp
never matches NUL: it reads a token's text as a C string), and a model that reaches it has no
token left: llama.cpp aborts the process. So every element of every rule must match some text,
since any of them can be entered: an optional one too, a model may start it. `[]` and `[^]`
are refused too: llama.cpp reads them as the empty text, a JSON schema's regex as no character
and as any character.

`dead_end` reads a grammar as llama.cpp's parser does, and fails where that one would (an escape
it does not know, such as `\\s`): app/engine/constraints/grammar.py refuses the schema then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_CHAR = 0x10FFFF
ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
NAME = re.compile(r"[A-Za-z0-9_-]+")
QUANTIFIER = re.compile(r"\*|\+|\?|\{\s*(\d+)\s*(?:,\s*\d*\s*)?\}")
SPACE = re.compile(r"(?:[ \t]|#[^\r\n]*)*")  # llama.cpp's parse_space: newlines end a rule...
SPACE_OR_LINE = re.compile(r"(?:[ \t\r\n]|#[^\r\n]*)*")  # ...but not inside ( ), nor after a |


@dataclass
class Element:
    matches: bool | str | list[list[Element]]  # literal or class: whether it can match; a rule name; a group
    optional: bool = False


@dataclass
class Grammar:
    rules: dict[str, list[list[Element]]] = field(default_factory=dict)
    empty_class: bool = False


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip(self, newlines: bool = False) -> None:
        self.pos = (SPACE_OR_LINE if newlines else SPACE).match(self.text, self.pos).end()  # type: ignore[union-attr]

    def char(self) -> int:
        c = self.text[self.pos]
        self.pos += 1
        if c != "\\":
            return ord(c)
        esc = self.text[self.pos]
        self.pos += 1
        if esc in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[esc]
            self.pos += width
            return int(self.text[self.pos - width:self.pos], 16)
        return ESCAPES[esc]


def _class(reader: _Reader, grammar: Grammar) -> bool:
    """Whether a `[...]` (its `[` read) matches a character other than NUL."""
    negated = reader.text.startswith("^", reader.pos)
    reader.pos += negated
    ranges = []
    while reader.text[reader.pos] != "]":
        low = high = reader.char()
        if reader.text[reader.pos] == "-" and reader.text[reader.pos + 1] != "]":
            reader.pos += 1
            high = reader.char()
        ranges.append((low, high))
    reader.pos += 1
    grammar.empty_class |= not ranges
    if not negated:
        return any(high >= 1 and high >= low for low, high in ranges)
    covered = 1  # the first character not yet known to be excluded
    for low, high in sorted(ranges):
        if low > covered:
            break
        covered = max(covered, high + 1)
    return covered <= MAX_CHAR


def _alternatives(reader: _Reader, grammar: Grammar, nested: bool) -> list[list[Element]]:
    alternatives: list[list[Element]] = [[]]
    while reader.pos < len(reader.text):
        reader.skip(newlines=nested)
        c = reader.text[reader.pos] if reader.pos < len(reader.text) else "\n"
        if c == "|":
            reader.pos += 1
            reader.skip(newlines=True)
            alternatives.append([])
            continue
        if c in ")\n":
            break
        reader.pos += 1
        element: Element
        if c == '"':
            chars = []
            while reader.text[reader.pos] != '"':
                chars.append(reader.char())
            reader.pos += 1
            element = Element(0 not in chars)
        elif c == "[":
            element = Element(_class(reader, grammar))
        elif c == ".":
            element = Element(True)
        elif c == "(":
            element = Element(_alternatives(reader, grammar, nested=True))
            reader.pos += 1  # the ")"
        else:
            name = NAME.match(reader.text, reader.pos - 1)
            assert name is not None, reader.text[reader.pos - 1:reader.pos + 20]
            reader.pos = name.end()
            element = Element(name[0])
        reader.skip()
        quantifier = QUANTIFIER.match(reader.text, reader.pos)
        if quantifier:
            reader.pos = quantifier.end()
            element.optional = quantifier[0] in "*?" or quantifier[1] == "0"
        alternatives[-1].append(element)
    return alternatives


def parse(text: str) -> Grammar:
    grammar, reader = Grammar(), _Reader(text)
    while True:
        reader.skip(newlines=True)
        name = NAME.match(text, reader.pos)
        if name is None:
            return grammar
        reader.pos = text.index("::=", name.end()) + 3
        reader.skip(newlines=True)
        grammar.rules[name[0]] = _alternatives(reader, grammar, nested=False)


def _can_match(element: Element, done: set[str], every: bool) -> bool:
    """Whether `element` matches some text, given the rules in `done` that do. With `every`,
    only if each of its alternatives does, and each of their elements (optional ones too)."""
    if isinstance(element.matches, bool):
        return element.matches
    if isinstance(element.matches, str):
        return element.matches in done
    test = all if every else any
    return test(all(_can_match(e, done, every) or (e.optional and not every) for e in seq)
                for seq in element.matches)


def dead_end(text: str) -> str | None:
    """Why a model could start text this grammar allows and be unable to finish it, or None."""
    grammar = parse(text)
    if grammar.empty_class:
        return "it has an empty character class (`[]` or `[^]`), which llama.cpp reads otherwise"
    done: set[str] = set()  # the rules that match some text
    while new := {name for name, alts in grammar.rules.items()
                  if name not in done and _can_match(Element(alts), done, every=False)}:
        done |= new
    stuck = [name for name, alts in grammar.rules.items() if not _can_match(Element(alts), done, every=True)]
    if stuck:  # name one stuck for its own sake, not only for naming another
        name = next((n for n in stuck if not _can_match(Element(grammar.rules[n]), set(grammar.rules), True)), stuck[0])
        return f"its grammar rule `{name}` has a part no text can match (a `pattern` that matches nothing?)"
    return None
