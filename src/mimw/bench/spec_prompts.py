"""Prompt sets of ``mimw bench spec``: an input-grounded set built from Python's standard library and open chat.

grounded  agent-like requests whose answer re-uses text given in the prompt: repeat, rename, annotate or extend a
          function taken from a standard-library module (the source files ship with every Python, so the set is
          the same on every machine running the same Python version). Functions of 8-40 lines, read with ``ast``.
chat      open-ended questions whose answers share little with the prompt.

Both are chat messages (the default model is an instruct model); the benchmark applies the chat template.
"""
from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass

# modules whose source is plain, self-contained Python (and present in every CPython)
_MODULES = ("textwrap", "bisect", "heapq", "shlex", "fnmatch", "colorsys", "glob", "string", "base64", "copy",
            "calendar", "statistics", "difflib", "json.encoder", "html", "ipaddress", "fractions", "gettext")

_TASKS = (
    "Repeat the following Python function exactly as it is, in a code block, with no changes:\n\n```python\n{code}```",
    "Rename the function `{name}` to `{name}_v2` in the code below and output the complete updated code in a code "
    "block:\n\n```python\n{code}```",
    "Add a short comment above every `return` statement of this function. Output the whole function:\n\n"
    "```python\n{code}```",
    "Add type hints to the parameters of this function and output the complete function:\n\n```python\n{code}```",
    "Here is a function from the Python standard library:\n\n```python\n{code}```\n\nRewrite it with a docstring "
    "that explains what it does, keeping the code the same.",
)

CHAT = (
    "What are some tips for staying productive when working from home?",
    "Explain how photosynthesis works in simple terms.",
    "Write a short story about a robot who learns to paint.",
    "What is the difference between a virus and a bacterium?",
    "Give me a recipe for a simple vegetable soup.",
    "Why is the sky blue?",
    "How do I start learning to play the guitar?",
    "Describe the water cycle for a ten-year-old.",
    "What are the benefits of regular exercise?",
    "Write a poem about the ocean at night.",
    "How does a credit card work?",
    "What should I pack for a weekend camping trip?",
    "Explain what a black hole is.",
    "Suggest a few names for a friendly neighbourhood bakery and explain each.",
    "How can I improve my sleep?",
    "What were the main causes of the French Revolution?",
)


# the warm-up pool (``--warm``): open chat of the same kinds as CHAT on other topics, answered before the measure so
# that the suffix drafter's global history holds a server's earlier outputs (SuffixDecoding builds its global tree
# from the outputs of earlier requests of the workload, not of the ones it is measured on)
_WARM_FORMS = ("Explain {} in simple terms.", "What are the benefits of {}?", "Give me some tips for {}.",
               "Write a short poem about {}.", "What is the history of {}?", "How do I get started with {}?",
               "What are common mistakes people make with {}?", "Write a short story about {}.")
_WARM_TOPICS = ("gardening", "chess", "saving money", "public speaking", "learning a new language", "volcanoes",
                "the moon landing", "meditation", "electric cars", "running a marathon", "the internet", "recycling",
                "birdwatching", "writing a resume", "coffee", "the Roman Empire", "dinosaurs", "rainbows",
                "photography", "yoga", "climate change", "the stock market", "knitting", "honeybees",
                "cloud computing", "first aid", "the printing press", "dogs as pets", "solar panels", "origami",
                "jazz music", "a lighthouse keeper", "a lost kitten", "the desert at dawn")


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    messages: tuple[dict, ...]


def _functions(min_lines: int = 8, max_lines: int = 40) -> list[tuple[str, str, str]]:
    """(module, function name, source) of top-level functions of the modules above, in a stable order."""
    out = []
    for mod_name in _MODULES:
        try:
            src = inspect.getsource(importlib.import_module(mod_name))
        except (ImportError, OSError, TypeError):
            continue
        lines = src.splitlines(keepends=True)
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines:
                    out.append((mod_name, node.name, "".join(lines[node.lineno - 1:node.end_lineno])))
    return out


def grounded_prompts(n: int) -> list[BenchPrompt]:
    """n prompts, one function per module in turn (round robin), tasks cycling."""
    by_module: dict[str, list[tuple[str, str, str]]] = {}
    for f in _functions():
        by_module.setdefault(f[0], []).append(f)
    picked = []
    while len(picked) < n and any(by_module.values()):
        for mod in list(by_module):
            if by_module[mod] and len(picked) < n:
                picked.append(by_module[mod].pop(0))
    out = []
    for j, (mod, name, code) in enumerate(picked):
        task = _TASKS[j % len(_TASKS)]
        out.append(BenchPrompt(f"{mod}.{name}#{j % len(_TASKS)}",
                               ({"role": "user", "content": task.format(code=code, name=name)},)))
    return out


def chat_prompts(n: int) -> list[BenchPrompt]:
    return [BenchPrompt(f"chat{i}", ({"role": "user", "content": q},)) for i, q in enumerate(CHAT[:n])]


def warm_prompts(n: int) -> list[BenchPrompt]:
    """n warm-up prompts (at most ``len(_WARM_FORMS) * len(_WARM_TOPICS)``), topic by topic, every form of a topic."""
    pool = [f.format(t) for t in _WARM_TOPICS for f in _WARM_FORMS]
    if not 0 <= n <= len(pool):
        raise ValueError(f"--warm must be in [0, {len(pool)}], got {n}")
    return [BenchPrompt(f"warm{i}", ({"role": "user", "content": q},)) for i, q in enumerate(pool[:n])]


SETS = {"grounded": grounded_prompts, "chat": chat_prompts}
