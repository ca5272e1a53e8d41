"""No two places in the serving code (runtime/) share a block of six or more lines, the same or the
same shape with other names: each line is reduced to its tokens with every name, string and number
replaced by a placeholder (keywords kept), imports, comments, docstrings and field declarations
(``name: type = value``) left out, and no window of six such lines may appear twice."""
from __future__ import annotations

import ast
import io
import keyword
import tokenize
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WINDOW = 6
#: Windows this short (in tokens) are boilerplate that any two modules share (closing brackets,
#: ``return x``); below it a repeat is not a copy.
MIN_TOKENS = 30
SKIPPED = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
           tokenize.ENDMARKER)


def field_lines(source: str) -> set[int]:
    """The lines of class-level field declarations (dataclass fields, ``name: type = value``)."""
    return {line for cls in ast.walk(ast.parse(source)) if isinstance(cls, ast.ClassDef)
            for node in cls.body if isinstance(node, ast.AnnAssign)
            for line in range(node.lineno, node.end_lineno + 1)}


def shapes(path: Path) -> list[tuple[int, tuple[str, ...]]]:
    """(line number, the line's token shape) of each code line of ``path``."""
    source = path.read_text()
    fields = field_lines(source)
    lines: dict[int, list[str]] = defaultdict(list)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in SKIPPED or tok.start[0] in fields:
            continue
        if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string):
            lines[tok.start[0]].append("N")
        elif tok.type in (tokenize.STRING, tokenize.NUMBER):
            lines[tok.start[0]].append("V")
        else:
            lines[tok.start[0]].append(tok.string)
    return [(n, tuple(shape)) for n, shape in sorted(lines.items())
            if shape[0] not in ("import", "from", "@") and shape != ("V",)]


def test_no_block_of_six_lines_is_repeated():
    seen: dict[tuple, tuple[str, int]] = {}
    copies = []
    for path in sorted((REPO / "runtime").rglob("*.py")):
        code = shapes(path)
        for i in range(len(code) - WINDOW + 1):
            window = tuple(shape for _, shape in code[i:i + WINDOW])
            if sum(map(len, window)) < MIN_TOKENS:
                continue
            where = (str(path.relative_to(REPO)), code[i][0])
            first = seen.setdefault(window, where)
            if first != where and (first[0] != where[0] or where[1] - first[1] >= WINDOW):
                copies.append((first, where))
    assert copies == []
