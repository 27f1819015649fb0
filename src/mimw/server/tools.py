"""Tool calling: the tools in the prompt, the model's tool calls out of its text, and forced calls.

Formats (chosen from the chat template's source, i.e. what the model was trained on):
  * ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after optional text
    (Qwen2.5 / Qwen3 templates, and the prompt mimw writes itself for templates that know no tools, e.g.
    SmolLM2's: a system message listing the tools in ``<tools>`` and asking for that block);
  * ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` objects separated by ``;``
    (Llama 3.1-3.3 templates; the ``<|python_tag|>`` marker is a special token, gone from the decoded text).

tool_choice: ``auto`` parses calls out of free text; ``none`` hands no tools to the template and parses nothing;
``required`` and a named function force the output with a grammar (a JSON array of {"name", "parameters"}, or
the named function's arguments object), whatever the model's format, as vLLM does.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def tool_format(chat_template: str) -> str:
    """``hermes`` or ``llama3_json``: the format the template's model writes calls in (hermes when the
    template shows none, since mimw then writes the hermes prompt itself)."""
    if HERMES_OPEN in chat_template:
        return "hermes"
    if "tools" in chat_template and ("<|python_tag|>" in chat_template or '"parameters"' in chat_template):
        return "llama3_json"
    return "hermes"


def template_knows_tools(chat_template: str) -> bool:
    return "tools" in chat_template


def hermes_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions. The available functions, described as JSON schemas, are:\n<tools>\n"
            f"{listing}\n</tools>\nTo call one, reply with a JSON object inside <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')


def template_messages(messages: Sequence[Any], tools: Sequence[dict[str, Any]] | None,
                      chat_template: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the chat template, tools for the template). ``messages`` are ``protocol.ChatMessage``.

    Assistant tool calls reach the template with their arguments parsed (templates serialise them); for a
    template without tool support, mimw writes the hermes system prompt and renders calls and results as text."""
    native = template_knows_tools(chat_template)
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _loads_or_keep(c.function.arguments)}}
                     for c in m.tool_calls]
            if native:
                d["tool_calls"] = calls
            else:
                d["content"] = (d["content"] + "\n" if d["content"] else "") + "\n".join(
                    f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                      "arguments": c["function"]["arguments"]}) + f"\n{HERMES_CLOSE}"
                    for c in calls)
        if m.role == "tool":
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if not native:
                d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
        out.append(d)
    if not tools or native:
        return out, list(tools) if tools else None
    prompt = hermes_system_prompt(tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _loads_or_keep(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return s


# --- parsing ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def call_dict(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's tool_calls entry (with ``index`` in stream deltas)."""
    d: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


def _call_from(obj: Any, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        args = _loads_or_keep(args)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], re.S):
        try:
            call = _call_from(json.loads(block.strip()), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []  # not a well-formed call: the reply stays text
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ParsedCall]]:
    s = text.strip()
    if not s.startswith("{"):
        return text, []
    dec = json.JSONDecoder()
    calls, i = [], 0
    while i < len(s):
        try:
            obj, i = dec.raw_decode(s, i)
        except ValueError:
            return text, []
        call = _call_from(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        while i < len(s) and s[i] in " \t\r\n;":
            i += 1
    return None, calls


class ToolCallParser:
    """One choice's output under ``tool_choice`` (auto, required or a named function): ``feed`` the text as it
    comes and send what it returns as content; ``finish`` gives the rest of the content and the calls."""

    def __init__(self, fmt: str, choice: str | None, parallel: bool = True):
        """choice: "auto", "required", or the name of the forced function."""
        self.fmt, self.choice, self.parallel = fmt, choice, parallel
        self.forced = choice not in ("auto", None)
        self.buf = ""  # text held back: a possible call
        self.streamed = ""
        self.holding = self.forced

    def feed(self, text: str) -> str:
        if self.holding:
            self.buf += text
            return ""
        text = self.buf + text
        self.buf = ""
        if self.fmt == "llama3_json":
            if not (self.streamed + text).strip():
                self.buf = text  # leading whitespace: wait for the first character
                return ""
            if not self.streamed.strip() and text.lstrip().startswith("{"):
                self.holding, self.buf = True, text
                return ""
            self.streamed += text
            return text
        at = text.find(HERMES_OPEN)
        if at >= 0:
            self.holding, self.buf = True, text[at:]
            self.streamed += text[:at]
            return text[:at]
        keep = _partial_suffix(text, HERMES_OPEN)
        out = text[:len(text) - keep]
        self.buf = text[len(text) - keep:]
        self.streamed += out
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content not yet sent, calls). Text that does not parse as calls is content."""
        rest = self.buf
        self.buf = ""
        if self.forced:
            calls = self._forced(rest)
            return ("", calls) if calls is not None else (rest, [])
        if not self.holding:
            return rest, []
        content, calls = (parse_llama3_json if self.fmt == "llama3_json" else parse_hermes)(rest)
        if not calls:
            return rest, []
        extra = (content or "") if self.fmt == "hermes" else ""
        return extra, calls if self.parallel else calls[:1]

    def _forced(self, text: str) -> list[ParsedCall] | None:
        try:
            obj = json.loads(text)
        except ValueError:
            return None  # cut short (max_tokens): the client gets the text and finish_reason "length"
        if self.choice == "required":
            if not isinstance(obj, list):
                return None
            calls = [_call_from(o, "parameters") for o in obj]
            return [c for c in calls if c is not None] or None
        return [ParsedCall(self.choice, json.dumps(obj, ensure_ascii=False))]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def forced_schema(tools: Sequence[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    """The JSON schema a forced choice's output must match: the named function's arguments, or for
    ``required`` an array of {"name", "parameters"} calls (one at most without parallel calls)."""
    by_name = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice != "required":
        return by_name[choice]
    items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in by_name.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
