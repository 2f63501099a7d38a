"""`vjpmpi.start` / `vjpmpi.wait` (a point-to-point call split in two) and `vjpmpi.fence`.

- send, recv and sendrecv begun with `start` and ended with `wait` give the bits of the
  same call unsplit: jitted and eager, with rank-dependent data, peers (MPI.PROC_NULL
  on the ring's ends: the template is kept), dtypes and batching (vmap on axis 0 on even
  ranks, on the last axis on odd ones).
- Derivatives equal the unsplit call's (jvp, vjp, linear_transpose); the transpose is
  the true adjoint (rank-summed dot-product test); the backward pass runs the
  transposed calls in reverse order of the *starts*, whatever order each rank waits in.
- A started call does not hold up the next one (MPI's Isend / Irecv pattern of large
  messages completes); other calls between a start and its wait keep program order; started calls in a loop
  body, remat, a rank-dependent cond, a scan; two threads running one program each
  take their own calls.
- What XLA compiles: with `fence`s, the computation between a start and its wait is
  scheduled between the two custom calls.
- Misuse is a clear error at trace or lowering time: a collective, a second wait, a
  start without its wait, a wait in another function, `status=`, MPI.ANY_SOURCE, a
  non-vjpmpi function, a CUDA lowering.
"""

import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from helpers import BF16, WORLD, gdot, send_recv_pair
from hlo_order import assert_ordered, parse

rank, size = WORLD.rank, WORLD.size
nxt, prv = (rank + 1) % size, (rank - 1) % size
# a line, not a ring: the ends exchange with MPI.PROC_NULL
down = rank + 1 if rank + 1 < size else MPI.PROC_NULL
up = rank - 1 if rank > 0 else MPI.PROC_NULL
S = (4, 3)


def _ring(x):
    return vjpmpi.sendrecv(x, x * 2, prv, nxt, sendtag=3, recvtag=3)


def _line(x):  # PROC_NULL at the ends: the template (x + 1) is kept there
    return vjpmpi.sendrecv(x, x + 1, up, down, sendtag=4, recvtag=4)


def _split(fn):
    """`fn` with its one point-to-point call begun by vjpmpi.start and ended by
    vjpmpi.wait (a send: computation between the two)."""

    def run(x):
        if fn is send_recv_pair:  # (helpers: even ranks send to the next, odd receive)
            if rank % 2 == 0 and rank + 1 < size:
                p = vjpmpi.start(vjpmpi.send, x, rank + 1, tag=5)
                y = x * 2.0
                assert vjpmpi.wait(p) is None
                return y
            if rank % 2 == 1:
                p = vjpmpi.start(vjpmpi.recv, x, rank - 1, tag=5)
                return vjpmpi.wait(p)
            return x * 3.0
        peers = {_ring: (x * 2, prv, nxt, 3), _line: (x + 1, up, down, 4)}[fn]
        tmpl, source, dest, tag = peers
        p = vjpmpi.start(vjpmpi.sendrecv, x, tmpl, source, dest, sendtag=tag, recvtag=tag)
        return vjpmpi.wait(p)

    return run


FNS = {"ring": _ring, "line": _line, "pair": send_recv_pair}


def _data(salt, r, shape=S):
    """Rank r's array for `salt` (any rank can compute another's)."""
    return np.random.default_rng(100 * salt + r).standard_normal(shape)


def _x(salt, shape=S, dtype=np.float64):
    return jnp.asarray(_data(salt, rank, shape).astype(dtype))


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert a.tobytes() == b.tobytes(), (what, a, b)


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, BF16])
def test_same_bits_as_unsplit(name, dtype):
    fn = FNS[name]
    x = _x(1, dtype=dtype)
    want = jax.jit(fn)(x)
    _same(jax.jit(_split(fn))(x), want, "jit")
    _same(_split(fn)(x), want, "eager")


def test_values():
    """Against NumPy: the ring receives the previous rank's array; the line's ends keep
    their template."""
    x = _x(2)
    got = jax.jit(_split(_ring))(x)
    np.testing.assert_array_equal(got, _data(2, prv))
    got = jax.jit(_split(_line))(x)
    want = (np.asarray(x) + 1 if up == MPI.PROC_NULL
            else _data(2, up))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", list(FNS))
def test_derivatives_equal_unsplit(name):
    fn, split = FNS[name], _split(FNS[name])
    x, t, ct = _x(3), _x(4), _x(5)
    for f in (fn, split):
        assert jax.jit(f)(x).shape == S
    _same(jax.jit(lambda x, t: jax.jvp(split, (x,), (t,)))(x, t)[1],
          jax.jit(lambda x, t: jax.jvp(fn, (x,), (t,)))(x, t)[1], "jvp")
    vjp_split = jax.jit(lambda x, ct: jax.vjp(split, x)[1](ct)[0])(x, ct)
    _same(vjp_split, jax.jit(lambda x, ct: jax.vjp(fn, x)[1](ct)[0])(x, ct), "vjp")
    y, back = jax.vjp(split, x)  # (eager: the primitives' own evaluation)
    _same(y, jax.jit(fn)(x), "eager vjp's result")
    _same(back(ct)[0], vjp_split, "eager vjp")
    _same(jax.linear_transpose(split, x)(ct)[0], jax.linear_transpose(fn, x)(ct)[0],
          "linear_transpose")
    # the true adjoint: <ct, f(x)> summed over ranks = <f^T(ct), x> summed over ranks
    # (the line is affine: its ends keep the template x + 1; its linear part is f(x) - f(0))
    lhs = gdot(ct, jax.jit(split)(x) - jax.jit(split)(jnp.zeros_like(x)))
    np.testing.assert_allclose(lhs, gdot(vjp_split, x), rtol=1e-12)


@pytest.mark.parametrize("name", list(FNS))
def test_vmap_equals_unsplit(name):
    axis = 0 if rank % 2 == 0 else -1  # rank-dependent batching
    xb = jnp.stack([_x(6 + b) for b in range(3)], axis=axis)
    fn, split = FNS[name], _split(FNS[name])
    _same(jax.jit(jax.vmap(split, in_axes=axis))(xb),
          jax.jit(jax.vmap(fn, in_axes=axis))(xb), "vmap")
    ct = jnp.stack([_x(9 + b) for b in range(3)])
    _same(jax.jit(lambda xb, ct: jax.vjp(jax.vmap(split, in_axes=axis), xb)[1](ct)[0])(xb, ct),
          jax.jit(lambda xb, ct: jax.vjp(jax.vmap(fn, in_axes=axis), xb)[1](ct)[0])(xb, ct),
          "vjp of vmap")


def test_constant_on_one_rank():
    """Rank 0's input does not depend on what is differentiated: its transposed call
    still runs (the others wait for it) and the gradient is the unsplit one."""

    def loss(x, split):
        x = jnp.zeros_like(x) if rank == 0 else x
        f = _split(_ring) if split else _ring
        return jnp.sum(f(x) * (rank + 1))

    x = _x(12)
    _same(jax.jit(jax.grad(lambda x: loss(x, True)))(x),
          jax.jit(jax.grad(lambda x: loss(x, False)))(x), "grad")


def test_backward_in_reverse_order_of_starts():
    """Two started calls to the same peer with the same tag, waited for in rank-dependent
    order: the forward messages pair in start order, and so do the transposed ones
    (reverse start order on every rank), or the cotangents would cross."""

    def f(a, b):
        pa = vjpmpi.start(vjpmpi.sendrecv, a, a, prv, nxt, sendtag=7, recvtag=7)
        pb = vjpmpi.start(vjpmpi.sendrecv, b, b, prv, nxt, sendtag=7, recvtag=7)
        if rank % 2:
            yb, ya = vjpmpi.wait(pb), vjpmpi.wait(pa)
        else:
            ya, yb = vjpmpi.wait(pa), vjpmpi.wait(pb)
        return ya, yb

    def g(a, b):
        return (vjpmpi.sendrecv(a, a, prv, nxt, sendtag=7, recvtag=7),
                vjpmpi.sendrecv(b, b, prv, nxt, sendtag=7, recvtag=7))

    a, b, ca, cb = _x(13), _x(14) * 10, _x(15), _x(16) * 100
    for got, want in zip(jax.jit(f)(a, b), g(a, b), strict=True):
        _same(got, want, "forward")
    back = jax.jit(lambda a, b, ca, cb: jax.vjp(f, a, b)[1]((ca, cb)))(a, b, ca, cb)
    want = jax.jit(lambda a, b, ca, cb: jax.vjp(g, a, b)[1]((ca, cb)))(a, b, ca, cb)
    for got, w in zip(back, want, strict=True):
        _same(got, w, "backward")
    np.testing.assert_array_equal(back[1], _data(16, nxt) * 100)


def test_calls_between_start_and_wait():
    """An allreduce and another sendrecv between a start and its wait keep program order
    (every rank the same; the results are the unsplit program's)."""

    def f(x, split):
        if split:
            p = vjpmpi.start(vjpmpi.sendrecv, x, x, prv, nxt)
        else:
            y = vjpmpi.sendrecv(x, x, prv, nxt)
        s = vjpmpi.allreduce(x * x, MPI.SUM)
        z = vjpmpi.sendrecv(s, s, nxt, prv)
        if split:
            y = vjpmpi.wait(p)
        return y + z

    x = _x(17)
    _same(jax.jit(lambda x: f(x, True))(x), jax.jit(lambda x: f(x, False))(x), "result")
    text = jax.jit(lambda x: f(x, True)).lower(x).compile().as_text()
    assert_ordered(text)


def test_in_loop_body():
    def body(i, x):
        p = vjpmpi.start(vjpmpi.sendrecv, x, x, prv, nxt)
        x = x * 0.5
        return x + vjpmpi.wait(p)

    def plain(i, x):
        return x * 0.5 + vjpmpi.sendrecv(x, x, prv, nxt)

    x = _x(18)
    _same(jax.jit(lambda x: jax.lax.fori_loop(0, 5, body, x))(x),
          jax.jit(lambda x: jax.lax.fori_loop(0, 5, plain, x))(x), "fori_loop")
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax.lax.fori_loop(0, 3, body, x) ** 2)))(x)
    _same(g, jax.jit(jax.grad(lambda x: jnp.sum(jax.lax.fori_loop(0, 3, plain, x) ** 2)))(x),
          "grad of fori_loop")


@pytest.mark.parametrize("first", ["send", "recv"])
def test_started_call_does_not_block_the_next(first):
    """MPI's Isend / Irecv pattern: every rank starts a send of 8 MiB (or a receive), then
    makes the matching blocking call, then waits. A start that made MPI's blocking call
    would hang here: every rank's receive would queue behind its own send."""
    n = 1 << 20

    def f(x):
        if first == "send":
            p = vjpmpi.start(vjpmpi.send, x, nxt, tag=9)
            y = vjpmpi.recv(x, prv, tag=9)
            assert vjpmpi.wait(p) is None
            return y
        p = vjpmpi.start(vjpmpi.recv, x, prv, tag=9)
        vjpmpi.send(x, nxt, tag=9)
        return vjpmpi.wait(p)

    np.testing.assert_array_equal(jax.jit(f)(_x(26, (n,))), _data(26, prv, (n,)))


CONSTRUCTS = {
    "remat": jax.checkpoint,
    "cond": lambda f: lambda x: jax.lax.cond(rank % 2 == 0, f, lambda x: f(x * 2), x),
    "scan": lambda f: lambda x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=3)[0],
}


@pytest.mark.parametrize("construct", list(CONSTRUCTS))
def test_in_control_flow(construct):
    """Started calls inside remat, both branches of a rank-dependent cond, a scan body:
    the unsplit program's values and gradients."""

    def split(x):
        p = vjpmpi.start(vjpmpi.sendrecv, x, x, prv, nxt)
        y = jnp.sin(x)
        return vjpmpi.wait(p) * y

    def plain(x):
        return vjpmpi.sendrecv(x, x, prv, nxt) * jnp.sin(x)

    wrap, x = CONSTRUCTS[construct], _x(25)
    _same(jax.jit(wrap(split))(x), jax.jit(wrap(plain))(x), "value")
    _same(jax.jit(jax.grad(lambda x: jnp.sum(wrap(split)(x) ** 2)))(x),
          jax.jit(jax.grad(lambda x: jnp.sum(wrap(plain)(x) ** 2)))(x), "grad")


def test_two_threads_run_one_program():
    """Two threads run one compiled program at once, each on its own data (a sendrecv
    with MPI.PROC_NULL: each receives nothing and keeps its own template): each wait
    takes its own run's started call (keyed by XLA's run, not only by the call)."""
    f = jax.jit(lambda x: vjpmpi.wait(vjpmpi.start(
        vjpmpi.sendrecv, x, x, MPI.PROC_NULL, MPI.PROC_NULL)))
    xs = [_x(19), _x(20)]
    outs, errors = [[], []], []

    def run(i):
        try:
            outs[i] = [f(xs[i]) for _ in range(100)]
        except Exception as err:  # noqa: BLE001  (reported below, on this rank)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        for o in outs[i]:
            _same(o, xs[i], f"thread {i}")


@pytest.mark.skipif(size < 2, reason="needs a second rank")
def test_failed_run_releases_its_started_calls():
    """A run that fails between a start and its wait (rank 0's receive truncates: rank 1
    sends 10 elements where it expects 5) never reaches the wait: its started call is
    released (nothing is left waiting for a wait), and the next program runs. Ranks
    above 1 take no part."""
    x = _x(21)
    if rank == 0:
        def f(x):
            p = vjpmpi.start(vjpmpi.sendrecv, x, x, 1, 1, sendtag=8, recvtag=8)
            short = vjpmpi.recv(jnp.zeros(5), 1, tag=9)
            return vjpmpi.wait(p) + short.sum()

        with pytest.raises(Exception, match=r"vjpmpi\.recv.*(MPI_Recv|VJPMPI_CHECK)"):
            jax.jit(f)(x).block_until_ready()
    elif rank == 1:
        def f(x):
            p = vjpmpi.start(vjpmpi.sendrecv, x, x, 0, 0, sendtag=8, recvtag=8)
            vjpmpi.send(jnp.ones(10), 0, tag=9)
            return vjpmpi.wait(p)

        jax.jit(f)(x).block_until_ready()
    assert _started() == 0
    vjpmpi.barrier()
    # the next program's started calls pair as before
    f = jax.jit(lambda x: vjpmpi.wait(vjpmpi.start(
        vjpmpi.sendrecv, x, x * 2, prv, nxt, sendtag=3, recvtag=3)))
    _same(f(x), jax.jit(_ring)(x), "after the failed run")
    assert _started() == 0


# Started calls that runs stopped on purpose by a host callback leave behind (vjpmpi does
# not learn of such a stop: each holds its own buffers until the process ends).
_STOPPED = [0]


def _started() -> int:
    """The started calls that wait for their wait, less those."""
    from vjpmpi import _kernels

    return _kernels.cpu._started_calls() - _STOPPED[0]


def _own(f, *args) -> list[int]:
    """The `own` attribute of each started call in f's compiled program (0: MPI uses XLA's
    buffers; 1: the call's own, copied)."""
    text = jax.jit(f).lower(*args).compile().as_text()
    return [int(m) for m in re.findall(r"_start\b.*?own = (\d+)", text)]


def test_started_calls_use_xla_buffers_unless_something_else_can_fail():
    """A started call's messages go straight from and into XLA's buffers (no copies), which
    the program keeps until its wait, where only vjpmpi calls can stop the run (a failing
    one lets the started messages end first). A host callback anywhere in the program (in
    an enclosing function too) could stop it with MPI still using them: there the call
    copies into buffers of its own. Both give the exchange; and a run that a callback
    stops between a start and its wait leaves the next program right."""
    x = _x(41)
    want = np.asarray(jax.jit(_ring)(x))

    def started(x):
        return vjpmpi.wait(vjpmpi.start(vjpmpi.sendrecv, x, x * 2, prv, nxt, sendtag=3,
                                        recvtag=3))

    def with_callback(x):
        p = vjpmpi.start(vjpmpi.sendrecv, x, x * 2, prv, nxt, sendtag=3, recvtag=3)
        jax.debug.callback(lambda v: None, x)
        return vjpmpi.wait(p)

    def outer_callback(x):  # (the start in a nested jit, the callback outside it)
        y = jax.jit(started)(x)
        return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), y)

    assert _own(started, x) == [0]
    assert _own(lambda x: jax.lax.fori_loop(0, 2, lambda i, c: started(c), x), x) == [0]
    assert _own(with_callback, x) == [1]
    assert _own(outer_callback, x) == [1]
    for f in (started, with_callback, outer_callback):
        _same(jax.jit(f)(x), want, f.__name__)

    def fails(x):  # (a callback that raises while the started call is in flight)
        p = vjpmpi.start(vjpmpi.sendrecv, x, x * 2, prv, nxt, sendtag=3, recvtag=3)
        bad = jax.pure_callback(_raise, jax.ShapeDtypeStruct((), x.dtype), x.sum(),
                                vmap_method="sequential")
        return vjpmpi.wait(p) + bad

    assert _own(fails, x) == [1]
    before = _started()
    with pytest.raises(Exception, match="stopped by the test"):
        jax.jit(fails)(x).block_until_ready()
    assert _started() == before + 1  # (its call is left: it holds buffers of its own)
    _STOPPED[0] += 1
    vjpmpi.barrier()  # (every rank's run stopped; its started call's messages went)
    _same(jax.jit(started)(x * 3), np.asarray(jax.jit(_ring)(x * 3)), "after the stopped run")


def _raise(v):
    raise RuntimeError("stopped by the test")


@pytest.mark.skipif(size < 2, reason="needs a second rank")
def test_a_failed_run_lets_its_started_messages_end_first():
    """A direct started receive (MPI writes into XLA's buffer) whose run fails before its
    wait: the failure returns only once the message has arrived, so that MPI is done with
    the buffer before XLA frees it. Rank 1 sends the started call's message half a second
    after the failing one (a truncated receive on rank 0); rank 0's error comes after
    it. Ranks above 1 take no part."""
    def f(x):
        p = vjpmpi.start(vjpmpi.recv, jnp.zeros(5), 1, tag=11)
        short = vjpmpi.recv(jnp.zeros(5), 1, tag=12)
        return vjpmpi.wait(p) + short.sum() + x

    if rank == 0:
        assert _own(f, jnp.zeros(5)) == [0]  # (compiled before the clock starts)
    vjpmpi.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        with pytest.raises(Exception, match=r"vjpmpi\.recv.*(MPI_Recv|VJPMPI_CHECK)"):
            jax.jit(f)(jnp.zeros(5)).block_until_ready()
        took = time.perf_counter() - t0
        assert took > 0.4, f"the failure returned {took:.3f} s after the call"
    elif rank == 1:
        vjpmpi.send(jnp.ones(10), 0, tag=12)
        time.sleep(0.5)
        vjpmpi.send(jnp.full(5, 7.0), 0, tag=11)
    assert _started() == 0
    vjpmpi.barrier()


def test_started_receive_of_a_longer_message_says_what_arrived():
    """A started receive of a message longer than its template (rank 1 sends 10
    elements where rank 0's started receive holds 5) fails with the failed request's own
    error: from whom, the tag, the template's size (with the check on, both call sites
    and both sizes), as the unsplit receive says; not MPI_Testall's generic failure. Ranks
    above 1 take no part; then all go on in step."""
    from vjpmpi import _kernels

    if size < 2:
        pytest.skip("needs a second rank")
    if rank == 0:
        def f(x):
            return vjpmpi.wait(vjpmpi.start(vjpmpi.recv, jnp.zeros(5), 1, tag=9)) + x

        with pytest.raises(Exception) as info:
            jax.jit(f)(jnp.ones(5)).block_until_ready()
        text = str(info.value)
        assert "MPI_Testall" not in text and "MPI_Testsome" not in text, text
        if _kernels.CHECK:
            assert re.search(r"vjpmpi\.recv: \(VJPMPI_CHECK\) rank 1 sent float\d\d\[10\] \(send\("
                             r"dest=0, tag=9\) on float\d\d\[10\] at \S+test_split.py:\d+ \S+\) with "
                             r"tag 9, but rank 0's receive template is float\d\d\[5\] \(recv\(source=1, "
                             r"tag=9\)", text), text
        else:
            assert re.search(r"vjpmpi\.recv: the message from rank 1 \(tag 9\) is longer than "
                             r"the receive template, which holds 5 elements of float\d\d \(\d+ "
                             r"bytes\).*MPI_Irecv failed: .*[Tt]runcat", text), text
    elif rank == 1:
        vjpmpi.send(jnp.ones(10), 0, tag=9)
    assert _started() == 0
    vjpmpi.barrier()
    x = _x(22)
    f = jax.jit(lambda x: vjpmpi.wait(vjpmpi.start(vjpmpi.sendrecv, x, x * 2, prv, nxt,
                                                   sendtag=3, recvtag=3)))
    _same(f(x), jax.jit(_ring)(x), "after the failed receive")


def test_eager_start_starts():
    """Outside jit, `start` returns once the call is posted and `wait` blocks until it
    has ended, so the pattern of jitted code (start a send, receive, wait) completes for
    messages MPI sends by rendezvous (16 MiB; the eager start used to make the whole
    blocking send first, and two ranks each waited in their send for ever), in a ring
    with rank-dependent data, three times (the started calls' slots are reused)."""
    n = 4 << 20  # float32: 16 MiB
    for it in range(3):
        x = jnp.full(n, float(rank + 10 * it), jnp.float32)
        p = vjpmpi.start(vjpmpi.send, x, nxt, tag=5)
        y = vjpmpi.recv(jnp.zeros(n, jnp.float32), prv, tag=5)
        assert vjpmpi.wait(p) is None
        np.testing.assert_array_equal(np.asarray(y)[[0, n // 2, n - 1]], prv + 10 * it)
        q = vjpmpi.start(vjpmpi.recv, jnp.zeros(n, jnp.float32), prv, tag=6)
        vjpmpi.send(x * 2, nxt, tag=6)
        z = vjpmpi.wait(q)
        np.testing.assert_array_equal(np.asarray(z)[[0, n - 1]], 2 * (prv + 10 * it))
        r = vjpmpi.start(vjpmpi.sendrecv, x, jnp.zeros(n, jnp.float32), prv, nxt)
        np.testing.assert_array_equal(np.asarray(vjpmpi.wait(r))[[1, n - 2]], prv + 10 * it)
    with jax.disable_jit():  # (the same programs: compiled whatever the setting)
        s = vjpmpi.start(vjpmpi.sendrecv, x[:8], jnp.zeros(8, jnp.float32), prv, nxt)
        np.testing.assert_array_equal(np.asarray(vjpmpi.wait(s)), prv + 20)
    assert _started() == 0


def test_fenced_computation_is_scheduled_between_start_and_wait():
    """With fences after the start and around the independent computation, XLA's
    schedule runs that computation between the start and the wait custom calls."""
    big = (64, 256)

    def f(u):
        p = vjpmpi.start(vjpmpi.sendrecv, u[:1], u[-1:], prv, nxt)
        u = vjpmpi.fence(u)
        inner = vjpmpi.fence(jnp.tanh(u[1:-1]) * jnp.exp(-u[1:-1]))
        edge = vjpmpi.wait(p)
        return jnp.concatenate([edge, inner, edge])

    u = _x(21, big)
    text = jax.jit(f).lower(u).compile().as_text()
    comps, entry = parse(text)
    names = [i.name for i in comps[entry]]
    kinds = {i.name: (i.target or i.opcode) for i in comps[entry]}
    start = next(n for n in names if kinds[n] == "vjpmpi_sendrecv_start")
    wait = next(n for n in names if kinds[n] == "vjpmpi_wait_sendrecv")
    between = [n for n in names[names.index(start) + 1:names.index(wait)]
               if kinds[n] == "fusion"]
    assert between, [(n, kinds[n]) for n in names]
    want = jax.jit(lambda u: vjpmpi.sendrecv(u[:1], u[-1:], prv, nxt))(u)
    got = np.asarray(jax.jit(f)(u))
    np.testing.assert_array_equal(got[:1], want)
    np.testing.assert_allclose(got[1:-1], np.tanh(u[1:-1]) * np.exp(-u[1:-1]), rtol=1e-12)


def test_fence():
    """The identity on a pytree (values, derivatives, vmap), one ordered call per leaf."""
    tree = {"a": _x(22), "b": (jnp.arange(3), _x(23, (2,)))}
    out = jax.jit(vjpmpi.fence)(tree)
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree),
                         strict=True):
        _same(got, want, "fence")
    x = _x(24)
    _same(jax.jit(jax.grad(lambda x: jnp.sum(vjpmpi.fence(x) ** 3)))(x), 3 * x ** 2, "grad")
    _same(jax.jit(jax.vmap(vjpmpi.fence))(x), x, "vmap")
    text = jax.jit(vjpmpi.fence).lower(tree).compile().as_text()
    assert text.count('custom_call_target="vjpmpi_hold"') == 3
    with pytest.raises(TypeError, match="vjpmpi.fence: argument 'comm'"):
        vjpmpi.fence(x, comm=3)


# ----------------------------------------------------------------- misuse --
def test_collective_cannot_be_split():
    with pytest.raises(NotImplementedError, match="vjpmpi.allreduce cannot be split"):
        jax.jit(lambda x: vjpmpi.start(vjpmpi.allreduce, x, MPI.SUM)).trace(_x(0))


def test_not_a_vjpmpi_call():
    with pytest.raises(TypeError, match="argument 'op' must be vjpmpi.send"):
        vjpmpi.start(jnp.sin, _x(0))
    with pytest.raises(TypeError, match="argument 'op' must be vjpmpi.send"):  # (not its result)
        jax.jit(lambda x: vjpmpi.start(lambda t: vjpmpi.recv(t, prv) * 2, x)).trace(_x(0))
    with pytest.raises(TypeError, match="vjpmpi.wait: argument 'pending'"):
        vjpmpi.wait(_x(0))


def test_status_is_refused():
    with pytest.raises(NotImplementedError, match="'status'"):
        jax.jit(lambda x: vjpmpi.start(vjpmpi.recv, x, prv, status=MPI.Status())).trace(_x(0))


def test_any_source_is_refused():
    with pytest.raises(NotImplementedError, match="'source' of vjpmpi.recv must name a rank"):
        jax.jit(lambda x: vjpmpi.start(vjpmpi.recv, x)).trace(_x(0))  # (default: ANY_SOURCE)


def test_wait_twice():
    def f(x):
        p = vjpmpi.start(vjpmpi.sendrecv, x, x, prv, nxt)
        vjpmpi.wait(p)
        return vjpmpi.wait(p)

    with pytest.raises(ValueError, match="already waited"):
        jax.jit(f).trace(_x(0))


def test_start_without_wait():
    def f(x):
        vjpmpi.start(vjpmpi.sendrecv, x, x, prv, nxt)
        return x

    with pytest.raises(ValueError, match="has no vjpmpi.wait"):
        jax.jit(f).lower(_x(0))


def test_wait_in_another_function():
    def f(x):
        p = vjpmpi.start(vjpmpi.sendrecv, x, x, prv, nxt)
        return jax.jit(lambda x: vjpmpi.wait(p) + x)(x)

    with pytest.raises(ValueError, match="started in another function"):
        jax.jit(f).trace(_x(0))

    def g(x):  # started outside a loop, waited for inside its body
        p = vjpmpi.start(vjpmpi.sendrecv, x, x, prv, nxt)
        return jax.lax.fori_loop(0, 2, lambda i, y: y + vjpmpi.wait(p), x)

    with pytest.raises(ValueError, match="started in another function"):
        jax.jit(g).trace(_x(0))


def test_cuda_lowering_is_refused():
    def f(x):
        return vjpmpi.wait(vjpmpi.start(vjpmpi.sendrecv, x, x, prv, nxt))

    with pytest.raises(NotImplementedError, match="runs on CPU only"):
        jax.jit(f).trace(_x(0)).lower(lowering_platforms=("cuda",))
