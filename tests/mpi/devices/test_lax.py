"""`vjpmpi.lax` against JAX itself: the same shard_map program, once with `jax.lax` in one
process of P x D devices (a subprocess of rank 0, without MPI), once with `vjpmpi.lax` in
P processes of D devices each; the same values and the same gradients (JAX's AD
conventions, under its default check_vma, and without it). And the errors: JAX's own
collective over an extended axis in a program with vjpmpi's, a tuple of axes.

Runs at P processes of D CPU devices each (tests/test_multirank.py, test_devices).
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import vjpmpi

from helpers import WORLD

D = len(jax.devices())
PROCS, PROC = WORLD.size, WORLD.rank
N = PROCS * D
MESH = Mesh(np.array(jax.devices()), ("i",))

# The program, as text: run here with L = vjpmpi.lax and in the reference with jax.lax.
PROGRAM = '''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P

def programs(L, N, check_vma):
    def body(w, x):
        y = jnp.tanh(x @ w)                  # x split over "i", w replicated (pvary'd)
        s = L.psum(jnp.sum(y ** 2), "i")
        m = L.pmean(x, "i")
        g = L.all_gather(y, "i", axis=0, tiled=True)
        g2 = L.all_gather(y, "i", axis=1)
        idx = L.axis_index("i")
        n = L.psum(1, "i") + 0 * L.axis_size("i")
        pp = L.ppermute(y, "i", [(j, (j + 1) % N) for j in range(N) if j != 1])
        a2a = L.all_to_all(jnp.tile(y[:, None, :], (1, N, 1)) * (idx + 1.0), "i", 1, 0,
                           tiled=True)
        # (not differentiated: JAX's transpose of an untiled all_to_all that moves the axis
        # fails on its own typing, "Expected cotangent type float64[4,3,1]")
        a2b = L.all_to_all(jax.lax.stop_gradient(jnp.stack([y[0] * k for k in range(N)])),
                           "i", 0, 1)
        ps = L.psum_scatter(jnp.tile(y, (N, 1)), "i", scatter_dimension=0, tiled=True)
        ps2 = L.psum_scatter(jnp.stack([y[1] * (k + 1) for k in range(N)]), "i")
        mx = L.pmax(jax.lax.stop_gradient(jnp.max(y)), "i")
        mn = L.pmin(jax.lax.stop_gradient(jnp.min(x)), "i")
        local = (jnp.sum(g * g) + jnp.sum(g2) + jnp.sum(pp * x[:, :3]) + jnp.sum(a2a ** 2)
                 + jnp.sum(a2b) + jnp.sum(ps * 3) + jnp.sum(ps2))
        loss = s + L.psum(local, "i") + jnp.sum(m) + mn
        return (s, m, g[None], g2[None], idx[None] * 1.0, n * jnp.ones(1), pp, a2a, a2b, ps,
                ps2[None], loss, mx, mn)

    out = (P(), P(), P("i"), P("i"), P("i"), P(), P("i"), P("i"), P("i"), P("i"), P("i"),
           P(), P(), P())
    def run(mesh, w, x):
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("i")), out_specs=out,
                          check_vma=check_vma)
        vals = jax.jit(f)(w, x)
        loss = lambda w, x: jnp.sum(f(w, x)[11])
        gw, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, x)
        return [np.asarray(v) for v in vals] + [np.asarray(gw), np.asarray(gx)]
    return run

# which results are split over "i" (this process's part: its devices' rows)
SPLIT = (False, False, True, True, True, False, True, True, True, True, True, False, False,
         False, False, True)

def data(N):
    x = np.arange(N * 8.0).reshape(N * 2, 4) / 7 + 1
    w = np.linspace(0.5, 2, 12).reshape(4, 3)
    return w, x
'''

exec(PROGRAM)  # noqa: S102 (the same definitions as the reference runs)

REFERENCE = '''
import os, sys
import numpy as np
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=" + sys.argv[1]
import jax
jax.config.update("jax_enable_x64", True)
from jax.sharding import Mesh
exec(open(sys.argv[2]).read())
N = int(sys.argv[1])
mesh = Mesh(np.array(jax.devices()), ("i",))
w, x = data(N)
out = {}
for vma in (True, False):
    for k, v in enumerate(programs(jax.lax, N, vma)(mesh, w, x)):
        out[f"{vma}-{k}"] = v
np.savez(sys.argv[3], **out)
'''


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """JAX's values on P x D devices of one process (rank 0 runs it, every rank gets it)."""
    out = None
    if PROC == 0:
        folder = tmp_path_factory.mktemp("lax")
        (folder / "program.py").write_text(PROGRAM)
        (folder / "reference.py").write_text(REFERENCE)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI", "MPI", "HYDRA", "OMPI", "PMIX"))}
        run = subprocess.run([sys.executable, str(folder / "reference.py"), str(N),
                              str(folder / "program.py"), str(folder / "ref.npz")],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        out = dict(np.load(folder / "ref.npz"))
    return WORLD.bcast(out, 0)


def mine(a):
    """This process's rows of a result split over the devices."""
    a = np.asarray(a)
    k = a.shape[0] // N
    return a[PROC * D * k:(PROC + 1) * D * k]


@pytest.mark.parametrize("check_vma", [True, False])
def test_values_and_gradients_equal_jax_on_one_process(reference, check_vma):
    w, x = data(N)
    got = programs(vjpmpi.lax, N, check_vma)(MESH, jnp.asarray(w), jnp.asarray(mine(x)))
    for k, v in enumerate(got):
        want = reference[f"{check_vma}-{k}"]
        if SPLIT[k]:
            want = mine(want)
        np.testing.assert_allclose(v, want, rtol=1e-10, atol=1e-10,
                                   err_msg=f"result {k} (check_vma={check_vma})")


def test_jax_collective_over_an_extended_axis_is_refused():
    """A program with vjpmpi.lax that also calls jax.lax.psum over the same axis: JAX's
    sum would stay in this process; refused when it is lowered, on every rank."""
    def body(x):
        return vjpmpi.lax.psum(x, "i") + jax.lax.psum(x, "i")

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("i"), out_specs=P()))
    with pytest.raises(ValueError, match=r"calls jax.lax's psum over mesh axis 'i', which "
                                         r"vjpmpi extends across processes"):
        f(jnp.ones(D))


def test_axis_names_and_groups_are_checked():
    def body(x):
        return vjpmpi.lax.psum(x, ("i", "j"))

    with pytest.raises(ValueError, match=r"vjpmpi.lax.psum: argument 'axis_name' must name "
                                         r"one mesh axis"):
        jax.shard_map(body, mesh=MESH, in_specs=P("i"), out_specs=P())(jnp.ones(D))
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        jax.shard_map(lambda x: vjpmpi.lax.psum(x, "i", axis_index_groups=[[0]]), mesh=MESH,
                      in_specs=P("i"), out_specs=P())(jnp.ones(D))
    with pytest.raises(ValueError, match=r"perm"):
        jax.shard_map(lambda x: vjpmpi.lax.ppermute(x, "i", [(0, 1), (0, 2)]), mesh=MESH,
                      in_specs=P("i"), out_specs=P("i"))(jnp.ones(D))
