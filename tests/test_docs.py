"""The docs site: `mkdocs build --strict` (warnings are errors) passes, it has its pages
and its search index, every public name of vjpmpi, vjpmpi.nn, vjpmpi.fft, vjpmpi.lax and
vjpmpi.compat.mpi4jax has a docstring and an entry in the built pages, and every public
callable's docstring documents each argument, its result and its errors (the examples
of the pages: test_doc_examples.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The public names of each module, from the installed package (run in a process of
# its own: importing vjpmpi initialises MPI).
LIST_PUBLIC = """
import json, types
import vjpmpi, vjpmpi.nn, vjpmpi.fft, vjpmpi.lax, vjpmpi.compat.mpi4jax
out = {}
for m in (vjpmpi, vjpmpi.nn, vjpmpi.fft, vjpmpi.lax, vjpmpi.compat.mpi4jax):
    for n in getattr(m, "__all__", dir(m)):
        obj = getattr(m, n)
        if not n.startswith("_") and not isinstance(obj, types.ModuleType):
            out[f"{m.__name__}.{n}"] = bool((getattr(obj, "__doc__", None) or "").strip())
print(json.dumps(out))
"""


def test_docs_build_strict_and_document_every_public_name(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    listed = subprocess.run([sys.executable, "-c", LIST_PUBLIC], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    public = json.loads(listed.stdout.strip().splitlines()[-1])
    assert len(public) > 40 and "vjpmpi.compat.mpi4jax.allreduce" in public
    # the site's pages (one index.html each) and its search index
    built_pages = [p for p in site.rglob("index.html")]
    assert len(built_pages) >= 10, built_pages
    assert (site / "search" / "search_index.json").exists()
    pages = "".join(p.read_text() for p in site.rglob("*.html"))
    missing = [n for n in public if f'id="{n}"' not in pages]
    undocumented = [n for n, has_doc in public.items() if not has_doc]
    assert not missing, f"public names with no entry in the docs: {missing}"
    assert not undocumented, f"public names without a docstring: {undocumented}"


# Each public callable's docstring, parsed as the docs site parses it (griffe, Google
# style), against its signature: an Args section naming every parameter and nothing
# else, a Returns section (unless annotated `-> None`) and a Raises section; a class's
# constructor arguments in its own docstring (Args, or Attributes for a record the user
# reads but does not build), its public methods and `__call__` with Args and Returns.
CHECK_SECTIONS = r"""
import inspect, json, types, warnings
import griffe
import vjpmpi, vjpmpi.nn, vjpmpi.fft, vjpmpi.lax

def sections(doc):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parsed = griffe.Docstring(doc or "", lineno=1).parse("google", warnings=False)
    out = {}
    for s in parsed:
        kind = s.kind.value
        if kind in ("parameters", "attributes"):
            out.setdefault(kind, []).extend(p.name for p in s.value)
        else:
            out[kind] = True
    return out

def params(fn):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, None
    names = [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "")
             + p.name for p in sig.parameters.values() if p.name not in ("self", "cls")]
    return names, sig.return_annotation

def check_function(where, fn, problems, method=False):
    s = sections(inspect.getdoc(fn))
    names, ret = params(fn)
    if names is None:
        return
    documented = [a.lstrip("*") for a in s.get("parameters", [])]
    wanted = [n.lstrip("*") for n in names]
    if wanted and sorted(documented) != sorted(wanted):
        problems.append(f"{where}: Args {documented} != signature {wanted}")
    if ret not in (None, "None", type(None)) and "returns" not in s:
        problems.append(f"{where}: no Returns section")
    if not method and "raises" not in s:
        problems.append(f"{where}: no Raises section")

problems, seen = [], 0
for m in (vjpmpi, vjpmpi.nn, vjpmpi.fft, vjpmpi.lax):
    for n in getattr(m, "__all__", [n for n in dir(m) if not n.startswith("_")]):
        obj = getattr(m, n)
        where = f"{m.__name__}.{n}"
        if isinstance(obj, types.ModuleType) or not callable(obj):
            continue
        seen += 1
        if inspect.isclass(obj):
            if issubclass(obj, BaseException):
                continue
            names, _ = params(obj)
            s = sections(inspect.getdoc(obj))
            # (Attributes: a record the user reads, not builds: `Pending`, `Slot`)
            documented = sorted(a.lstrip("*") for a in s.get("parameters", s.get("attributes", [])))
            if names and documented != sorted(a.lstrip("*") for a in names):
                problems.append(f"{where}: Args {documented} != constructor {names}")
            for k, v in vars(obj).items():
                if (k == "__call__" or not k.startswith("_")) and inspect.isfunction(v):
                    check_function(f"{where}.{k}", v, problems, method=True)
        else:
            check_function(where, obj, problems)
print(json.dumps({"seen": seen, "problems": problems}))
"""


def test_every_public_callable_documents_its_arguments(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHECK_SECTIONS], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seen"] > 55, got
    assert not got["problems"], "\n".join(got["problems"])
