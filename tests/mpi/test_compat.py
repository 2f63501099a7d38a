"""vjpmpi.compat.mpi4jax: mpi4jax 0.9's API and gradient conventions (its docstrings and
README), with vjpmpi's exact rules where mpi4jax has none. References are NumPy on
every rank's data (allgathered with mpi4py) and the analytic adjoints."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
import vjpmpi.compat.mpi4jax as m4j

from helpers import WORLD, gdot, normal

rank, size = WORLD.rank, WORLD.size
P, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY

# mpi4jax 0.9's signatures: (name, kind, default); `...` marks "no default", and every
# function ends with `token=NOTSET`.
SIGNATURES = {
    "allgather": [("x", P, ...), ("comm", KW, None)],
    "allreduce": [("x", P, ...), ("op", P, ...), ("comm", KW, None)],
    "alltoall": [("x", P, ...), ("comm", KW, None)],
    "barrier": [("comm", KW, None)],
    "bcast": [("x", P, ...), ("root", P, ...), ("comm", KW, None)],
    "gather": [("x", P, ...), ("root", P, ...), ("comm", KW, None)],
    "recv": [("x", P, ...), ("source", P, MPI.ANY_SOURCE), ("tag", KW, MPI.ANY_TAG),
             ("comm", KW, None), ("status", KW, None)],
    "reduce": [("x", P, ...), ("op", P, ...), ("root", P, ...), ("comm", KW, None)],
    "scan": [("x", P, ...), ("op", P, ...), ("comm", KW, None)],
    "scatter": [("x", P, ...), ("root", P, ...), ("comm", KW, None)],
    "send": [("x", P, ...), ("dest", P, ...), ("tag", KW, 0), ("comm", KW, None)],
    "sendrecv": [("sendbuf", P, ...), ("recvbuf", P, ...), ("source", P, ...), ("dest", P, ...),
                 ("sendtag", KW, 0), ("recvtag", KW, MPI.ANY_TAG), ("comm", KW, None),
                 ("status", KW, None)],
}


def gathered(a):
    return np.stack(WORLD.allgather(np.asarray(a)))


# ------------------------------------------------------------------ API --
def test_namespace_and_signatures_are_mpi4jax_09s():
    assert sorted(m4j.__all__) == sorted([*SIGNATURES, "has_cuda_support", "has_sycl_support"])
    for name, params in SIGNATURES.items():
        got = [(p.name, p.kind, ... if p.default is p.empty else p.default)
               for p in inspect.signature(getattr(m4j, name)).parameters.values()]
        assert got == [*params, ("token", KW, m4j.NOTSET)], name
        assert getattr(m4j, name).__doc__, name


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_an_explicit_token_is_a_runtime_error_naming_the_op(name):
    x = jnp.zeros((size, 2))
    args = {"allreduce": (x, MPI.SUM), "reduce": (x, MPI.SUM, 0), "scan": (x, MPI.SUM),
            "bcast": (x, 0), "gather": (x, 0), "scatter": (x, 0), "send": (x, 0),
            "recv": (x, 0), "sendrecv": (x, x, 0, 0), "barrier": ()}.get(name, (x,))
    with pytest.raises(RuntimeError, match=rf"mpi4jax\.{name}: explicit token"):
        getattr(m4j, name)(*args, token=object())
    with pytest.raises(RuntimeError, match="explicit token"):  # at trace time, under jit
        jax.jit(lambda v: getattr(m4j, name)(*args, token=None))(x)


def test_helpers():
    assert m4j.has_cuda_support() is (vjpmpi._kernels.cuda is not None)
    assert m4j.has_sycl_support() is False


# ------------------------------------- allreduce(SUM): mpi4jax's convention --
def test_allreduce_sum_transposes_to_the_identity():
    x, w, t = normal(4, 1), normal(4, 2), normal(4, 3)
    total = gathered(x).sum(0)
    np.testing.assert_allclose(jax.jit(lambda v: m4j.allreduce(v, MPI.SUM))(x), total, rtol=1e-13)
    # reverse mode: the cotangent passes through unchanged (no communication)
    g = jax.jit(jax.grad(lambda v: jnp.vdot(m4j.allreduce(v, MPI.SUM), w)))(x)
    np.testing.assert_array_equal(g, w)
    (tr,) = jax.linear_transpose(lambda v: m4j.allreduce(v, MPI.SUM), x)(w)
    np.testing.assert_array_equal(tr, w)
    # forward mode: the tangent is allreduced, as the value is
    _, dy = jax.jvp(lambda v: m4j.allreduce(v, "sum"), (x,), (t,))
    np.testing.assert_allclose(dy, gathered(t).sum(0), rtol=1e-13)
    # vjpmpi's own allreduce gives the exact adjoint instead: the sum of all ranks' w
    g_exact = jax.grad(lambda v: jnp.vdot(vjpmpi.allreduce(v, MPI.SUM), w))(x)
    np.testing.assert_allclose(g_exact, gathered(w).sum(0), rtol=1e-13)
    # batched: one allreduce of the stacked data, identity backward per row
    xs, ws = normal((3, 4), 4), normal((3, 4), 5)
    gs = jax.vmap(jax.grad(lambda v, c: jnp.vdot(m4j.allreduce(v, MPI.SUM), c)))(xs, ws)
    np.testing.assert_array_equal(gs, ws)


def test_data_parallel_step_port():
    """The worked port of docs/guides/mpi4jax.md: an mpi4jax data-parallel step differentiates the
    allreduced loss, then averages the gradients; its numbers stay with the compat
    import, become `size` times larger with `import vjpmpi as mpi4jax`, and vjpmpi's
    replicated pair gives the full-batch gradient with no gradient allreduce."""
    w = jnp.asarray(WORLD.bcast(np.array([0.5, -1.0, 2.0]), root=0))
    xb, yb = normal((5, 3), 6), normal(5, 7)
    n = 5 * size
    xs, ys = np.concatenate(WORLD.allgather(np.asarray(xb))), np.concatenate(WORLD.allgather(np.asarray(yb)))
    full = 2 * xs.T @ (xs @ np.asarray(w) - ys) / n

    def step(lib, weights):
        loss = lambda v: lib.allreduce(jnp.sum((xb @ v - yb) ** 2), MPI.SUM) / n  # noqa: E731
        return lib.allreduce(jax.grad(loss)(weights), MPI.SUM)

    np.testing.assert_allclose(jax.jit(lambda v: step(m4j, v))(w), full, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(lambda v: step(vjpmpi, v))(w), size * full, rtol=1e-12)

    def loss(v):
        return vjpmpi.sum_replicated(jnp.sum((xb @ vjpmpi.use_replicated(v) - yb) ** 2)) / n

    np.testing.assert_allclose(jax.jit(jax.grad(loss))(w), full, rtol=1e-12)


# ------------------------ where mpi4jax has no rule: vjpmpi's exact ones --
def test_allreduce_max_gradient_goes_to_the_maximum():
    x = jnp.asarray(np.arange(4.0) * (1 if rank % 2 else -1) + rank)  # distinct per rank
    w = normal(4, 8)
    xs = gathered(x)
    y = m4j.allreduce(x, MPI.MAX)
    np.testing.assert_array_equal(y, xs.max(0))
    g = jax.grad(lambda v: jnp.vdot(m4j.allreduce(v, MPI.MAX), w))(x)
    hit = xs == xs.max(0)  # ties would split the cotangent equally
    np.testing.assert_allclose(g, np.where(hit[rank], gathered(w).sum(0) / hit.sum(0), 0),
                               rtol=1e-13)


def _ring(v):
    return m4j.sendrecv(v, v, source=(rank - 1) % size, dest=(rank + 1) % size)


def _send_recv(v):  # rank r sends to r + 1 (not the last), r receives from r - 1
    if rank + 1 < size:
        m4j.send(v, rank + 1, tag=3)
    return m4j.recv(v, rank - 1, tag=3) if rank else v


# name -> (f, input shape, output shape, NumPy reference from the stacked inputs)
LINEAR = {
    "reduce": (lambda v: m4j.reduce(v, MPI.SUM, 0), (3,), (3,),
               lambda xs: xs.sum(0) if rank == 0 else xs[rank]),
    "bcast": (lambda v: m4j.bcast(v, size - 1), (3,), (3,), lambda xs: xs[size - 1]),
    "allgather": (m4j.allgather, (3,), (size, 3), lambda xs: xs),
    "gather": (lambda v: m4j.gather(v, 0), (3,), (size, 3) if rank == 0 else (3,),
               lambda xs: xs if rank == 0 else xs[rank]),
    "scatter": (lambda v: m4j.scatter(v, 0), (size, 3) if rank == 0 else (3,), (3,),
                lambda xs: None),
    "alltoall": (m4j.alltoall, (size, 3), (size, 3), lambda xs: xs[:, rank]),
    "scan": (lambda v: m4j.scan(v, MPI.SUM), (3,), (3,), lambda xs: xs[: rank + 1].sum(0)),
    "sendrecv": (_ring, (3,), (3,), lambda xs: xs[(rank - 1) % size]),
    "send/recv": (_send_recv, (3,), (3,), lambda xs: xs[rank - 1] if rank else xs[0]),
}


def _reference(name, a):
    """What LINEAR[name] must give for this rank's input `a`: NumPy on every rank's `a`."""
    if name == "scatter":  # root's block `rank` (only the root's input has the rank axis)
        return WORLD.bcast(np.asarray(a) if rank == 0 else None, root=0)[rank]
    return LINEAR[name][3](gathered(a))


@pytest.mark.parametrize("name", sorted(LINEAR))
def test_linear_ops_values_and_exact_adjoints(name):
    f, in_shape, out_shape, _ = LINEAR[name]
    x, w, t = normal(in_shape, 9), normal(out_shape, 10), normal(in_shape, 19)
    y = jax.jit(f)(x)
    assert y.shape == out_shape
    np.testing.assert_allclose(y, _reference(name, x), rtol=1e-13)
    # dot test over the ranks: <A x, w> = <x, A^T w>
    _, vjp = jax.vjp(f, x)
    (xt,) = vjp(w)
    assert abs(gdot(y, w) - gdot(x, xt)) <= 1e-12 * max(1.0, abs(gdot(y, w)))
    # jvp with a tangent of its own (every rank's differs from its x): the op applied to
    # every rank's tangent, by the NumPy reference (the ops are linear)
    _, dy = jax.jvp(f, (x,), (t,))
    assert dy.shape == out_shape
    np.testing.assert_allclose(dy, _reference(name, t), rtol=1e-13)


def test_what_non_root_ranks_and_send_barrier_return():
    x = normal(3, 11)
    y = m4j.bcast(x, 0)  # root: its own x; elsewhere: root's
    np.testing.assert_array_equal(y, x if rank == 0 else WORLD.bcast(None, root=0))
    if rank == 0:
        WORLD.bcast(np.asarray(x), root=0)
    if rank != 0:  # mpi4jax: non-root ranks get their input back from reduce and gather
        np.testing.assert_array_equal(m4j.reduce(x, MPI.SUM, 0), x)
        np.testing.assert_array_equal(m4j.gather(x, 0), x)
    else:
        m4j.reduce(x, MPI.SUM, 0)
        m4j.gather(x, 0)
    assert m4j.barrier() == []
    assert m4j.send(x, MPI.PROC_NULL) == []


def test_sendrecv_gradient_goes_back_to_the_sender():
    x, w = normal(3, 12), normal(3, 13)
    g = jax.jit(jax.grad(lambda v: jnp.vdot(_ring(v), w)))(x)
    np.testing.assert_allclose(g, gathered(w)[(rank + 1) % size], rtol=1e-13)


def test_sendrecv_either_operand_alone():  # mpi4jax's jvp needs both differentiated
    x, w, tmpl = normal(3, 16), normal(3, 17), jnp.zeros(3)
    peers = ((rank - 1) % size, (rank + 1) % size)
    g = jax.grad(lambda v: jnp.vdot(m4j.sendrecv(v, tmpl, *peers), w))(x)
    np.testing.assert_allclose(g, gathered(w)[(rank + 1) % size], rtol=1e-13)
    g_t = jax.grad(lambda t: jnp.vdot(m4j.sendrecv(x, t, *peers), w))(tmpl)
    np.testing.assert_array_equal(g_t, np.zeros(3))  # received: the template is unused


@pytest.mark.parametrize("name", sorted(LINEAR))
def test_vmap_of_every_op(name):  # mpi4jax batches allreduce, sendrecv and barrier only
    f, in_shape, out_shape, _ = LINEAR[name]
    xs = normal((3, *in_shape), 18)
    ys = np.asarray(jax.jit(jax.vmap(f))(xs))
    assert ys.shape == (3, *out_shape)
    np.testing.assert_allclose(ys, np.stack([f(v) for v in xs]), rtol=1e-13)
    # each batch member is the op on that member of every rank's batch (NumPy reference)
    for i, x in enumerate(np.asarray(xs)):
        np.testing.assert_allclose(ys[i], _reference(name, x), rtol=1e-13, err_msg=f"member {i}")


# --------------------------------------------------------------- errors --
def test_bad_input_errors_have_mpi4jax_s_types():
    with pytest.raises(ValueError, match="alltoall"):  # leading axis must be the size
        m4j.alltoall(jnp.zeros((size + 1, 2)))
    # only the root's input has the rank axis, and only the root can check it: with other
    # ranks it fails the scatter on every rank when it runs (they used to wait for ever)
    x = jnp.zeros((size + 1, 2)) if rank == 0 else jnp.zeros(2)
    if size == 1:
        with pytest.raises(ValueError, match="scatter"):
            m4j.scatter(x, 0)
    else:
        fresh = MPI.COMM_WORLD.Dup()  # (every rank runs the scatter's program first here)
        try:
            with pytest.raises(Exception, match=r"vjpmpi\.scatter: argument 'x' on the root"):
                jax.block_until_ready(m4j.scatter(x, 0, comm=fresh))
        finally:
            fresh.Free()
    with pytest.raises(TypeError, match="comm"):
        m4j.allreduce(jnp.zeros(2), MPI.SUM, comm="world")
    with pytest.raises(TypeError, match="root"):
        m4j.bcast(jnp.zeros(2), 0.0)


# ---------------------------------------------------- against mpi4jax itself --
def _mpi4jax():
    try:
        import mpi4jax
    except ModuleNotFoundError as err:  # (built from source, not a pip extra)
        if err.name != "mpi4jax":
            raise  # installed but broken: an error, not a skip
        pytest.skip("mpi4jax is not installed: bash tests/install_mpi4jax.sh")
    return mpi4jax


# what mpi4jax computes (values and the derivatives it defines), as (lib, x, w) -> array
def _ring_of(lib, v):
    return lib.sendrecv(v, v, source=(rank - 1) % size, dest=(rank + 1) % size)


SAME = {
    "allreduce SUM": lambda lib, x, w: lib.allreduce(x, MPI.SUM),
    "allreduce SUM grad": lambda lib, x, w: jax.grad(
        lambda v: jnp.vdot(lib.allreduce(v, MPI.SUM), w))(x),
    "allreduce SUM jvp": lambda lib, x, w: jax.jvp(lambda v: lib.allreduce(v, MPI.SUM),
                                                   (x,), (w,))[1],
    "allreduce SUM transpose": lambda lib, x, w: jax.linear_transpose(
        lambda v: lib.allreduce(v, MPI.SUM), x)(w)[0],
    "allreduce SUM vmap": lambda lib, x, w: jax.vmap(lambda v: lib.allreduce(v, MPI.SUM))(
        jnp.stack([x, w])),
    "allreduce MAX": lambda lib, x, w: lib.allreduce(x, MPI.MAX),
    "sendrecv": lambda lib, x, w: _ring_of(lib, x),
    "sendrecv grad": lambda lib, x, w: jax.grad(lambda v: jnp.vdot(_ring_of(lib, v), w))(x),
    "reduce": lambda lib, x, w: lib.reduce(x, MPI.SUM, 0),
    "bcast": lambda lib, x, w: lib.bcast(x, 0),
    "gather": lambda lib, x, w: lib.gather(x, 0),
    "allgather": lambda lib, x, w: lib.allgather(x),
    "scatter": lambda lib, x, w: lib.scatter(jnp.stack([x] * size) if rank == 0 else x, 0),
    "alltoall": lambda lib, x, w: lib.alltoall(jnp.stack([x * (j + 1) for j in range(size)])),
    "scan": lambda lib, x, w: lib.scan(x, MPI.SUM),
    "barrier": lambda lib, x, w: jnp.asarray(len(lib.barrier())),
}


@pytest.mark.parametrize("case", sorted(SAME))
def test_same_numbers_as_mpi4jax(case):
    mpi4jax = _mpi4jax()
    x, w = normal(5, 14), normal(5, 15)
    want = SAME[case](mpi4jax, x, w)
    got = SAME[case](m4j, x, w)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
