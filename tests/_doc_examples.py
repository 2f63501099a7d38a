"""The Python examples of the README, the docs pages and the public docstrings.

A docs page's example is a fenced ```python block; it runs at 2 ranks of one CPU device
each unless the line before its fence says otherwise: `<!-- ranks: 4 -->`,
`<!-- devices: 2 -->` (each rank with 2 CPU devices, XLA's
--xla_force_host_platform_device_count) or both, `<!-- ranks: 4, devices: 2 -->`. A
docstring's example is a fenced ```python block in it (its `Example:` section), at 2
ranks. Every example is a whole program: the README's test command runs each group (a
page, or the docstrings of one package) in one `mpiexec` per rank and device count
(tests/test_doc_examples.py, tests/run_doc_examples.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
# the annotation before a fence: `<!-- ranks: N -->`, `<!-- devices: D -->` or both,
# `<!-- ranks: N, devices: D -->`
LAYOUT = re.compile(r"<!--\s*((?:ranks|devices):\s*\d+(?:\s*,\s*(?:ranks|devices):\s*\d+)*)\s*-->")
# the languages of the fences that are not Python examples
OTHER = {"bash", "console", "text", "toml", "yaml", "json", "cpp", "c", "cmake", "ini",
         "mermaid", "diff", "hlo", "mlir"}
DEFAULT_RANKS = 2
DEFAULT_DEVICES = 1
# a line that includes a file through pymdownx.snippets (`--8<-- "examples/moe.py"`): a
# block of only such lines shows a script, which its own smoke test runs
SNIPPET = re.compile(r'^\s*-{1,}8<-{1,}\s+"[^"]+"\s*$')


@dataclasses.dataclass
class Example:
    group: str   # the page (README.md, docs/...) or "docstrings: <package>"
    where: str   # file:line of the fence
    ranks: int
    source: str
    devices: int = DEFAULT_DEVICES  # CPU devices per rank


def layout(line: str, where: str) -> tuple[int, int]:
    """(ranks, devices) from the annotation on `line` (the defaults where it has none)."""
    m = LAYOUT.search(line)
    if not m:
        if re.search(r"<!--\s*(ranks|devices)\b", line):
            raise ValueError(f"{where}: an annotation {line.strip()!r} that is not "
                             "`<!-- ranks: N -->`, `<!-- devices: D -->` or "
                             "`<!-- ranks: N, devices: D -->`")
        return DEFAULT_RANKS, DEFAULT_DEVICES
    got = {}
    for part in m.group(1).split(","):
        key, value = (v.strip() for v in part.split(":"))
        if key in got or int(value) < 1:
            raise ValueError(f"{where}: annotation {line.strip()!r}: {key} given twice or < 1")
        got[key] = int(value)
    return got.get("ranks", DEFAULT_RANKS), got.get("devices", DEFAULT_DEVICES)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def fenced(text: str, group: str, where: str, first_line: int = 1) -> list[Example]:
    """The ```python blocks of `text` (Markdown); any fence of no language, or of a
    language neither Python nor in OTHER, is an error (an example the tests would miss)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""),
                   None)
        if end is None:
            raise ValueError(f"{where}:{first_line + i}: a fence that is never closed")
        shown = [ln for ln in lines[i + 1:end] if ln.strip()]
        if lang in ("python", "py", "python3") and shown and all(map(SNIPPET.match, shown)):
            pass  # (a script the page shows, whose own smoke test runs it)
        elif lang in ("python", "py", "python3"):
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            ranks, devices = layout(prev, f"{where}:{first_line + i}")
            body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                             for ln in lines[i + 1:end])
            out.append(Example(group, f"{where}:{first_line + i}", ranks, body + "\n",
                               devices))
        elif lang not in OTHER:
            raise ValueError(f"{where}:{first_line + i}: a fence of language {lang!r}: "
                             f"tag it python (an example the tests run) or one of {sorted(OTHER)}")
        i = end + 1
    return out


def docstring_examples(package: Path = ROOT / "vjpmpi") -> list[Example]:
    """The ```python blocks of every docstring in the package's sources, grouped by
    the public package they document (vjpmpi, vjpmpi.nn, vjpmpi.fft)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(ROOT)
        group = ("docstrings: vjpmpi.nn" if "nn" in rel.parts else
                 "docstrings: vjpmpi.fft" if path.name == "_fft.py" else
                 "docstrings: vjpmpi.compat" if "compat" in rel.parts else "docstrings: vjpmpi")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and "```" in doc:
                    line = node.body[0].lineno
                    out += fenced(inspect.cleandoc(doc), group, str(rel), line)
    return out


def all_examples() -> list[Example]:
    out = []
    for page in pages():
        out += fenced(page.read_text(), str(page.relative_to(ROOT)), str(page.relative_to(ROOT)))
    return out + docstring_examples()


def groups(examples: list[Example]) -> dict[tuple[str, int, int], list[Example]]:
    """One mpiexec per group, rank count and device count (`(group, ranks, devices)`),
    the examples in the order written."""
    out: dict[tuple[str, int, int], list[Example]] = {}
    for ex in examples:
        out.setdefault((ex.group, ex.ranks, ex.devices), []).append(ex)
    return out
