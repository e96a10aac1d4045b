"""Ollama's `template` override of `/api/generate`: a Go text/template over `.System` and `.Prompt`,
rendered into the prompt the model reads as it is (as a `raw` one).

The part of Go's template language that generate templates use: `{{ .System }}`, `{{ .Prompt }}`,
`{{ if .X }}...{{ else }}...{{ end }}` (true when the value is not empty), the `{{-` and `-}}`
that trim the whitespace beside an action, and `{{ .Response }}`, where the model's answer goes:
the prompt ends there, as Ollama cuts it. Anything else (`range .Messages`, functions, pipelines)
is refused by name rather than rendered wrong. Written here: no Python library renders Go templates.
"""

from __future__ import annotations

import re

from app.errors import InvalidRequest

ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
FIELDS = ("System", "Prompt", "Response")


def _refused(what: str) -> InvalidRequest:
    return InvalidRequest(f"This `template` uses {what}, which is not supported here: only .System, .Prompt, "
                          ".Response and if/else/end over them.", param="template")


def render(template: str, system: str, prompt: str) -> str:
    """The prompt `template` makes of `system` and `prompt`, up to `.Response`."""
    values = {"System": system, "Prompt": prompt}
    out: list[str] = []
    shown = [True]  # one entry an `if` open, and the outermost: whether its text is written
    taken: list[bool] = []  # for each open `if`: whether its condition held
    at, trim = 0, False
    for action in ACTION.finditer(template):
        text = template[at:action.start()]
        text = text.lstrip() if trim else text
        text = text.rstrip() if action[1] else text
        if all(shown):
            out.append(text)
        at, trim = action.end(), bool(action[3])
        words = action[2].split()
        if words[:1] == ["if"] and len(words) == 2:
            held = bool(_value(words[1], values))
            taken.append(held)
            shown.append(held)
        elif words == ["else"] and taken:
            shown[-1] = not taken[-1]
        elif words == ["end"] and taken:
            taken.pop()
            shown.pop()
        elif words == [".Response"]:  # the answer's place: the prompt ends here
            if taken:
                raise _refused("`.Response` inside an `if`")
            return "".join(out)
        elif len(words) == 1:
            if all(shown):
                out.append(_value(words[0], values))
        else:
            raise _refused(f"`{{{{ {action[2]} }}}}`")
    if taken:
        raise InvalidRequest("This `template` has an `if` without its `end`.", param="template")
    tail = template[at:]
    out.append(tail.lstrip() if trim else tail)
    return "".join(out)


def _value(name: str, values: dict[str, str]) -> str:
    if not name.startswith(".") or name[1:] not in FIELDS:
        raise _refused(f"`{name}`")
    return values.get(name[1:], "")
