"""The package's layout: small modules, each with one job, that take no private name
from one another.

What one module uses from another is a public (non-underscore) name of that module;
the module itself may be private to the package (`vjpmpi._bind`). Read with `ast`, no
import of vjpmpi: single-process and fast. Each check is also run on a planted
violation, so that it is known to be able to fail.
"""

from __future__ import annotations

import ast
import pathlib
import re
import shutil

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "vjpmpi"
MAX_LINES = 450


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*.py") if "csrc" not in p.parts)


def _dotted(root: pathlib.Path, path: pathlib.Path) -> list[str]:
    """The package path of the module `path` (`vjpmpi/nn/_halo.py` -> [vjpmpi, nn, _halo])."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _target(root: pathlib.Path, path: pathlib.Path, node: ast.ImportFrom) -> list[str] | None:
    """The package path an import in `path` reads from (None: outside the package)."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        return parts if parts[0] == root.name else None
    here = _dotted(root, path)
    package = here if path.name == "__init__.py" else here[:-1]
    base = package[:len(package) - (node.level - 1)]
    return base + (node.module.split(".") if node.module else [])


def _file(root: pathlib.Path, parts: list[str]) -> pathlib.Path:
    return root.parent.joinpath(*parts)


def _is_submodule(root: pathlib.Path, parts: list[str], name: str) -> bool:
    """Whether `name`, imported from the package `parts`, is one of its modules: a file or
    package there, or a name the package's `__init__.py` does not define (a compiled
    extension module, which the source tree does not hold)."""
    where = _file(root, parts)
    if (where / f"{name}.py").exists() or (where / name / "__init__.py").exists():
        return True
    init = where / "__init__.py"
    if not init.exists():
        return False
    defined = set()
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update(a.asname or a.name.split(".")[0] for a in node.names)
    return name not in defined


def code_lines(text: str) -> int:
    """The lines of a module outside its docstrings (module, class and function): a
    module's size is its code's; an argument-by-argument docstring does not count."""
    tree = ast.parse(text)
    doc = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(
                    body[0].value.value, str):
                doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    return len(text.splitlines()) - len(doc)


def oversized(root: pathlib.Path = PACKAGE) -> list[str]:
    """The modules of more than MAX_LINES lines of code (docstrings not counted)."""
    out = []
    for path in _modules(root):
        n = code_lines(path.read_text())
        if n > MAX_LINES:
            out.append(f"{path.relative_to(root.parent)}: {n} lines")
    return out


def private_imports(root: pathlib.Path = PACKAGE) -> list[str]:
    """`from .mod import _name` (or `..mod`, `vjpmpi.mod`): a private name taken from
    another module of the package."""
    out = []
    for path in _modules(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            parts = _target(root, path, node)
            if parts is None:
                continue
            for a in node.names:
                if _private(a.name) and not _is_submodule(root, parts, a.name):
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                               f"from {'.' * node.level}{node.module or ''} import {a.name}")
    return out


def private_attributes(root: pathlib.Path = PACKAGE) -> list[str]:
    """`mod._name` where `mod` is a module of the package imported by this one."""
    out = []
    for path in _modules(root):
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parts = _target(root, path, node)
                if parts is not None:
                    aliases.update(a.asname or a.name for a in node.names
                                   if _is_submodule(root, parts, a.name))
            elif isinstance(node, ast.Import):
                aliases.update(a.asname for a in node.names
                               if a.asname and a.name.split(".")[0] == root.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and _private(node.attr)):
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                           f"{node.value.id}.{node.attr}")
    return out


# ------------------------------------------------------------- the C++ --
CSRC = PACKAGE / "csrc"
CMAKE = PACKAGE.parent / "CMakeLists.txt"


def oversized_headers(csrc: pathlib.Path = CSRC) -> list[str]:
    """The C++ headers of more than MAX_LINES lines."""
    return [f"{p.name}: {n} lines" for p in sorted(csrc.glob("*.h"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]


def core_sources(cmake: pathlib.Path = CMAKE) -> list[str]:
    """The files of the core library, as CMakeLists.txt builds it."""
    m = re.search(r"add_library\(vjpmpi_core SHARED([^)]*)\)", cmake.read_text())
    assert m, "CMakeLists.txt builds no vjpmpi_core library"
    return [pathlib.Path(f).name for f in m.group(1).split()]


def core_reaches_python(csrc: pathlib.Path = CSRC, cmake: pathlib.Path = CMAKE) -> list[str]:
    """Includes of Python, nanobind or XLA in the core library's sources and the headers
    they include (the core is linked by every module: it holds no Python and no XLA)."""
    seen, todo, out = set(), list(core_sources(cmake)), []
    while todo:
        name = todo.pop()
        if name in seen or not (csrc / name).exists():
            continue
        seen.add(name)
        for i, line in enumerate((csrc / name).read_text().splitlines(), 1):
            inc = re.match(r'\s*#\s*include\s*[<"]([^>"]+)[>"]', line)
            if not inc:
                continue
            if re.match(r"(Python\.h|nanobind/|xla/)", inc.group(1)):
                out.append(f"{name}:{i}: {inc.group(1)}")
            todo.append(pathlib.Path(inc.group(1)).name)
    return sorted(out)


def handoffs(csrc: pathlib.Path = CSRC) -> list[str]:
    """A runtime handed from one module to another through Python (a capsule), instead of
    the core library both link."""
    pattern = re.compile(r"PyCapsule_GetPointer|PyCapsule_Import|attach_runtime|runtime_capsule")
    return [f"{p.name}:{i}" for p in sorted([*csrc.glob("*.h"), *csrc.glob("*.cc")])
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]


def test_no_module_is_over_the_line_limit():
    assert oversized() == []


def test_no_module_imports_another_modules_private_name():
    assert private_imports() == []


def test_no_module_reads_another_modules_private_attribute():
    assert private_attributes() == []


def test_every_module_states_its_job():
    missing = [str(p.relative_to(PACKAGE.parent)) for p in _modules(PACKAGE)
               if not ast.get_docstring(ast.parse(p.read_text()))
               and p.name != "__init__.py"]
    assert missing == []


# ------------------------------------------------ the checks can fail --
def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "vjpmpi"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("csrc", "__pycache__", "*.so"))
    return root


def test_the_checks_see_planted_violations(tmp_path):
    root = _copy(tmp_path)
    (root / "_big.py").write_text('"""Too long."""\n' + "x = 1\n" * (MAX_LINES + 1))
    (root / "_documented.py").write_text(  # long only by its docstrings: not over
        '"""Job.\n' + "more\n" * MAX_LINES + '"""\ndef f():\n    """Doc.\n\n' + "    a\n" * 50
        + '    """\n')
    with open(root / "nn" / "_halo.py", "a") as f:
        f.write("from .._p2p import _refuse_any_source\n"
                "from vjpmpi._bind import _claim\n"
                "from .. import _bind\n"
                "_bind._EAGER.clear()\n")
    with open(root / "_split.py", "a") as f:
        f.write("from ._primitive import __doc__ as _doc, SPEC_OF\n")  # (dunder: allowed)
    assert oversized(root) == [f"vjpmpi/_big.py: {MAX_LINES + 1} lines"]
    assert [v.split(": ", 1)[1] for v in private_imports(root)] == [
        "from .._p2p import _refuse_any_source", "from vjpmpi._bind import _claim"]
    assert [v.split(": ", 1)[1] for v in private_attributes(root)] == ["_bind._EAGER"]


def test_no_cpp_header_is_over_the_line_limit():
    assert oversized_headers() == []


def test_the_core_library_holds_no_python_and_no_xla():
    assert "runtime.cc" in core_sources() and "agree.cc" in core_sources()
    assert core_reaches_python() == []


def test_no_runtime_is_handed_between_the_modules():
    assert handoffs() == []


def test_the_cpp_checks_see_planted_violations(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    cmake = tmp_path / "CMakeLists.txt"
    shutil.copy(CMAKE, cmake)
    (csrc / "big.h").write_text("#pragma once\n" + "// x\n" * MAX_LINES)
    with open(csrc / "agree.h", "a") as f:  # (included by the core's agree.cc)
        f.write('#include <Python.h>\n')
    with open(csrc / "cpu_module.cc", "a") as f:
        f.write('// cuda.attach_runtime(cpu.runtime_capsule())\n')
    assert oversized_headers(csrc) == [f"big.h: {MAX_LINES + 1} lines"]
    assert [v.split(": ", 1)[1] for v in core_reaches_python(csrc, cmake)] == ["Python.h"]
    assert [v.split(":")[0] for v in handoffs(csrc)] == ["cpu_module.cc"]
