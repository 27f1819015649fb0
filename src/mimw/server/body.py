"""Request bodies as hostile input: size limits, JSON decoding, Unicode validity - every failure a 4xx.

``read_json(request, max_bytes, max_values)`` reads and decodes a body, answering
  * 413 when the body is larger than ``max_bytes`` (by Content-Length before reading, by count while reading), or
    holds more than ``max_values`` commas (a long array of numbers takes the GIL for long to decode);
  * 400 when it is not JSON, nests deeper than ``MAX_DEPTH``, holds a number Python will not convert (over 4300
    digits), or holds a string that is not valid Unicode (a lone surrogate escape such as ``"\\ud800"``, which JSON
    allows and UTF-8 cannot encode: tokenizers and response encoders would fail on it later);
  * ``ClientGone`` when the client disconnects before the body is complete (a client fault: the caller records it,
    logs nothing as an error, and answers nothing).

``prompt_bytes(texts)`` is the UTF-8 size that the server compares with its prompt byte limit before tokenizing.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterable

from starlette.requests import ClientDisconnect, Request

from .protocol import APIError, bad_request

MAX_DEPTH = 64  # JSON nesting; OpenAI bodies (tool schemas included) stay far below it
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a surrogate written as an escape (paired or lone)


class ClientGone(Exception):
    """The client closed the connection before sending its whole request body."""


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes", code="body_too_large")


async def read_json(request: Request, max_bytes: int, max_values: int | None = None) -> Any:
    """The decoded body; ``max_values`` bounds its count of commas (JSON values, those inside strings counted
    too): decoding a long array of numbers holds the GIL, so every stream would wait for it."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise too_large(max_bytes)
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    raw = b"".join(chunks)
    if max_values is not None and raw.count(b",") > max_values:
        raise APIError(413, f"the request body holds more than {max_values} JSON values; send fewer or shorter "
                            "prompts", code="body_too_large")
    return decode_json(raw)


def decode_json(raw: bytes) -> Any:
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # an integer longer than Python's conversion limit
        raise bad_request("the request body holds an integer with more than 4300 digits") from None
    check_json(obj, scan_strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return obj


def check_json(obj: Any, scan_strings: bool = True) -> None:
    """Depth at most ``MAX_DEPTH``; with ``scan_strings``, every string and key valid Unicode (the raw body had a
    surrogate escape, so a lone one may be there). Iterative: no recursion on hostile nesting."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, "body")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_DEPTH:
                raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels")
            for k, v in node.items():
                if scan_strings:
                    _check_text(k, f"{path} key")
                if isinstance(v, (dict, list)) or (scan_strings and isinstance(v, str)):
                    stack.append((v, depth + 1, f"{path}.{k}" if path != "body" else k))
        elif isinstance(node, list):
            if depth > MAX_DEPTH:
                raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels")
            kinds = set(map(type, node))  # one pass in C: a long list of numbers needs no Python loop
            if not kinds & {dict, list} and not (scan_strings and str in kinds):
                continue
            for i, v in enumerate(node):
                if isinstance(v, (dict, list)) or (scan_strings and isinstance(v, str)):
                    stack.append((v, depth + 1, f"{path}[{i}]"))
        elif isinstance(node, str):
            _check_text(node, path)


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{where}: not valid Unicode (a lone surrogate U+{ord(s[e.start]):04X} at character "
                          f"{e.start}); send UTF-8 text", where.split(".")[0].split("[")[0]) from None


def prompt_bytes(texts: Iterable[str]) -> int:
    """UTF-8 bytes of the prompt texts (valid Unicode: ``read_json`` checked it)."""
    return sum(len(t.encode("utf-8")) for t in texts)
