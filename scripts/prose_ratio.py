"""Prose per code line of a Python tree, and the share of its lines over the configured line length.

    python scripts/prose_ratio.py [PATH ...] [--top N]    (default PATH: pdm_jax)

Prose lines are docstring lines (module, class and function docstrings) and comment-only lines; code lines are the
other non-blank lines. Prints the ratio prose / code, the share of all lines longer than ``[tool.ruff] line-length``
(pyproject.toml), and the files with the most prose above 0.4 per code line. tests/test_structure.py holds the
package's ratio at or below a committed bound.
"""

import argparse
import ast
import io
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def line_length(pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> int:
    """The ``[tool.ruff] line-length`` of `pyproject` (characters); ValueError if it sets none. Read with a pattern:
    Python 3.10 has no TOML parser of its own."""
    with open(pyproject, encoding="utf-8") as f:
        found = re.search(r"^\[tool\.ruff\]\n(?:(?!\[).*\n)*?line-length\s*=\s*(\d+)", f.read(), re.M)
    if not found:
        raise ValueError(f"{pyproject}: no [tool.ruff] line-length")
    return int(found.group(1))


def count(source: str) -> tuple:
    """``(prose, code, lines)`` line counts of one module's source text. Raises SyntaxError on invalid Python."""
    lines = source.splitlines()
    prose = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                prose.update(range(body[0].lineno, body[0].end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip().startswith("#"):
            prose.add(tok.start[0])
    blank = {i for i, line in enumerate(lines, 1) if not line.strip()}
    return len(prose), len(set(range(1, len(lines) + 1)) - prose - blank), lines


def measure(paths, limit: int) -> dict:
    """Totals over every ``.py`` file under `paths`: ``prose``, ``code``, ``ratio`` (prose / code), ``long_share``
    (share of all lines longer than `limit` characters) and ``files`` (``(path, prose, code)`` per file)."""
    files, prose, code, total, long = [], 0, 0, 0, 0
    for top in paths:
        found = [top] if top.endswith(".py") else sorted(
            os.path.join(d, f) for d, _, names in os.walk(top) for f in names if f.endswith(".py"))
        for path in found:
            with open(path, encoding="utf-8") as f:
                p, c, lines = count(f.read())
            files.append((path, p, c))
            prose, code, total = prose + p, code + c, total + len(lines)
            long += sum(len(line) > limit for line in lines)
    return dict(prose=prose, code=code, ratio=prose / max(code, 1), long_share=long / max(total, 1), files=files)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", default=[os.path.join(ROOT, "pdm_jax")])
    p.add_argument("--top", type=int, default=15, help="how many files to list (most prose above 0.4 per code line)")
    a = p.parse_args(argv)
    limit = line_length()
    m = measure(a.paths, limit)
    print(f"prose/code {m['ratio']:.3f} ({m['prose']} prose, {m['code']} code lines); "
          f"{100 * m['long_share']:.2f}% of lines over {limit} characters")
    for path, pr, c in sorted(m["files"], key=lambda r: r[1] - 0.4 * r[2], reverse=True)[:a.top]:
        print(f"{pr - 0.4 * c:6.0f} {pr:5d} {c:5d} {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
