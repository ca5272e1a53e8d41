"""Bounds on a structured-output constraint, checked on its text before anything compiles it.

A grammar's cost is set by its shape more than its length: a chain of a few thousand rules, each
naming the next, overflows the compiler's stack; a list of 100,000 choices or tens of thousands of
rules keeps a compiler busy for minutes. ``check_spec`` measures what decides that cost with one
linear scan (bytes, rules, the depth of rule references and brackets, alternatives, choices, a JSON
schema's nesting) and refuses a constraint past a bound with a ``GrammarError`` that names it (the
server answers 400). ``parser_limits`` are llguidance's own bounds, set tighter than its defaults:
they stop what the scan cannot see (an ambiguous grammar whose Earley rows grow with the output, a
regex whose automaton explodes) inside the library, as an error of that matcher alone.
docs/serving.md (Limits) lists every bound and its default.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from infeng_common.errors import InfengError


class GrammarError(InfengError):
    """A constraint that does not compile (bad JSON schema, regex or grammar) or is over a bound."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class GrammarLimits:
    """What one constraint may be, and how long its compile may take."""

    max_bytes: int = 64 * 1024            # grammar text, regex, schema (as JSON) or all choices together
    max_rules: int = 1000                 # Lark/GBNF rule and terminal definitions
    max_depth: int = 64                   # chained rule references plus bracket nesting; schema nesting
    max_alternatives: int = 1024          # '|' branches of one rule
    max_choices: int = 1024               # strings of a ``choice`` constraint
    compile_seconds: float = 5.0          # one compile (in a worker process, killed past it)
    mask_seconds: float = 5.0             # one next-token mask, from when it was queued
    max_sequences: int = 16               # constrained sequences of one request (n x prompts)


#: llguidance's bounds (its defaults in brackets). Per mask step: at most STEP_MAX_ITEMS Earley items
#: (~20k/ms, so ~1 ms) [50,000] and STEP_LEXER_FUEL lexer work (~14k/ms, ~7 ms) [200,000]; per row of
#: the parse, MAX_ITEMS_IN_ROW items [2,000] (an ambiguous grammar's rows grow with the output: this
#: ends it after a few dozen tokens instead of letting each token cost more; consuming a token holds
#: the GIL, and for such a grammar it costs 0.13 ms on average and 0.7 ms at most at 200 items, 0.9
#: and 5-8 ms at 500, so every other stream waits that long per token; JSON schemas of 150
#: alternatives and nested expression grammars stay far below 200); at compile,
#: INITIAL_LEXER_FUEL regex work [1,000,000], MAX_LEXER_STATES automaton states (1-2 kB each)
#: [250,000] and MAX_GRAMMAR_SIZE symbols [500,000].
PARSER_LIMITS = {"max_items_in_row": 200, "step_max_items": 20_000, "step_lexer_fuel": 100_000,
                 "initial_lexer_fuel": 500_000, "max_lexer_states": 50_000, "max_grammar_size": 100_000}


def parser_limits():
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)


def _at_most(what: str, value: int, bound: int, param: str, unit: str = "") -> None:
    """Raise GrammarError (``grammar_too_large``) naming ``what`` when ``value`` is over ``bound``."""
    if value > bound:
        raise GrammarError(f"{param}: the {what} is {value}{unit}; the limit is {bound}{unit}", param,
                           "grammar_too_large")


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_spec(kind: str, value: Any, param: str, limits: GrammarLimits, deep: bool = True) -> None:
    """Raise GrammarError if the constraint ``kind``/``value`` is over one of ``limits``. Without
    ``deep`` only the sizes (what the server checks itself; the scan of a grammar's shape is Python
    work that holds the GIL, so it runs in the grammar worker processes, grammar_worker.py)."""
    if kind == "json":
        _at_most("JSON schema's size", len(json.dumps(value)), limits.max_bytes, param, " bytes")
        if deep:
            _at_most("JSON schema's nesting depth", json_depth(value), limits.max_depth, param)
    elif kind == "regex" and isinstance(value, str):
        _at_most("regex's size", _utf8_size(value), limits.max_bytes, param, " bytes")
        if deep:
            _at_most("regex's group nesting depth", _bracket_depth(re.sub(r"\\.", "", value), "("),
                     limits.max_depth, param)
    elif kind == "choice" and isinstance(value, list):
        _at_most("number of choices", len(value), limits.max_choices, param)
        _at_most("choices' total size", sum(_utf8_size(c) for c in value if isinstance(c, str)), limits.max_bytes,
                 param, " bytes")
    elif kind == "grammar" and isinstance(value, str):
        _at_most("grammar's size", _utf8_size(value), limits.max_bytes, param, " bytes")
        if deep:
            shape = grammar_shape(value)
            _at_most("number of grammar rules", shape.rules, limits.max_rules, param)
            _at_most("number of alternatives of one rule", shape.alternatives, limits.max_alternatives, param)
            _at_most("grammar's depth (chained rule references and brackets)", shape.depth, limits.max_depth, param)


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON value (0 for a scalar), without recursion."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
    return deepest


@dataclass(frozen=True)
class GrammarShape:
    rules: int
    alternatives: int                      # the most of any one rule
    depth: int                             # the longest chain of references, brackets counted


# what a rule body holds that is not structure: strings, Lark regexes, GBNF character classes, comments
_LARK_ATOMS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*|#[^\n]*')
_GBNF_ATOMS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')
_HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w.-]*?)(?:\.-?\d+)?[ \t]*(::=|:)", re.M)
_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def grammar_shape(text: str) -> GrammarShape:
    """Rules, widest rule and depth of a Lark or GBNF grammar (GBNF when it has ``::=``): the rule
    reference graph's longest path from any rule (a recursive reference ends a path: recursion is
    no compile-time depth), each rule adding one plus its bracket nesting."""
    gbnf = "::=" in text
    stripped = (_GBNF_ATOMS if gbnf else _LARK_ATOMS).sub(" _ ", text)
    stripped = "\n".join(line for line in stripped.split("\n") if not line.lstrip().startswith("%"))
    heads = list(_HEAD.finditer(stripped))
    bodies: dict[str, str] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(stripped)
        name = head.group(1)
        bodies[name] = bodies.get(name, "") + " | " + stripped[head.end():end]
    refs = {name: {r for r in _NAME.findall(body) if r in bodies} for name, body in bodies.items()}
    local = {name: 1 + max(_bracket_depth(body, "("), _bracket_depth(body, "[")) for name, body in bodies.items()}
    alternatives = max((_top_level_bars(body) for body in bodies.values()), default=0)
    return GrammarShape(len(heads), alternatives, _longest_chain(refs, local))


def _bracket_depth(text: str, opening: str) -> int:
    closing = {"(": ")", "[": "]"}[opening]
    depth = deepest = 0
    for ch in text:
        if ch == opening:
            depth += 1
            deepest = max(deepest, depth)
        elif ch == closing:
            depth = max(depth - 1, 0)
    return deepest


def _top_level_bars(body: str) -> int:
    """Alternatives of a rule body: its '|' outside brackets, plus one (the body starts with one)."""
    depth = bars = 0
    for ch in body:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(depth - 1, 0)
        elif ch == "|" and depth == 0:
            bars += 1
    return bars


def _longest_chain(refs: dict[str, set[str]], local: dict[str, int]) -> int:
    """The longest path (sum of ``local``) in the reference graph, back edges (recursion) cut;
    iterative, so a grammar of any depth is measured without recursing here."""
    best: dict[str, int] = {}
    on_path: set[str] = set()
    deepest = 0
    for root in refs:
        if root in best:
            continue
        stack = [(root, iter(refs[root]))]
        on_path.add(root)
        while stack:
            name, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(name)
                best[name] = local[name] + max((best.get(c, 0) for c in refs[name] if c not in on_path), default=0)
                continue
            if child in best or child in on_path:
                continue
            on_path.add(child)
            stack.append((child, iter(refs[child])))
        deepest = max(deepest, best[root])
    return deepest
