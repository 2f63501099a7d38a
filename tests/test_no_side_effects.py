"""Importing vjpmpi leaves every JAX program that binds no vjpmpi primitive alone.

vjpmpi adds rules to JAX (dead-code elimination, differentiation, lowering, batching,
host callbacks; vjpmpi/_jax_compat.py lists them). The same set of plain JAX programs
runs in two fresh interpreters, one that imports vjpmpi first and one that does not;
their results (bit for bit), jaxprs, lowered StableHLO and compiled HLO must be equal.
The programs go through each of those rules: jit, grad, vmap, cond, while, scan, remat,
custom_jvp/custom_vjp, nested jit, linearize/linear_transpose, vjp, host callbacks,
jax.export, and equations whose outputs are unused (so that DCE runs its rules).
(vjpmpi's one intended global setting, synchronous CPU dispatch, changes no result:
test_install.py's test_import_sets_synchronous_dispatch.)
"""

import json
import os
import subprocess
import sys

import pytest
from _mpirun import RANK_ENV, TESTS

PROGRAMS = r'''
import json, sys
import numpy as np
if sys.argv[1] == "with":
    import vjpmpi  # noqa: F401  (first, as vjpmpi asks)
import jax
import jax.numpy as jnp
from jax import export, lax  # (jax.export is not imported with jax before 0.8)

jax.config.update("jax_enable_x64", False)
x = jnp.linspace(-1.0, 2.0, 12, dtype=jnp.float32).reshape(3, 4)
v = jnp.arange(4.0, dtype=jnp.float32)


def mlp(w, x):
    return jnp.tanh(x @ w).sum()


def cond_unused(x):  # cond with an output that is not used (DCE of cond's branches)
    a, b = lax.cond(x.sum() > 0, lambda x: (jnp.sin(x), x * 2), lambda x: (jnp.cos(x), x), x)
    return a


def while_unused(x):  # a loop carry whose result is not used
    i, acc, dead = lax.while_loop(lambda c: c[0] < 5,
                                  lambda c: (c[0] + 1, c[1] * 1.1, c[2] + c[1]), (0, x, x))
    return acc


def fori(x):
    return lax.fori_loop(0, 7, lambda i, c: c + jnp.sin(c) * i, x)


def scan_unused(x):
    carry, ys = lax.scan(lambda c, r: (c + r, (r * 2, jnp.exp(r))), jnp.zeros(4), x)
    return carry, ys[0]


@jax.custom_jvp
def softplus(x):
    return jnp.log1p(jnp.exp(x))


softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))


@jax.custom_vjp
def clip_grad(x):
    return x


clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))


def nested(x):  # an inner jit with an unused output
    inner = jax.jit(lambda y: (jnp.sin(y), jnp.cos(y) @ y.T))
    return inner(x)[0].sum()


def remat(x):
    return jax.checkpoint(lambda y: jnp.sin(jnp.sin(y)).sum())(x)


def batched_while(v):  # vmap of a while loop with a batched predicate
    return jax.vmap(lambda s: lax.while_loop(lambda c: c < 10.0, lambda c: c * 2 + 1, s))(v)


def callbacks(x):
    y = jax.pure_callback(lambda a: np.asarray(a) * 3, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    jax.debug.callback(lambda a: None, y)
    return y + 1


def linear_t(x):
    f = lambda y: jnp.cumsum(y * 3.0, axis=1)  # noqa: E731
    return jax.linear_transpose(f, x)(jnp.ones_like(x))[0]


def linearized(x):
    out, f_jvp = jax.linearize(lambda y: jnp.sin(y) * y, x)
    return out, f_jvp(jnp.ones_like(x))


def vjp_unused(x):
    (a, b), back = jax.vjp(lambda y: (jnp.sin(y), jnp.exp(y)), x)
    return back((jnp.ones_like(a), jnp.zeros_like(b)))[0]


PROGRAMS = {
    "jit": (lambda x: jnp.exp(x).sum(axis=0) * 2, (x,)),
    "grad": (jax.grad(mlp), (x.T[:, :3] @ x, x)),
    "vmap": (jax.vmap(lambda r: r @ x, in_axes=1), (x,)),
    "cond_unused": (cond_unused, (x,)),
    "while_unused": (while_unused, (x,)),
    "fori": (fori, (x,)),
    "scan_unused": (scan_unused, (x,)),
    "custom_jvp": (jax.grad(lambda x: softplus(x).sum()), (x,)),
    "custom_vjp": (jax.grad(lambda x: (clip_grad(x) * x).sum()), (x,)),
    "nested_jit": (jax.grad(nested), (x,)),
    "remat": (jax.grad(remat), (x,)),
    "vmap_while": (batched_while, (v,)),
    "callbacks": (callbacks, (x,)),
    "linear_transpose": (linear_t, (x,)),
    "linearize": (linearized, (x,)),
    "vjp_unused": (vjp_unused, (x,)),
    "jvp_of_grad": (lambda x: jax.jvp(jax.grad(mlp, argnums=1), (x.T[:, :3] @ x, x),
                                      (x.T[:, :3] @ x, x))[1], (x,)),
}

record = {}
import re
addresses = lambda text: re.sub(r"0x[0-9a-f]{6,}", "0x(address)", text)  # (of callbacks)
for name, (f, args) in PROGRAMS.items():
    outs = jax.tree.leaves(f(*args))
    jitted = jax.jit(f)
    lowered = jitted.lower(*args)
    record[name] = {
        "out": [np.asarray(o).tobytes().hex() + str(np.asarray(o).dtype) for o in outs],
        "jit_out": [np.asarray(o).tobytes().hex() for o in jax.tree.leaves(jitted(*args))],
        "jaxpr": addresses(str(jax.make_jaxpr(f)(*args))),
        "lowered": addresses(lowered.as_text()),
        "compiled": addresses(lowered.compile().as_text()),
    }

exported = export.export(jax.jit(lambda x: (jnp.sin(x) @ x.T, cond_unused(x))))(x)
caller = jax.jit(lambda x: exported.call(x)[1].sum())  # (the first output unused)
record["export"] = {"mlir": addresses(str(exported.mlir_module())),
                    "out": [np.asarray(o).tobytes().hex() for o in exported.call(x)],
                    "caller": addresses(caller.lower(x).as_text()),
                    "caller_out": np.asarray(caller(x)).tobytes().hex()}
json.dump(record, open(sys.argv[2], "w"))
'''


def run(tmp_path, mode):
    script, out = tmp_path / "programs.py", tmp_path / f"{mode}.json"
    script.write_text(PROGRAMS)
    r = subprocess.run([sys.executable, str(script), mode, str(out)], cwd=TESTS,
                       env={**os.environ, **RANK_ENV}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"the plain programs failed ({mode} vjpmpi):\n{r.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.jax_version
def test_import_changes_no_program_without_collectives(tmp_path):
    without, with_ = run(tmp_path, "without"), run(tmp_path, "with")
    assert sorted(without) == sorted(with_)
    assert len(without) == 18
    differ = []
    for name in without:
        for part in without[name]:
            if without[name][part] != with_[name][part]:
                a, b = without[name][part], with_[name][part]
                at = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
                differ.append(f"{name} ({part}) differs with vjpmpi imported, from "
                              f"{at}:\n  without: {str(a)[at:at + 300]!r}\n"
                              f"  with:    {str(b)[at:at + 300]!r}")
    assert not differ, "\n".join(differ)
