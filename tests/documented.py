"""The commands the docs show, collected from the docs themselves (so that one added later is found):

- README.md: every line of a fenced block without a language (or sh / bash / shell / console), every
  `python` block (a snippet, whole), and every inline code span that starts with a program (`omni ...`,
  `python ...`, `ray ...`, `make ...`);
- stage_configs/*.yaml: the header comment's indented usage lines and its inline code spans;
- examples/*: the module docstring (Python) or the header comment (shell): indented usage lines and
  inline code spans.

`make TARGET` becomes the target's recipe in the Makefile. A command is one line: continuations
(a trailing backslash, an indented next line in a fenced block, an open quote) joined, a trailing
`# comment` dropped. Used by tests/test_documented_commands.py, which says how each one runs.
"""
from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = {"omni", "python", "pytest", "ray", "serve", "make", "curl", "source", "bash"}
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Doc:
    """One documented command: as shown (one line), where it was found, and the environment it sets."""
    text: str
    where: str
    env: tuple[tuple[str, str], ...] = field(default=())
    lang: str = "sh"  # or "python": a README snippet, run as it is


    @property
    def id(self) -> str:
        text = " ".join(self.text.split())
        short = text if len(text) <= 70 else text[:67] + "..."
        return f"{self.where} {short}"


# ------------------------------------------------------------------ lexing
def _scan(s: str) -> Iterator[tuple[int, str, str | None]]:
    """(index, char, the quote it is inside or None), for quote-aware scanning of shell text."""
    quote = None
    for i, c in enumerate(s):
        if quote is None and c in "'\"":
            yield i, c, None
            quote = c
        elif quote is not None and c == quote:
            quote = None
            yield i, c, None
        else:
            yield i, c, quote


def strip_comment(s: str) -> str:
    for i, c, q in _scan(s):
        if c == "#" and q is None and (i == 0 or s[i - 1].isspace()):
            return s[:i].rstrip()
    return s.rstrip()


def _open_quote(s: str) -> bool:
    try:
        shlex.split(s)
        return False
    except ValueError:
        return True


def _join(lines: list[tuple[int, str]], indent_continues: bool) -> Iterator[tuple[int, str]]:
    """Join continuation lines into one command each: (line number of its first line, command)."""
    cur: tuple[int, str] | None = None
    for n, raw in lines:
        line = raw.rstrip()
        if cur is not None:
            continues = cur[1].endswith("\\") or _open_quote(cur[1]) or (
                indent_continues and raw[:1].isspace() and line.strip())
            if continues:
                cur = (cur[0], cur[1].removesuffix("\\").rstrip() + " " + line.strip())
                continue
            yield cur[0], strip_comment(cur[1])
            cur = None
        if line.strip() and not line.strip().startswith("#"):
            cur = (n, line.strip())
    if cur is not None:
        yield cur[0], strip_comment(cur[1])


def split_env(text: str) -> tuple[dict[str, str], str]:
    """Leading VAR=value assignments, and the command after them."""
    env: dict[str, str] = {}
    rest = text
    while (m := _ENV.match(rest)) and " " in rest:
        word, rest = rest.split(" ", 1)
        k, v = word.split("=", 1)
        env[k] = v
        rest = rest.lstrip()
    return env, rest


def program(text: str) -> str | None:
    """The program a command runs (`.venv/bin/ray` is `ray`), or None when it is not one we recognise."""
    _, rest = split_env(text)
    first = rest.split(" ", 1)[0].strip("\"'")
    if first.startswith("examples/") and first.endswith(".sh"):  # run as it is; a .py runs with python
        return first
    name = first.rsplit("/", 1)[-1]
    return name if name in PROGRAMS else None


def _is_command(text: str) -> bool:
    """A span names a command when it starts with a program and gives it something (a bare `python` is a word)."""
    _, rest = split_env(text)
    words = rest.split()
    if len(words) > 1 and words[1].endswith(":"):  # what a command prints (`omni serve: NAME on ...`)
        return False
    return program(text) is not None and (len(words) > 1 or rest.startswith("examples/"))


def _inline_spans(text: str, first_line: int) -> Iterator[tuple[int, str]]:
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(m.group(1).split())
        if _is_command(span):
            yield first_line + text.count("\n", 0, m.start()), span


# --------------------------------------------------------------- the sources
def _doc(text: str, where: str) -> Doc:
    env, _ = split_env(text)
    return Doc(text, where, tuple(env.items()))


def from_readme(path: Path = REPO / "README.md") -> list[Doc]:
    out: list[Doc] = []
    lines = path.read_text().splitlines()
    prose: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        lang, start, body = m.group(2).lower(), i + 1, []
        i += 1
        while i < len(lines) and not _FENCE.match(lines[i]):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1  # the closing fence
        if lang in SHELL_LANGS:
            out += [_doc(cmd, f"{path.name}:{n}") for n, cmd in _join(body, indent_continues=True)
                    if program(cmd) is not None]
        elif lang == "python":
            out.append(Doc("\n".join(line for _, line in body), f"{path.name}:{start + 1}", lang="python"))
    # prose: inline spans (a span may wrap onto the next line)
    text = "\n".join(line for _, line in prose)
    numbers = [n for n, _ in prose]
    for k, span in _inline_spans(text, 0):
        out.append(_doc(span, f"{path.name}:{numbers[k]}"))
    return out


def _usage_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Indented lines (usage examples inside prose) that start with a program, with their continuations."""
    picked: list[tuple[int, str]] = []
    keep = False
    for n, line in lines:
        indented = line.startswith("  ") and line.strip()
        if indented and (program(line.strip()) is not None or (keep and picked)):
            picked.append((n, line))
            keep = line.rstrip().endswith("\\") or _open_quote(" ".join(l for _, l in picked[-3:]))
        else:
            keep = False
    return [(n, c) for n, c in _join(picked, indent_continues=False) if program(c) is not None]


def _from_text(lines: list[tuple[int, str]], name: str) -> list[Doc]:
    docs = [_doc(c, f"{name}:{n}") for n, c in _usage_lines(lines)]
    text = "\n".join(line for _, line in lines)
    docs += [_doc(span, f"{name}:{lines[0][0] + k}") for k, span in _inline_spans(text, 0)] if lines else []
    return docs


def _header_comment(path: Path) -> list[tuple[int, str]]:
    """The leading `#` comment block (after a shebang), with the `#` removed."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("#!") and n == 1:
            continue
        if not line.startswith("#"):
            break
        out.append((n, line[1:]))
    return out


def from_stage_configs() -> list[Doc]:
    docs = []
    for path in sorted((REPO / "stage_configs").glob("*.yaml")):
        docs += _from_text(_header_comment(path), f"stage_configs/{path.name}")
    return docs


def from_examples() -> list[Doc]:
    docs = []
    for path in sorted((REPO / "examples").iterdir()):
        name = f"examples/{path.name}"
        if path.suffix == ".py":
            tree = ast.parse(path.read_text())
            doc = ast.get_docstring(tree, clean=False)
            if doc:
                first = tree.body[0].lineno
                docs += _from_text([(first + k, line) for k, line in enumerate(doc.splitlines())], name)
        elif path.suffix == ".sh":
            docs += _from_text(_header_comment(path), name)
    return docs


def make_recipe(target: str, makefile: Path = REPO / "Makefile") -> list[tuple[int, str]]:
    """The shell lines of a Makefile target's recipe (variables for the venv's programs resolved)."""
    lines = makefile.read_text().splitlines()
    for n, line in enumerate(lines):
        if re.match(rf"^{re.escape(target)}\s*:", line):
            recipe = []
            for k in range(n + 1, len(lines)):
                if not lines[k].startswith("\t"):
                    break
                cmd = lines[k].strip()
                if cmd and not cmd.startswith("#"):
                    cmd = cmd.replace("$(PY)", "python").replace("$(VENV)/bin/", "")
                    recipe.append((k + 1, cmd))
            return recipe
    raise KeyError(f"Makefile has no target {target!r}")


def collect() -> list[Doc]:
    """Every documented command, `make` targets other than the suite's own (`test`, `test-fast`) expanded to
    their recipes."""
    docs = from_readme() + from_stage_configs() + from_examples()
    out: list[Doc] = []
    for d in docs:
        _, rest = split_env(d.text)
        words = rest.split()
        if words[0] == "make" and len(words) == 2 and words[1] not in ("test", "test-fast"):
            for n, cmd in make_recipe(words[1]):
                out.append(_doc(cmd, f"{d.where} (make {words[1]} -> Makefile:{n})"))
        else:
            out.append(d)
    return out
