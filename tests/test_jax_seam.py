"""vjpmpi's seam with JAX: one module to the package, public names where JAX has them, a
pinned list of private ones.

`vjpmpi/_jax_compat.py` and its sharding half `vjpmpi/_jax_shard.py` (which only
`_jax_compat` imports) are the only modules that import JAX's internals; the rest of
the package takes names from `_jax_compat` (never a JAX module). Of those internals,
the private ones (`jax._src`) are exactly PRIVATE below, and each is named in the
docstring of the module that reads it with what it is for. A new private name is a
decision: add it here and there.
"""

from __future__ import annotations

import ast
import pathlib
import types

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "vjpmpi"
COMPAT = PACKAGE / "_jax_compat.py"
SHARD = PACKAGE / "_jax_shard.py"
SEAM = (COMPAT, SHARD)
# JAX's internal modules, public or private: only _jax_compat.py imports these
INTERNAL = ("jax._src", "jax.interpreters", "jax.extend", "jaxlib.mlir", "jax.core")

PRIVATE = {
    "jax._src.core": {"abstract_token", "jaxprs_in_params", "set_current_trace",
                      "trace_state_clean"},
    "jax._src.interpreters.ad": {"LinearizeTrace", "LinearizeTracer"},
    "jax._src.interpreters.mlir": {"jaxpr_subcomp"},
    "jax._src.interpreters.partial_eval": {"JaxprStackFrame", "_default_dce_rule",
                                           "EffectHandle", "new_eqn_recipe"},
    "jax._src.effects": {"Effect", "control_flow_allowed_effects",
                         "custom_derivatives_allowed_effects", "remat_allowed_effects",
                         "ordered_effects", "partial_eval_kept_effects"},
    "jax._src.source_info_util": {"user_frames"},
    "jax._src.xla_bridge": {"backends_are_initialized"},
    "jax._src.callback": {"_FlatCallback"},
    "jax._src.debugging": {"debug_callback_impl"},
    "jax._src.export._export": {"call_exported_p"},
    "jax._src.interpreters.pxla": {"ExecuteReplicated"},
}
# read by _jax_shard.py (the sharding half)
PRIVATE_SHARD = {
    "jax._src.config": {"_check_vma"},
    "jax._src.core": {"pvary_p"},
    "jax._src.shard_map": {"shard_map_p", "lax_parallel"},
    "jax._src.interpreters.ad": {"fancy_transposes"},
}


# Private names that some JAX versions also have in a public module: _jax_compat takes the
# public one where the installed JAX has it (and it is not deprecated there).
PUBLIC_HOMES = {
    ("jax._src.core", "jaxprs_in_params"): ["jax.extend.core"],  # from 0.10
    ("jax._src.core", "set_current_trace"): ["jax.extend.core"],  # from 0.10
    ("jax._src.effects", "Effect"): ["jax.extend.core"],  # from 0.10
    ("jax._src.core", "abstract_token"): ["jax.ffi", "jax.core"],  # 0.11+; 0.7.1 (to 0.9)
    ("jax._src.interpreters.partial_eval", "JaxprStackFrame"):
        ["jax.interpreters.partial_eval"],  # 0.7.1 only
    ("jax._src.interpreters.partial_eval", "new_eqn_recipe"):
        ["jax.interpreters.partial_eval"],  # 0.7.1, 0.11.1+
}
# How many of PRIVATE's names each JAX release runs (the ones without a public home there).
PRIVATE_IN_USE = {(0, 7): 20, (0, 10): 20, (0, 12): 18}


def _imported_modules(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def private_names_used(path: pathlib.Path) -> dict[str, set[str]]:
    """{private module: names} that `path` reads: `from jax._src.m import name`, and
    `alias.name` where `alias` is a `jax._src` module imported as a whole."""
    tree = ast.parse(path.read_text())
    aliases, used = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            for a in node.names:
                aliases[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jax._src"):
                    aliases[a.asname or a.name] = (a.name, None)
    dereferenced = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            module, name = aliases[node.value.id]
            full = module if name is None else f"{module}.{name}"
            used.setdefault(full, set()).add(node.attr)
            dereferenced.add(node.value.id)
    for alias, (module, name) in aliases.items():
        if alias not in dereferenced and name is not None:  # an object, used by name
            used.setdefault(module, set()).add(name)
    return used


def test_only_the_compat_module_imports_jax_internals():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in SEAM:
            continue
        for module in _imported_modules(ast.parse(path.read_text())):
            if module.startswith(INTERNAL):
                offenders.append(f"{path.relative_to(PACKAGE)}: {module}")
    assert offenders == []


def test_the_compat_module_hands_out_names_not_modules():
    import vjpmpi._jax_compat as jc

    modules = [n for n in jc.__all__ if isinstance(getattr(jc, n), types.ModuleType)]
    assert modules == []
    # and the package uses only what it hands out
    unknown = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "_jax_compat":
                unknown += [a.name for a in node.names if a.name not in jc.__all__]
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "jc" and node.attr not in jc.__all__):
                unknown.append(f"{path.name}: jc.{node.attr}")
    assert unknown == []


@pytest.mark.parametrize("path, pinned", [(COMPAT, PRIVATE), (SHARD, PRIVATE_SHARD)],
                         ids=["compat", "shard"])
def test_private_names_are_the_pinned_and_documented_ones(path, pinned):
    used = private_names_used(path)
    assert used == pinned
    doc = ast.get_docstring(ast.parse(path.read_text()))
    undocumented = [f"{m}.{n}" for m, names in pinned.items() for n in sorted(names)
                    if f"`{m}`" not in doc or f"`{n}`" not in doc]
    assert undocumented == []


def test_only_the_compat_module_imports_its_sharding_half():
    importers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if path != COMPAT and any(n.endswith("_jax_shard") for n in names):
                importers.append(path.name)
    assert importers == []


def test_the_name_counter_sees_a_new_private_name(tmp_path):
    # the check above can fail: a module reading one more private name
    planted = tmp_path / "m.py"
    planted.write_text(COMPAT.read_text() + "\nX = _core.get_aval\nfrom jax._src.api import jit\n")
    used = private_names_used(planted)
    assert used["jax._src.core"] - PRIVATE["jax._src.core"] == {"get_aval"}
    assert used["jax._src.api"] == {"jit"}


def _public_home(name: str, modules: list[str]) -> str | None:
    """The first of `modules` that has `name` on the installed JAX, undeprecated."""
    import importlib
    import warnings

    for module in modules:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            try:
                if getattr(importlib.import_module(module), name, None) is not None:
                    return module
            except (DeprecationWarning, ImportError):
                pass
    return None


@pytest.mark.jax_version  # (.ci/run runs it at both ends of the JAX range too)
def test_private_names_in_use_on_this_jax():
    import jax

    gated = [(m, n) for (m, n), homes in PUBLIC_HOMES.items() if _public_home(n, homes)]
    in_use = sum(len(names) for names in PRIVATE.values()) - len(gated)
    version = tuple(jax.__version_info__[:2])
    assert all(n in PRIVATE[m] for m, n in PUBLIC_HOMES)
    if version in PRIVATE_IN_USE:
        assert in_use == PRIVATE_IN_USE[version], gated
    # and the compat module takes each public home it names: `_public(<module>, "<name>")`
    text = COMPAT.read_text()
    for (_, name), homes in PUBLIC_HOMES.items():
        assert f'"{name}")' in text and "_public(" in text
