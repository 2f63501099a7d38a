"""Variable-size exchanges: `ragged_alltoall` and the v-collectives (alltoallv,
allgatherv, gatherv, scatterv).

- Values against a NumPy model of the whole exchange, built alike on every rank from a
  seed: rank-dependent operand and output rows, sizes that differ by rank, zeros, one
  rank receiving everything, a receiver filled exactly to its capacity, several slices
  per destination, slices of the operand that overlap (sent twice), jitted and eager.
- Adjoints: rank-summed dot-product tests of the exchange and of its transpose (which is
  the reverse exchange, whose transpose is the forward one again), 1e-12; JVP = the op
  on the tangents; `grad` against the NumPy model's gradient.
- vmap with batched offsets and sizes (each batch element its own plan), with the
  operand unbatched on rank 0; one compiled program reused with other counts.
- Every run-time refusal (negative size, recv/send mismatch, a slice past an output or
  an operand, overlapping received slices, a count over capacity) is the same error on
  every rank, and the ranks go on in step after it; trace-time errors name the argument.
- One FFI call per exchange in what XLA compiles, on the program's one chain with the
  other collectives whatever each rank's data dependencies; ranks that disagree on the
  exchange (a row's width, the number of slices) fail together; a CUDA lowering is refused.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import vjpmpi
from helpers import WORLD, gdot
from hlo_order import assert_ordered, collective_sequence

rank, size = WORLD.rank, WORLD.size
ROW = (2,)


# ------------------------------------------------------------ the model --
def plan(seed, per=1, mode="random", spare=2, row=ROW):
    """Every rank's arguments of one ragged_alltoall, and the NumPy results.

    mode: "random" (sizes 0-3), "zeros" (every size 0 but one slice), "skewed" (rank 0
    receives every row, the others nothing), "full" (like random, but each output has
    exactly the rows it receives: at capacity). Operand rows differ by rank, and slices
    of an operand may overlap."""
    g = np.random.default_rng(seed)
    n = size * per
    sizes = g.integers(0, 4, (size, n))  # [sender j, slice i] -> rows
    if mode == "zeros":
        sizes[:] = 0
        sizes[size - 1, 0] = 2
    elif mode == "skewed":
        sizes[:] = 0
        sizes[:, :per] = g.integers(2, 5, (size, per))
    rows_in = [int(max(sizes[j].max(), 1)) + 2 + j for j in range(size)]
    ins = [g.integers(0, rows_in[j] - sizes[j] + 1) for j in range(size)]
    # each receiver's slices, in a random order, with random gaps (none when "full")
    oo = np.zeros((size, n), np.int64)
    rows_out = []
    for r in range(size):
        incoming = [(j, r * per + s) for j in range(size) for s in range(per)]
        at = 0
        for q in g.permutation(len(incoming)):
            j, i = incoming[q]
            at += 0 if mode == "full" else int(g.integers(0, 2))
            oo[j, i] = at
            at += sizes[j, i]
        rows_out.append(at + (0 if mode == "full" else spare))
    rs = np.zeros((size, n), np.int64)
    for r in range(size):
        for j in range(size):
            for s in range(per):
                rs[r, j * per + s] = sizes[j, r * per + s]
    operands = [g.standard_normal((rows_in[j], *row)) for j in range(size)]
    outputs = [g.standard_normal((rows_out[r], *row)) for r in range(size)]
    want = [o.copy() for o in outputs]
    for j in range(size):
        for i in range(n):
            r, k = i // per, sizes[j, i]
            want[r][oo[j, i]:oo[j, i] + k] = operands[j][ins[j][i]:ins[j][i] + k]
    args = (operands[rank], outputs[rank], ins[rank], sizes[rank], oo[rank], rs[rank])
    return args, want[rank], dict(sizes=sizes, ins=ins, oo=oo, per=per)


def ragged(x, out, io, ss, oo, rs):
    return vjpmpi.ragged_alltoall(x, out, io, ss, oo, rs)


# ---------------------------------------------------------------- values --
# (rows of 2 float64 travel inside the gathered offsets and sizes; rows of 300 are too
# large for that and go as messages of their own; rows of 40, either, by rank)
@pytest.mark.parametrize("mode,per,row", [("random", 1, ROW), ("random", 2, ROW),
                                          ("zeros", 1, ROW), ("skewed", 1, ROW),
                                          ("full", 2, ROW), ("random", 1, (300,)),
                                          ("skewed", 2, (40,)), ("random", 2, (40,))])
def test_matches_the_model(mode, per, row):
    args, want, _ = plan(11 + per, per, mode, row=row)
    got = jax.jit(ragged)(*args)
    np.testing.assert_array_equal(np.asarray(got), want)
    eager = ragged(*args)
    np.testing.assert_array_equal(np.asarray(eager), want)


def test_jax_docstring_example():
    if size != 2:
        pytest.skip("the example of jax.lax.ragged_all_to_all's docstring has 2 devices")
    mine = [dict(operand=[1., 2, 2], io=[0, 1], ss=[1, 2], oo=[0, 0], rs=[1, 1]),
            dict(operand=[3., 4, 0], io=[0, 1], ss=[1, 1], oo=[1, 2], rs=[2, 1])][rank]
    y = vjpmpi.ragged_alltoall(jnp.array(mine["operand"]), jnp.zeros(4), jnp.array(mine["io"]),
                               jnp.array(mine["ss"]), jnp.array(mine["oo"]),
                               jnp.array(mine["rs"]))
    np.testing.assert_array_equal(np.asarray(y), [[1, 3, 0, 0], [2, 2, 4, 0]][rank])


def test_one_program_for_other_counts():
    f = jax.jit(lambda *a: ragged(*a))  # (a function of its own: its own cache)
    for seed in (1, 2, 3):
        args, want, _ = plan(seed, 1, "random", spare=8)
        # (one set of shapes: pad every rank's operand and output to fixed rows)
        x = np.zeros((12, *ROW)); x[:len(args[0])] = args[0]
        out = np.zeros((4 * size + 8, *ROW)); out[:len(args[1])] = args[1]
        w = out.copy(); w[:len(want)] = want
        np.testing.assert_array_equal(np.asarray(f(x, out, *args[2:])), w)
    assert f._cache_size() == 1


# ------------------------------------------------------------- adjoints --
@pytest.mark.parametrize("per,row", [(1, ROW), (2, ROW), (2, (300,))])
def test_adjoint_dot_products(per, row):
    args, _, _ = plan(21 + per, per, "random", row=row)
    x, out, *meta = map(jnp.asarray, args)
    f = jax.jit(lambda a, b: ragged(a, b, *meta))
    g = np.random.default_rng(5 + rank)
    u, v = g.standard_normal(x.shape), g.standard_normal(out.shape)
    w = g.standard_normal(out.shape)
    (tu, tv), = [jax.linear_transpose(f, x, out)(jnp.asarray(w))]
    lhs = gdot(w, f(u, v))
    rhs = gdot(tu, u) + gdot(tv, v)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)
    # the transpose is linear too, and its transpose is the forward exchange again
    ft = jax.jit(lambda c: jax.linear_transpose(f, x, out)(c))
    back = jax.linear_transpose(ft, out)((jnp.asarray(u), jnp.asarray(v)))[0]
    np.testing.assert_allclose(np.asarray(back), np.asarray(f(u, v)), rtol=1e-12, atol=1e-12)
    a, b = ft(w)
    lhs2 = gdot(u, a) + gdot(v, b)
    assert abs(lhs2 - rhs) <= 1e-12 * max(1.0, abs(rhs)), (lhs2, rhs)


def test_jvp_and_grad_against_the_model():
    args, _, m = plan(31, 2, "random")
    x, out, *meta = map(jnp.asarray, args)
    f = lambda a, b: ragged(a, b, *meta)  # noqa: E731
    g = np.random.default_rng(9 + rank)
    tx, tout = g.standard_normal(x.shape), g.standard_normal(out.shape)
    y, t = jax.jit(lambda a, b, c, d: jax.jvp(f, (a, b), (c, d)))(x, out, tx, tout)
    np.testing.assert_array_equal(np.asarray(t), np.asarray(f(tx, tout)))
    # d sum(weight * y) / d operand: each sent row collects its receiver's weights (a
    # row sent twice, twice); / d output: the weight where nothing was received
    weights = [np.random.default_rng(100 + r).standard_normal(a.shape) for r, a in
               enumerate(WORLD.allgather(np.asarray(out)))]
    gx, gout = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * weights[rank]), (0, 1)))(x, out)
    want_x = np.zeros(x.shape)
    kept = np.ones(out.shape)
    sizes, ins, oo, per = m["sizes"], m["ins"], m["oo"], m["per"]
    for i in range(size * per):
        r, k = i // per, sizes[rank, i]
        want_x[ins[rank][i]:ins[rank][i] + k] += weights[r][oo[rank, i]:oo[rank, i] + k]
    for j in range(size):
        for s in range(per):
            i = rank * per + s
            kept[oo[j, i]:oo[j, i] + sizes[j, i]] = 0
    np.testing.assert_allclose(np.asarray(gx), want_x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(gout), kept * weights[rank], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- vmap --
def test_vmap_with_batched_counts():
    plans = [plan(41 + b, 1, mode) for b, mode in enumerate(["random", "skewed", "zeros"])]
    rows_x = max(len(p[0][0]) for p in plans)
    rows_out = max(len(p[0][1]) for p in plans)

    def pad(a, rows):
        z = np.zeros((rows, *a.shape[1:]), a.dtype); z[:len(a)] = a
        return z
    xs = np.stack([pad(p[0][0], rows_x) for p in plans])
    outs = np.stack([pad(p[0][1], rows_out) for p in plans])
    metas = [np.stack([p[0][k] for p in plans]) for k in range(2, 6)]
    wants = np.stack([pad(p[1], rows_out) for p in plans])
    for b in range(3):  # (the padding rows of the output are kept as they are: zeros)
        wants[b][len(plans[b][1]):] = 0
    got = jax.jit(jax.vmap(ragged))(xs, outs, *metas)
    np.testing.assert_array_equal(np.asarray(got), wants)
    # rank 0's operand unbatched (the same rows in every batch element), on axis 1
    # elsewhere; adjoint of the batched exchange
    x0 = xs[0]
    if rank == 0:
        xb, in_x = x0, None
    else:
        xb, in_x = np.moveaxis(np.stack([x0] * 3), 0, 1), 1
    f = jax.jit(jax.vmap(ragged, in_axes=(in_x, 0, 0, 0, 0, 0)))
    got = f(xb, outs, *metas)
    want = np.stack([np.asarray(ragged(x0, outs[b], *[m[b] for m in metas])) for b in range(3)])
    np.testing.assert_array_equal(np.asarray(got), want)
    g = np.random.default_rng(77 + rank)
    w = g.standard_normal(outs.shape)
    lin = lambda a, b: f(a, b, *metas)  # noqa: E731
    tx, tout = jax.linear_transpose(lin, jnp.asarray(xb), jnp.asarray(outs))(jnp.asarray(w))
    u, v = g.standard_normal(xb.shape), g.standard_normal(outs.shape)
    lhs, rhs = gdot(w, lin(u, v)), gdot(tx, u) + gdot(tout, v)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)


# ----------------------------------------------------------- v-collectives --
def _counts(seed, lo=0, hi=4):
    return np.random.default_rng(seed).integers(lo, hi, (size, size))  # [sender, receiver]


def test_alltoallv():
    c = _counts(51)
    c[size - 1, :] = 0  # the last rank sends nothing
    cap = int(c.sum(axis=0).max())  # one rank exactly at capacity
    data = [np.random.default_rng(60 + j).standard_normal((int(c[j].sum()) + j, 3)) for j in range(size)]
    y, rc = jax.jit(lambda x, k: vjpmpi.alltoallv(x, k, capacity=cap))(data[rank], c[rank])
    want = np.zeros((cap, 3))
    at = 0
    for j in range(size):
        start = int(c[j, :rank].sum())
        want[at:at + c[j, rank]] = data[j][start:start + c[j, rank]]
        at += c[j, rank]
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_array_equal(np.asarray(rc), c[:, rank])
    # adjoint: rows past a count get zero cotangent
    f = jax.jit(lambda x: vjpmpi.alltoallv(x, c[rank], capacity=cap)[0])
    w = np.random.default_rng(70 + rank).standard_normal((cap, 3))
    (tx,) = jax.linear_transpose(f, jnp.asarray(data[rank]))(jnp.asarray(w))
    u = np.random.default_rng(80 + rank).standard_normal(data[rank].shape)
    lhs, rhs = gdot(w, f(u)), gdot(tx, u)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))
    np.testing.assert_array_equal(np.asarray(tx)[int(c[rank].sum()):], 0)


def test_allgatherv_and_gatherv():
    counts = np.random.default_rng(91).integers(0, 4, size)
    counts[0] = 0
    cap = int(counts.sum()) + 1
    xs = [np.random.default_rng(92 + j).standard_normal((3 + j, 2)) for j in range(size)]
    want = np.zeros((cap, 2))
    want[:counts.sum()] = np.concatenate([xs[j][:counts[j]] for j in range(size)])
    y, k = vjpmpi.allgatherv(xs[rank], counts[rank], capacity=cap)
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_array_equal(np.asarray(k), counts)
    for dtype in (np.uint32, np.uint64, np.int64):  # (unsigned and wide counts alike)
        y, k = vjpmpi.allgatherv(xs[rank], dtype(counts[rank]), capacity=cap)
        np.testing.assert_array_equal(np.asarray(y), want)
    root = size - 1
    y, k = jax.jit(lambda x, n: vjpmpi.gatherv(x, n, root=root, capacity=cap))(xs[rank], counts[rank])
    if rank == root:
        np.testing.assert_array_equal(np.asarray(y), want)
        np.testing.assert_array_equal(np.asarray(k), counts)
    else:
        np.testing.assert_array_equal(np.asarray(y), xs[rank])
        np.testing.assert_array_equal(np.asarray(k), 0)
    for fn in (lambda x: vjpmpi.allgatherv(x, counts[rank], capacity=cap)[0],
               lambda x: vjpmpi.gatherv(x, counts[rank], root=root, capacity=cap)[0]):
        f = jax.jit(fn)
        w = np.random.default_rng(93 + rank).standard_normal(jax.eval_shape(f, xs[rank]).shape)
        (tx,) = jax.linear_transpose(f, jnp.asarray(xs[rank]))(jnp.asarray(w))
        u = np.random.default_rng(94 + rank).standard_normal(xs[rank].shape)
        lhs, rhs = gdot(w, f(u)), gdot(tx, u)
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))


def test_scatterv():
    root = 0
    counts = np.random.default_rng(95).integers(0, 4, size)
    counts[-1] = 3
    x = np.random.default_rng(96).standard_normal((int(counts.sum()) + 1, 2))
    mine = x if rank == root else np.zeros((1, 2))
    y, k = jax.jit(lambda a, n: vjpmpi.scatterv(a, n, root=root, capacity=3))(mine, counts)
    start = int(counts[:rank].sum())
    want = np.zeros((3, 2))
    want[:counts[rank]] = x[start:start + counts[rank]]
    np.testing.assert_array_equal(np.asarray(y), want)
    assert int(k) == counts[rank]
    f = jax.jit(lambda a: vjpmpi.scatterv(a, counts, root=root, capacity=3)[0])
    w = np.random.default_rng(97 + rank).standard_normal((3, 2))
    (tx,) = jax.linear_transpose(f, jnp.asarray(mine))(jnp.asarray(w))
    u = np.random.default_rng(98 + rank).standard_normal(mine.shape)
    lhs, rhs = gdot(w, f(u)), gdot(tx, u)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))


# ------------------------------------------------------------- refusals --
def _refused(fn, *args, match):
    with pytest.raises(Exception, match=match) as info:
        jax.block_until_ready(fn(*args))
    return str(info.value)


@pytest.mark.parametrize("bad", ["negative", "mismatch", "past_output", "past_operand",
                                 "overlap"])
def test_bad_counts_fail_on_every_rank(bad):
    args, want, _ = plan(61, 1, "random")
    x, out, io, ss, oo, rs = (np.array(a) for a in args)
    last = size - 1
    if bad == "negative" and rank == last:
        ss[0] = -1
    if bad == "mismatch" and rank == last:
        rs[0] += 1
    if bad == "past_output" and rank == last:
        oo[0] = len(out) + 5 if size == 1 else 10**6
    if bad == "past_operand" and rank == last:
        io[0] = len(x)
        ss[0] = max(ss[0], 1)
        if size == 1:
            rs[0] = ss[0]
    if bad == "overlap":
        if size == 1:
            pytest.skip("one slice per rank: nothing to overlap with at one rank")
        if rank == 0:  # ranks 0 and 1 send to rank 0 at the same row
            ss[0], oo[0] = 2, 0
            rs[0], rs[1] = 2, 2
        if rank == 1:
            ss[0], oo[0] = 2, 1
        io[0] = 0
        x = np.zeros((max(len(x), 3), *ROW))
        out = np.zeros((max(len(out), 4), *ROW))
    match = {"negative": rf"rank {last}'s send_sizes\[0\]=-1 is negative",
             "mismatch": r"rank \d+'s recv_sizes\[\d+\]=\d+ differs from what rank \d+ sends",
             "past_output": r"ends past rank 0's output",
             "past_operand": rf"rank {last}'s slice 0 .* ends past its operand",
             "overlap": r"rank 0's output receives overlapping slices"}[bad]
    text = _refused(jax.jit(ragged), x, out, io, ss, oo, rs, match="vjpmpi.ragged_alltoall: .*" + match)
    assert "every rank of the call stops here" in text
    # every rank has the same text, and the ranks go on in step
    texts = WORLD.allgather(text[text.index("vjpmpi.ragged"):].splitlines()[0])
    assert len(set(texts)) == 1, texts
    np.testing.assert_array_equal(np.asarray(jax.jit(ragged)(*args)), want)


def test_v_collectives_refuse_counts_past_capacity_or_negative():
    k = np.full(size, 2)
    text = _refused(lambda: vjpmpi.alltoallv(jnp.ones((2 * size, 1)), k, capacity=2 * size - 1),
                    match=r"vjpmpi.alltoallv: rank \d+ receives \d+ rows in all, more than its "
                          rf"capacity={2 * size - 1}")
    assert len(set(WORLD.allgather(text.splitlines()[-1]))) == 1
    neg = -1 if rank == 0 else 1
    _refused(lambda: vjpmpi.allgatherv(jnp.ones((2, 1)), neg, capacity=2 * size),
             match=r"vjpmpi.allgatherv: rank 0's count=-1 is negative")
    _refused(lambda: vjpmpi.gatherv(jnp.ones((2, 1)), 3, root=0, capacity=9),
             match=r"vjpmpi.gatherv: rank 0's count=3 is more than the 2 rows of rank 0's x")
    counts = np.array([2] * size)
    _refused(lambda: vjpmpi.scatterv(jnp.ones((2 * size, 1)), counts, root=0, capacity=1),
             match=r"vjpmpi.scatterv: rank 0 receives 2 rows in all, more than its capacity=1")
    y, k = vjpmpi.allgatherv(jnp.ones((2, 1)), 1, capacity=size)  # in step after them
    np.testing.assert_array_equal(np.asarray(y), 1)


def test_v_collectives_name_the_running_sum_past_the_rows_of_x():
    """Counts that each fit x but whose running sum does not: the refusal names the sum
    and its terms (it used to name the last count alone, "counts[1]=2 is more than the 3
    rows"), the same text on every rank; the ranks go on in step."""
    rows = 2 * size - 1  # (one row short of two each)
    counts = np.full(size, 2)
    last = size - 1
    terms = " + ".join(["2"] * size)
    if size == 1:
        want = r"the root's \(rank 0\) counts\[0\]=2 is more than the 1 rows of the root's x"
    else:
        want = (rf"the root's \(rank 0\) counts sum to {2 * size} \(counts\[0\.\.{last}\] = "
                rf"{re.escape(terms)}\), more than the {rows} rows of the root's x")
    text = _refused(lambda: vjpmpi.scatterv(jnp.ones((rows, 1)), counts, root=0, capacity=2),
                    match=r"vjpmpi\.scatterv: " + want)
    assert len(set(WORLD.allgather(text[text.index("vjpmpi.scatterv"):].splitlines()[0]))) == 1
    # alltoallv: only the last rank's send_counts overrun its x
    k = np.full(size, 2) if rank == last else np.ones(size, np.int64)
    if size == 1:
        want = rf"rank 0's send_counts\[0\]=2 is more than the {rows} rows of rank 0's x"
    else:
        want = (rf"rank {last}'s send_counts sum to {2 * size} \(send_counts\[0\.\.{last}\] = "
                rf"{re.escape(terms)}\), more than the {rows} rows of rank {last}'s x")
    text = _refused(lambda: vjpmpi.alltoallv(jnp.ones((rows, 1)), k, capacity=2 * size),
                    match=r"vjpmpi\.alltoallv: " + want)
    assert len(set(WORLD.allgather(text[text.index("vjpmpi.alltoallv"):].splitlines()[0]))) == 1
    y, _ = vjpmpi.allgatherv(jnp.ones((2, 1)), 1, capacity=size)  # in step after them
    np.testing.assert_array_equal(np.asarray(y), 1)



def test_gatherv_root_capacity_refusal_reaches_every_rank():
    """Only the root reads `capacity`: a bad one raises ValueError there at trace time,
    and the ranks waiting in the gatherv for it stop with the same message (they used to
    wait for ever); all go on in step."""
    root = size - 1
    message = r"vjpmpi\.gatherv: argument 'capacity'=-1 must be in 0\.\.2\*\*31 - 1"
    with pytest.raises(Exception, match=message) as info:
        vjpmpi.gatherv(jnp.ones((2, 1)), 1, root=root, capacity=-1 if rank == root else 4)
    if rank == root:
        assert info.type is ValueError
    WORLD.Barrier()
    y, k = vjpmpi.allgatherv(jnp.ones((2, 1)), 1, capacity=size)  # in step after it
    np.testing.assert_array_equal(np.asarray(k), 1)

def test_trace_time_errors_name_the_argument():
    x = jnp.ones((4, 2))
    m = jnp.zeros(size, jnp.int32)
    with pytest.raises(ValueError, match="vjpmpi.ragged_alltoall: argument 'input_offsets' must "
                                         "be one-dimensional with a length that is a multiple"):
        vjpmpi.ragged_alltoall(x, x, jnp.zeros((size, 1), jnp.int32), m, m, m)
    with pytest.raises(TypeError, match="argument 'send_sizes' must be an integer array"):
        vjpmpi.ragged_alltoall(x, x, m, m.astype(jnp.float32), m, m)
    with pytest.raises(TypeError, match="argument 'output' .* must have the dtype and row shape"):
        vjpmpi.ragged_alltoall(x, jnp.ones((4, 3)), m, m, m, m)
    with pytest.raises(ValueError, match="vjpmpi.alltoallv: argument 'send_counts' must have "
                                         rf"shape \({size},\)"):
        vjpmpi.alltoallv(x, jnp.zeros(size + 1, jnp.int32), capacity=4)
    with pytest.raises(TypeError, match="vjpmpi.allgatherv: argument 'capacity' must be a Python int"):
        vjpmpi.allgatherv(x, 1, capacity=3.0)
    with pytest.raises(ValueError, match="vjpmpi.gatherv: argument 'root'=99 is outside"):
        vjpmpi.gatherv(x, 1, root=99, capacity=4)


# ------------------------------------------------------ what XLA compiles --
def test_one_custom_call_per_exchange_and_no_cuda():
    args, _, _ = plan(71, 1, "random")
    hlo = jax.jit(ragged).lower(*args).compile().as_text()
    assert hlo.count('custom_call_target="vjpmpi_ragged_alltoall"') == 1, hlo
    grad_hlo = jax.jit(jax.grad(lambda a, b: jnp.sum(ragged(a, b, *args[2:]) ** 2), (0, 1))).lower(
        *args[:2]).compile().as_text()
    assert grad_hlo.count('custom_call_target="vjpmpi_ragged_alltoall"') == 2, grad_hlo
    with pytest.raises(NotImplementedError, match="vjpmpi.ragged_alltoall: has no CUDA kernel"):
        jax.jit(ragged).trace(*args).lower(lowering_platforms=("cuda",))


def test_in_program_order_whatever_the_data_dependencies():
    """Even ranks feed an allreduce's result into the exchange, odd ranks feed the
    exchange's result into an allgather: one chain, allreduce -> exchange -> allgather."""
    args, want, _ = plan(81, 1, "random")
    x, out, *meta = map(jnp.asarray, args)

    def f(x, out):
        s = vjpmpi.allreduce(jnp.ones(3), MPI.SUM)
        y = ragged(x + 0.0 * jnp.sum(s) if rank % 2 == 0 else x, out, *meta)
        g = vjpmpi.allgather(jnp.sum(y) if rank % 2 else jnp.float64(1.0))
        return y, s, g

    hlo = jax.jit(f).lower(x, out).compile().as_text()
    assert_ordered(hlo)
    assert collective_sequence(hlo) == ["allreduce", "ragged_alltoall", "allgather"]
    y, s, g = jax.jit(f)(x, out)
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_array_equal(np.asarray(s), size)
    sums = WORLD.allgather(float(jnp.sum(y)))
    np.testing.assert_allclose(np.asarray(g), [sums[r] if r % 2 else 1.0 for r in range(size)])


@pytest.mark.parametrize("what", ["width", "slices"])
def test_ranks_that_disagree_fail_together(what):
    """(on a fresh communicator: a program new to every rank, which every rank compares;
    a rank that runs a program it has verified is inside MPI already, and the job ends)"""
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    last = rank == size - 1
    width = 3 if (what == "width" and last) else 2
    n = size * (2 if (what == "slices" and last) else 1)
    m = jnp.zeros(n, jnp.int32)
    comm = WORLD.Dup()
    with pytest.raises(Exception, match=r"(the ranks disagree|collective mismatch).*shape differs"):
        jax.block_until_ready(vjpmpi.ragged_alltoall(
            jnp.ones((2, width)), jnp.ones((2, width)), m, m, m, m, comm=comm))
    y, _ = vjpmpi.allgatherv(jnp.ones((2, 1)), 1, capacity=size, comm=comm)  # in step after it
    np.testing.assert_array_equal(np.asarray(y), 1)
    comm.Free()
