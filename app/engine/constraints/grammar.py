"""JSON constraints as llama.cpp grammars (GBNF), from llama-cpp-python's own converter.

A constraint is `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
"schema": {...}, "gbnf": "..."}`. The server converts a schema with `convert` before it accepts
a request, in a worker process with a time budget (app/engine/constraints/grammar_worker.py), and stores
the grammar in the constraint: the engine (`gbnf`) does not convert it again.

llama-cpp-python's `json_schema_to_gbnf` raises on some schemas but silently ignores many
keywords (`minimum`, `multipleOf`, `uniqueItems`, unknown `format`s, `not`, ...), and in most
places a keyword is honoured only on the path its converter takes (`enum` wins over
`maxLength`, `$ref` over anything beside it). Output that ignores such a keyword could break
the schema, so `unsupported` accepts a keyword only where the converter honours it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from functools import cache
from types import ModuleType
from typing import Any

from app import paths
from app.engine.constraints.gbnf import dead_end
from app.engine.request import Constraint

JSON_OBJECT = {"type": "json_object"}
# Keywords that never change which documents are valid.
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions"}
PRIMITIVES = {"string", "number", "integer", "boolean", "null"}
FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
# The converter's string character allows raw control characters, which JSON forbids inside a
# string (json.loads and pydantic reject them): this is the character rule of llama.cpp's JSON grammar.
CHAR_RULE = 'char ::= [^"\\\\]'
JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F]'
# The converter writes a count out as that many copies of a rule: larger counts would make a
# grammar of megabytes, built while the request is read.
MAX_COUNT = 1000
COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")
# The converter's cost grows with the square of an object's properties (their cube when they
# are optional), and llama.cpp's cost per token with the enum values and branches open at once.
MAX_PROPERTIES = 1000  # across the schema
# Enum values and anyOf/oneOf branches across the schema: a country list fits. Under greedy decoding
# of SmolLM2 with 2 cores busy, 100 values cost 0.1 s a token, 250 0.17 s, 1,000 0.35-0.64 s.
MAX_CHOICES = 256
MAX_GRAMMAR = 100_000  # characters of grammar
Converted = tuple[str | None, str]  # (why the grammar cannot enforce a schema, "") or (None, its grammar)


@cache
def _converter() -> ModuleType:
    """llama-cpp-python's `llama_grammar` module (standard library only), from the source release
    the llama.cpp build is pinned to: `make` puts it beside llama-server (paths.llama_server)."""
    server = paths.llama_server()
    # Beside the program itself: the venv's llama-server is a link to the build `make` keeps.
    source = server.resolve().parent / "llama_grammar.py" if server else None
    if source is None or not source.is_file():
        raise RuntimeError("the JSON schema converter (llama_grammar.py beside llama-server) is not installed")
    spec = importlib.util.spec_from_file_location("lmsp_llama_grammar", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gbnf(constraint: Constraint) -> str:
    """The grammar text for a constraint: the one converted when the request was accepted."""
    module = _converter()
    if constraint["type"] == "json_object":
        return str(module.JSON_GBNF)
    if "gbnf" in constraint:
        return str(constraint["gbnf"])
    text = module.json_schema_to_gbnf(json.dumps(constraint["schema"]))
    return "\n".join(line.replace(CHAR_RULE, JSON_CHAR, 1) if line.startswith(CHAR_RULE) else line
                     for line in text.split("\n"))


def convert_all(schemas: list[Any]) -> list[Converted]:
    """Each schema's `convert`, up to the first refusal (which refuses the request)."""
    results = []
    for schema in schemas:
        results.append(convert(schema))
        if results[-1][0] is not None:
            break
    return results


def convert(schema: Any) -> Converted:
    """(why the grammar cannot enforce `schema`, "") or (None, its grammar). Run it in the
    grammar worker, whose budget bounds what the limits here do not."""
    try:
        reason = too_large(schema) or _check(schema, "#")
    except (TypeError, AttributeError, RecursionError):  # e.g. a list where a schema object belongs
        return "it is not a well-formed JSON schema", ""
    if reason is not None:
        return reason, ""
    try:
        text = gbnf({"type": "json_schema", "schema": schema})
    except Exception as exc:  # a third-party converter on any input: whatever it raises is a refusal
        return f"the grammar converter rejects it ({exc or type(exc).__name__})", ""
    if len(text) > MAX_GRAMMAR:
        return f"its grammar has {len(text)} characters, more than {MAX_GRAMMAR}", ""
    try:
        reason = dead_end(text)
    except (AssertionError, IndexError, KeyError, ValueError):  # grammar syntax the converter does not write
        reason = "its grammar could not be checked"
    return (reason, "") if reason else (None, text)


def too_large(schema: Any) -> str | None:
    """Why `schema` holds more properties or choices than the limits, or None: one linear walk,
    in Python (a thread doing it leaves the event loop its turns, as a C call does not)."""
    properties = choices = 0
    nodes = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            for key in ("enum", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    choices += len(node[key])
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
    if properties > MAX_PROPERTIES:
        return f"it has {properties} properties, more than {MAX_PROPERTIES}"
    if choices > MAX_CHOICES:
        return f"it has {choices} enum values and anyOf/oneOf branches, more than {MAX_CHOICES}"
    return None


def _extra(node: dict[str, Any], allowed: set[str], where: str) -> str | None:
    extra = sorted(set(node) - allowed - ANNOTATIONS)
    return f"`{extra[0]}` at {where} is not supported here" if extra else None


def _check_any(node: Any, where: str) -> str | None:
    """What every node is held to, whatever branch it takes: a schema object, its definitions
    checked too, its counts and its pattern's repetitions within MAX_COUNT."""
    if not isinstance(node, dict):
        return f"{where} must be a schema object"
    for name in ("$defs", "definitions"):
        for key, sub in (node.get(name) or {}).items():
            if reason := _check(sub, f"{where}/{name}/{key}"):
                return reason
    for count in COUNTS:
        if count in node and not (isinstance(node[count], int) and 0 <= node[count] <= MAX_COUNT):
            return f"`{count}` at {where} must be an integer from 0 to {MAX_COUNT}"
    if isinstance(node.get("pattern"), str) and any(int(n or 0) > MAX_COUNT for q in QUANTIFIER.findall(node["pattern"])
                                                    for n in q):
        return f"a repetition count in the `pattern` at {where} is above {MAX_COUNT}"
    return None


def _check_object(node: dict[str, Any], where: str) -> str | None:
    props = node.get("properties", {})
    required = node.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        return f"`properties` must be an object and `required` a list, at {where}"
    if missing := [r for r in required if r not in props]:
        return f"`required` names {missing[0]!r}, which is not in `properties`, at {where}"
    extra = node.get("additionalProperties", True)
    if isinstance(extra, dict) and (reason := _check(extra, f"{where}/additionalProperties")):
        return reason
    return _extra(node, {"type", "properties", "required", "additionalProperties"}, where) or next(
        (r for key, sub in props.items() if (r := _check(sub, f"{where}/properties/{key}"))), None)


def _check(node: Any, where: str) -> str | None:
    """Mirror of SchemaConverter.visit: the branch it takes, and the keywords that branch honours."""
    if reason := _check_any(node, where):
        return reason
    kind = node.get("type")
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return f"only local `$ref`s (#/...) are supported, at {where}"
        return _extra(node, {"$ref"}, where)
    for union in ("anyOf", "oneOf"):
        if union in node:
            if not isinstance(node[union], list) or not node[union]:
                return f"`{union}` at {where} must be a non-empty list"
            return _extra(node, {union, "type"}, where) or next(
                (r for i, sub in enumerate(node[union]) if (r := _check(sub, f"{where}/{union}/{i}"))), None)
    if isinstance(kind, list):
        if not all(k in PRIMITIVES | {"object", "array"} for k in kind):
            return f"unknown type in {kind} at {where}"
        return _extra(node, {"type"}, where)
    if "const" in node or "enum" in node:
        return _extra(node, {"const", "enum", "type"}, where)
    if kind in (None, "object") and ("properties" in node or node.get("additionalProperties", True) is not True):
        return _check_object(node, where)
    if kind in (None, "array") and ("items" in node or "prefixItems" in node):
        items = node.get("items") or node["prefixItems"]
        if isinstance(items, list):
            return _extra(node, {"type", "items", "prefixItems"}, where) or next(
                (r for i, sub in enumerate(items) if (r := _check(sub, f"{where}/items/{i}"))), None)
        if "prefixItems" in node:
            return f"`prefixItems` with `items` at {where} is not supported"
        return _extra(node, {"type", "items", "minItems", "maxItems"}, where) or _check(items, f"{where}/items")
    if kind in (None, "string") and "pattern" in node:
        return _extra(node, {"type", "pattern"}, where)
    if kind in (None, "string") and "format" in node:
        if node["format"] not in FORMATS:
            return f"format {node['format']!r} at {where} is not supported (only {sorted(FORMATS)})"
        return _extra(node, {"type", "format"}, where)
    if kind == "string":
        return _extra(node, {"type", "minLength", "maxLength"}, where)
    if kind == "object" or not node:
        return _extra(node, {"type", "additionalProperties"}, where)
    if kind in PRIMITIVES | {"array"}:  # any array: the converter's generic one
        return _extra(node, {"type"}, where)
    return f"the schema at {where} has no type the grammar knows"
