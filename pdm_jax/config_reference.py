"""Generates ``docs/configuration.md``, the reference of every run-config field, from the schema itself.

The schema is :func:`pdm_jax.config.get_base_config`. Its source is parsed (``ast`` for the assignments, ``tokenize``
for the comments): each ``c.<section>.<field> = value`` is paired with the comment lines directly above it and its
trailing inline comment, which together are the field's description. Defaults are read from ``get_base_config()``
itself, not from the source text, so a default taken from another module (``sampler_defaults.BATCHING``) shows its
value. The unit column comes from an explicit ``(unit: X)`` in the comment (removed from the description), else from the
field's name (``*_s``: seconds), else from a known unit in parentheses or as the description's first words.

    python -m pdm_jax.config_reference > docs/configuration.md
    python -m pdm_jax.config_reference --write          # the same, written in place

``tests/test_config_reference.py`` fails when the page differs from this output or when a field has no description.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import os
import re
import tokenize
from typing import NamedTuple

import ml_collections

from pdm_jax import config as config_module
from pdm_jax.sampler.spec import EngineSpec

#: Where ``--write`` puts the page, relative to the repository root.
DOC_PATH = os.path.join("docs", "configuration.md")

_HEADER = re.compile(r"^-{2,}\s*(.*?)\s*-*$")  # "# ---- model -----": a section header comment
#: Units recognised in a description, written as "(unit)" or as the description's first words.
_UNITS = ("s", "seconds", "tokens", "steps", "nats", "sequences", "prompts", "rows", "chips", "parameters",
          "samples", "versions", "passes", "optimizer steps", "RL steps", "SFT steps", "rollout batches")


class Field(NamedTuple):
    """One leaf of the schema: its dotted path, default, unit ("" if none) and description."""

    path: str  # dotted path below the root, e.g. "rl.tis_cap"
    default: object
    unit: str
    description: str


class Section(NamedTuple):
    """A ``c.<name> = ConfigDict()`` section: its description (header and comments) and its fields."""

    name: str  # "" for the top-level fields
    description: str
    fields: list


def _dotted(node: ast.AST) -> str | None:
    """``c.a.b`` -> ``"a.b"``; None for any other target."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "c" and parts:
        return ".".join(reversed(parts))
    return None


def _is_config_dict(value: ast.AST) -> bool:
    """``ml_collections.ConfigDict(...)`` (or a bare ``ConfigDict(...)``) call."""
    if not isinstance(value, ast.Call):
        return False
    return getattr(value.func, "attr", getattr(value.func, "id", None)) == "ConfigDict"


def _comments(source: str) -> tuple[dict, dict]:
    """({line: text} of comment-only lines, {line: text} of comments after code on their line), 1-based."""
    own, inline = {}, {}
    code_lines = set()
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for tok in tokens:
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            text = tok.string[1:].strip()
            (inline if line in code_lines else own)[line] = text
    return own, inline


def _join(lines: list[str]) -> str:
    """The comment lines as one line of text."""
    return " ".join(s for s in (line.strip() for line in lines) if s)


_UNIT_MARK = re.compile(r"\s*\(unit: ([^)]*)\)")


def _unit(path: str, default: object, description: str) -> tuple[str, str]:
    """(unit, description without its unit mark): an explicit "(unit: X)" in the comment, else a name ending in ``_s``
    (seconds), else a unit of `_UNITS` in parentheses or as the description's first words, else none."""
    mark = _UNIT_MARK.search(description)
    if mark:
        text = _UNIT_MARK.sub("", description)
        text = re.sub(r"^\s*\.\s*", "", re.sub(r"\s+\.", ".", text)).strip()
        return mark.group(1).strip(), text
    if path.rsplit(".", 1)[-1].endswith("_s"):
        return "s", description
    if isinstance(default, (bool, str)):
        return "", description
    alternatives = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
    match = re.search(rf"\(({alternatives})\)", description) or re.match(rf"({alternatives})[; ]", description)
    if match:
        return ("s" if match.group(1) == "seconds" else match.group(1)), description
    return "", description


def _lookup(config: ml_collections.ConfigDict, path: str):
    """The value at a dotted path."""
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def _engine_fields_call(stmt: ast.AST) -> bool:
    """``engine_config_fields(c.<section>)``: the schema's `EngineSpec.config_fields`."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return isinstance(call, ast.Call) and getattr(call.func, "id", None) == "engine_config_fields"


def schema() -> list[Section]:
    """Every field of ``get_base_config`` with its default, unit and description, grouped by section."""
    source = inspect.getsource(config_module.get_base_config)
    function = ast.parse(source).body[0]
    own, inline = _comments(source)
    config = config_module.get_base_config()

    sections: dict[str, Section] = {}
    for stmt in function.body:
        if _engine_fields_call(stmt):  # `config.engine_config_fields(c.sampler)`: EngineSpec's descriptions
            section = _dotted(stmt.value.args[0])
            for f in EngineSpec.config_fields():
                path = f"{section}.{f.name}"
                default = _lookup(config, path)
                sections[section].fields.append(Field(path, default, *_unit(path, default, f.metadata["config"])))
            continue
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            continue
        path = _dotted(stmt.targets[0])
        if path is None:
            continue
        above, line = [], stmt.lineno - 1
        while line in own:
            above.append(own[line])
            line -= 1
        above.reverse()
        header = [_HEADER.match(t).group(1) for t in above if _HEADER.match(t)]
        above = [t for t in above if not _HEADER.match(t)]
        after = [inline[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in inline]
        description = _join(above + after)
        if _is_config_dict(stmt.value) and path not in config_module.OPEN_FIELDS:
            name = path
            intro = _join([h for h in header if h and h.lower() != name] + ([description] if description else []))
            sections[name] = Section(name, intro, [])
            continue
        section = path.rsplit(".", 1)[0] if "." in path else ""
        while section and section not in sections:  # a nested section's fields list under their parent
            section = section.rsplit(".", 1)[0] if "." in section else ""
        if section not in sections:
            sections[section] = Section(section, "", [])
        default = _lookup(config, path)
        if isinstance(default, ml_collections.ConfigDict):
            default = default.to_dict()
        unit, description = _unit(path, default, description)
        sections[section].fields.append(Field(path, default, unit, description))
    top = sections.pop("", None)
    ordered = list(sections.values())
    if top is not None:
        ordered.insert(0, Section("", "fields at the root of the config", top.fields))
    return [s for s in ordered if s.fields]


def leaf_paths() -> set[str]:
    """Every leaf of ``get_base_config()`` (the free-form OPEN_FIELDS as one leaf each)."""
    leaves = {p for p, _ in config_module._leaves(config_module.get_base_config())}
    return leaves | set(config_module.OPEN_FIELDS)


def _format_default(value) -> str:
    """A default as inline code: strings JSON-quoted, large ints with underscores, dicts as dict(...)."""
    if isinstance(value, str):
        text = json.dumps(value)
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 100_000:
        text = f"{value:_}"  # 2_000_000_000: a Python literal, readable
    elif isinstance(value, dict):
        text = "dict(" + ", ".join(f"{k}={v!r}" for k, v in value.items()) + ")"
    else:
        text = repr(value)
    return f"`{text}`"


def _sentence(text: str) -> str:
    """A plain first word capitalised ("mask=ppo", "e.g.", "http://..." are left alone), a full stop at the end."""
    text = text.strip()
    if not text:
        return text
    if re.match(r"[a-z]+ ", text):
        text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def _cell(text: str) -> str:
    """Markdown-table-safe text: pipes, angle brackets and asterisks escaped."""
    for raw, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*"), ("\n", " ")):
        text = text.replace(raw, escaped)
    return text


def render() -> str:
    """The markdown of ``docs/configuration.md``."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m pdm_jax.config_reference --write` from the comments of",
        "     `pdm_jax/config.py:get_base_config`. Do not edit by hand: edit the comments and regenerate. -->",
        "",
        "Every field a run reads, with its default (`get_base_config()`), its unit and its meaning.",
        "A config file (`configs/*.py`) returns this schema with some fields changed. Override any field",
        "on the command line, `--config.trust_region.delta=0.1`, or through the config's argument string,",
        "`--config=configs/tiny.py:delta=0.1,seed=2` (the short names are `pdm_jax.config.ARG_ALIASES`).",
        "An unknown field or a value of the wrong kind stops the run before any work, naming the field.",
        "",
    ]
    sections = schema()
    out.append("Sections: " + ", ".join(f"[`{s.name or 'root'}`](#{s.name or 'root'})" for s in sections) + ".")
    out.append("")
    for s in sections:
        title = s.name or "root"
        out.append(f'<a id="{title}"></a>')
        out.append(f"## `{title}`")
        out.append("")
        if s.description:
            out.append(_cell(_sentence(s.description)))
            out.append("")
        out.append("| field | default | unit | meaning |")
        out.append("|---|---|---|---|")
        for f in s.fields:
            cells = (f"`{f.path}`", _cell(_format_default(f.default)), f.unit or "—", _cell(_sentence(f.description)))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    """Prints the page (``--write``: writes it to `DOC_PATH`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH} (else print to stdout)")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(root, DOC_PATH), "w") as f:
            f.write(text)
        print(f"wrote {DOC_PATH}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
