"""Hypothesis fuzz of every public op with good and bad input, at any rank count.

Each example draws an op, a dtype, a shape (0-d, empty, 1-D to 3-D), roots, peers,
tags, a communicator kind, the form of the input (jax or NumPy array, non-contiguous
NumPy views, nested lists, Python and NumPy scalars), NaN/Inf payloads, a wrong
leading (rank) axis, ill-typed Python objects, and eager or jit.  Every rank draws
the same example (derandomized; checked by an allgather of its repr before any
vjpmpi call) and builds its data from (example, communicator rank), so each rank
computes the NumPy reference for all ranks itself.  Every call must either return
that reference or, for input that is bad on every rank of the communicator, raise a
TypeError / ValueError whose message starts with "vjpmpi.<op>:" at trace time,
before any MPI traffic.  A hang, a crash, another exception or a wrong value fails.

A wrong leading axis on scatter's root, which only the root can see, fails the
scatter on every rank when it runs (the root refuses it; a communicator of one rank
raises at trace time): generated on the communicators each example makes afresh, where
every rank runs the scatter's program for the first time and so compares it. (Where
another rank ran the same program before, it is already inside MPI_Scatter and cannot
be told: the job then ends with the message, tests/test_reliability.py.) Shapes or
dtypes that differ between ranks are tests/mpi/test_agreement.py's.
"""

import contextlib
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import vjpmpi
from conftest import COMM_KINDS, _make_comm
from helpers import BF16, DTYPES, WORLD, assert_equal, data, identity, np_reduce, reductions

TAG_UB = WORLD.Get_attr(MPI.TAG_UB)
RED_NAMES = ["SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR"]


def fuzz(examples):
    """Same examples on every rank (derandomized), no shrinking (see `fail_once`)."""
    return settings(derandomize=True, database=None, deadline=None, max_examples=examples,
                    suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.generate], print_blob=False)


# ------------------------------------------------------------- helpers --
_failures = {}


def fail_once(test):
    """Run a failing example only once.  Hypothesis replays a failure to report it, but
    on the failing rank alone, while its peers have gone on to the next example (or wait
    in a collective it skipped): the replay re-raises the first error without any MPI
    call, and conftest then aborts the job."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        key = (test.__name__, repr(kwargs))
        if key in _failures:
            raise _failures[key]
        try:
            test(*args, **kwargs)
        except Exception as err:
            _failures[key] = err
            raise

    return wrapper


def agree(params):
    """Fail cleanly (instead of deadlocking) if the ranks drew different examples."""
    key = hashlib.sha256(repr(sorted(params.items())).encode()).hexdigest()
    keys = WORLD.allgather(key)
    assert keys.count(key) == len(keys), f"ranks drew different examples; this one: {params}"


FRESH = ("dup", "split", "cart")  # the kinds made (and freed) for each example


@contextlib.contextmanager
def communicator(kind):
    """(comm argument, rank, size) for one of conftest's communicator kinds."""
    comm = _make_comm(kind)
    ref = WORLD if comm is None else comm
    try:
        yield comm, ref.Get_rank(), ref.Get_size()
    finally:
        if kind in FRESH:
            comm.Free()


def np_dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def is_float(dtype):
    return dtype == BF16 or dtype.kind in "fc"


def payload(shape, dtype, rank, salt, special):
    """Small integers (exact in every dtype); with `special`, about a third NaN/+Inf/-Inf."""
    x = data(shape, dtype, rank, salt)
    if special and is_float(dtype):
        pick = np.random.default_rng([salt, rank, 1]).integers(0, 9, shape)
        values = np.array([np.nan, np.inf, -np.inf, 0, 0, 0, 0, 0, 0])[pick]
        wide = np.complex128 if dtype.kind == "c" else np.float64
        x = np.where(pick < 3, values, x.astype(wide)).astype(dtype)
    return x


def as_form(x, form):
    """`x` as a jax array, a NumPy array or view, a list or a scalar (same values)."""
    if form == "jax":
        return jnp.asarray(x)
    if form == "list":
        return x.tolist()
    if form == "pyscalar" and x.ndim == 0:
        return x.item()
    if form == "npscalar" and x.ndim == 0:
        return x[()]
    if form == "strided" and x.ndim:  # every other element of a wider buffer
        return np.stack([x, np.zeros_like(x)], axis=-1)[..., 0]
    if form == "transposed" and x.ndim >= 2:  # Fortran order
        return np.ascontiguousarray(x.T).T
    if form == "reversed" and x.ndim:  # negative strides
        return np.ascontiguousarray(x[::-1])[::-1]
    return x


def converted(x, form):
    """What vjpmpi sees (jnp.asarray of the form), as NumPy."""
    return np.asarray(jnp.asarray(as_form(x, form)))


def vjpmpi_dtype(shape, dtype, form):
    return jnp.asarray(as_form(np.zeros(shape, dtype), form)).dtype


def resolve(kind, k, size):
    """A root (or peer) for a spec drawn independently of the communicator:
    (value, its index or None, exception types expected)."""
    ok = k % size
    table = {
        "ok": (ok, ok, ()),
        "np": (np.int64(ok), ok, ()),
        "bool": (True, 1, ()) if size > 1 else (True, None, (ValueError,)),
        "neg": (-3 - k % 5, None, (ValueError,)),  # -3..-7: MPI.ROOT and below
        "size": (size + k % 2, None, (ValueError,)),
        "float": (float(ok) if k % 2 else ok + 0.5, None, (TypeError,)),
        "str": (str(ok), None, (TypeError,)),
        "none": (None, None, (TypeError,)),
    }
    return table[kind]


class RefusedWhenRun(Exception):
    """Expected: an error when the op runs, naming the op and the rank that refused it at
    trace time (an argument that only that rank can check: it raised ValueError)."""


def run(op, fn, mode, errors):
    """Call fn eagerly or under jit; with expected `errors`, it must raise one naming `op`."""
    f = jax.jit(fn) if mode == "jit" else fn
    names = "/".join(sorted(e.__name__ for e in errors))
    event(f"{op}: raises {names}" if errors else f"{op}: returns")  # --hypothesis-show-statistics
    if not errors:
        return f()
    if RefusedWhenRun in errors:
        with pytest.raises(Exception) as info:
            jax.block_until_ready(f())
        text = str(info.value)
        assert f"vjpmpi.{op}: " in text and "refused it when it traced the call" in text, text
        return None
    with pytest.raises(tuple(errors)) as info:
        f()
    assert str(info.value).startswith(f"vjpmpi.{op}:"), repr(info.value)
    return None


def check(got, expected, skip_nan=False):
    """Equal in shape, dtype and value (NaN == NaN); `skip_nan`: positions where the
    reference is NaN are not compared."""
    got, expected = np.array(got), np.array(expected)
    if skip_nan and is_float(expected.dtype):
        nan = np.isnan(expected.astype(np.float64))  # MAX/MIN: real dtypes only
        got[nan], expected[nan] = 0, 0
    assert_equal(got, expected)


# ---------------------------------------------------------- strategies --
dtypes = st.sampled_from([d.name for d in DTYPES])
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)  # <= 64 elements
forms = st.sampled_from(["jax", "numpy", "strided", "transposed", "reversed", "list",
                         "pyscalar", "npscalar"])
roots = st.tuples(st.sampled_from(["ok"] * 6 + ["np", "bool"]  # mostly valid
                                  + ["neg", "size", "float", "str", "none"]), st.integers(0, 7))
leads = st.sampled_from([0, 0, 0, 0, 0, -1, 1, "0d"])  # rank axis: size + lead, or a 0-d array
common = {"dtype": dtypes, "shape": shapes, "form": forms, "special": st.booleans(),
          "comm": st.sampled_from(COMM_KINDS), "mode": st.sampled_from(["eager", "jit"]),
          "salt": st.integers(0, 2**16)}


def rank_axis_shape(p, size):
    """Local shape with a leading rank axis, and the exception types it must cause."""
    if p["lead"] == "0d":
        return (), (ValueError,)
    return (size + p["lead"], *p["shape"]), (ValueError,) if p["lead"] else ()


# ---------------------------------------------------------- reductions --
def pick_reduction(p, dtype):
    """One of the reductions defined for `dtype` or, one time in four, one that is not."""
    valid = reductions(dtype)
    bad = [r for r in RED_NAMES if r not in valid]
    names = bad if p["red_bad"] and bad else valid
    return names[p["red_pick"] % len(names)]


@pytest.mark.parametrize("op", ["allreduce", "reduce", "scan", "exscan", "reduce_scatter",
                                "sum_replicated"])
@fuzz(20)
@given(p=st.fixed_dictionaries({
    "red_pick": st.integers(0, 9), "red_bad": st.integers(0, 3).map(lambda i: i == 0),
    "red_form": st.sampled_from(["mpi", "lower", "upper"]), "root": roots, "lead": leads,
    **common}))
@fail_once
def test_reductions(op, p):
    # NaN/Inf: SUM and PROD follow IEEE arithmetic, the same in any order, so they are
    # compared exactly (NaN == NaN).  MPI leaves MAX/MIN of NaN implementation-defined
    # (MPICH's `a > b ? a : b` depends on the order), so for MAX/MIN the positions where
    # the reference is NaN are skipped and all others (Inf included) must match.
    # Complex PROD of Inf/NaN depends on the order of the products: no specials there.
    p = {"op": op, **p}
    agree(p)
    dtype = np_dtype(p["dtype"])
    # the reduction is picked for the dtype vjpmpi sees (lists become int64 / float64)
    red = pick_reduction(p, vjpmpi_dtype(p["shape"], dtype, p["form"]))
    red_arg = {"mpi": getattr(MPI, red), "lower": red.lower(), "upper": red}[p["red_form"]]
    special = p["special"] and not (dtype.kind == "c" and red == "PROD")
    with communicator(p["comm"]) as (comm, rank, size):
        errors = set()
        shape = p["shape"]
        if op == "reduce_scatter":
            shape, errs = rank_axis_shape(p, size)
            errors.update(errs)
        root, root_index, errs = resolve(*p["root"], size)
        if op == "reduce":
            errors.update(errs)
        xs = [converted(payload(shape, dtype, r, p["salt"], special), p["form"])
              for r in range(size)]
        dt = xs[0].dtype  # lists and Python scalars convert to jax's default dtypes
        if op == "sum_replicated":
            red = "SUM"
        if red not in reductions(dt):
            errors.add(TypeError)
        x = as_form(payload(shape, dtype, rank, p["salt"], special), p["form"])
        call = {
            "allreduce": lambda: vjpmpi.allreduce(x, red_arg, comm=comm),
            "reduce": lambda: vjpmpi.reduce(x, red_arg, root, comm=comm),
            "scan": lambda: vjpmpi.scan(x, red_arg, comm=comm),
            "exscan": lambda: vjpmpi.exscan(x, red_arg, comm=comm),
            "reduce_scatter": lambda: vjpmpi.reduce_scatter(x, red_arg, comm=comm),
            "sum_replicated": lambda: vjpmpi.sum_replicated(x, comm=comm),
        }[op]
        got = run(op, call, p["mode"], errors)
    if errors:
        return
    with np.errstate(all="ignore"):  # inf - inf is NaN here, as in MPI
        if op == "reduce" and rank != root_index:
            expected = xs[rank]
        elif op == "scan":
            expected = np_reduce(red, xs[: rank + 1], dt)
        elif op == "exscan":
            expected = np_reduce(red, xs[:rank], dt) if rank else identity(red, shape, dt)
        else:
            expected = np_reduce(red, xs, dt)
            if op == "reduce_scatter":
                expected = expected[rank]
    check(got, expected, skip_nan=red in ("MAX", "MIN"))


# ------------------------------------------------------- data movement --
@pytest.mark.parametrize("op", ["bcast", "allgather", "gather", "scatter", "alltoall",
                                "use_replicated", "barrier"])
@fuzz(15)
@given(p=st.fixed_dictionaries({"root": roots, "lead": leads, **common}))
# (at least once: a bad rank axis on the root of a fresh communicator, refused when run)
@example(p={"root": ("ok", 0), "lead": 1, "dtype": "float32", "shape": (2,), "form": "jax",
            "special": False, "comm": "dup", "mode": "jit", "salt": 0})
@fail_once
def test_data_movement(op, p):
    p = {"op": op, **p}
    agree(p)
    dtype, salt, special = np_dtype(p["dtype"]), p["salt"], p["special"]
    with communicator(p["comm"]) as (comm, rank, size):
        root, root_index, errors = resolve(*p["root"], size)
        errors = set(errors) if op in ("bcast", "gather", "scatter") else set()

        def local_shape(r):
            if op == "alltoall" or (op == "scatter" and r == root_index):
                shape, errs = rank_axis_shape(p, size)
                # A bad rank axis on scatter's root alone: ValueError there, and an error
                # when it runs on the ranks that wait for it (a fresh communicator)
                if op == "alltoall" or size == 1:
                    return shape, errs
                if p["comm"] in FRESH and not errors:
                    return shape, {RefusedWhenRun} if errs else ()
                return (size, *p["shape"]), ()
            return p["shape"], ()

        shape, errs = local_shape(rank)
        refused = op == "scatter" and root_index is not None and \
            local_shape(root_index)[1] == {RefusedWhenRun}
        if refused:  # (the root raises at once, the others when the scatter runs)
            errs = {ValueError} if rank == root_index else {RefusedWhenRun}
        errors.update(errs)
        x = as_form(payload(shape, dtype, rank, salt, special), p["form"])
        call = {
            "bcast": lambda: vjpmpi.bcast(x, root, comm=comm),
            "allgather": lambda: vjpmpi.allgather(x, comm=comm),
            "gather": lambda: vjpmpi.gather(x, root, comm=comm),
            "scatter": lambda: vjpmpi.scatter(x, root, comm=comm),
            "alltoall": lambda: vjpmpi.alltoall(x, comm=comm),
            "use_replicated": lambda: vjpmpi.use_replicated(x, comm=comm),
            "barrier": lambda: vjpmpi.barrier(comm=comm),
        }[op]
        got = run(op, call, p["mode"], errors)
        if refused:  # (the root goes on once the others have been told)
            WORLD.Barrier()
    if errors:
        return
    xs = [converted(payload(local_shape(r)[0], dtype, r, salt, special), p["form"])
          for r in range(size)]
    if op == "barrier":
        assert got is None
        return
    expected = {
        "bcast": lambda: xs[root_index],
        "allgather": lambda: np.stack(xs),
        "gather": lambda: np.stack(xs) if rank == root_index else xs[rank],
        "scatter": lambda: xs[root_index][rank],
        "alltoall": lambda: np.stack([xs[i][rank] for i in range(size)]),
        "use_replicated": lambda: xs[rank],
    }[op]()
    check(got, expected)


# ------------------------------------------------------ point to point --
# One fault at a time, in the call that has it (so no rank sends a message nobody
# receives): (argument, bad value kind).
P2P_FAULTS = [("dest", "size"), ("dest", "any_source"),
              ("dest", "neg"), ("dest", "float"), ("dest", "str"), ("dest", "none"),
              ("source", "size"), ("source", "neg"), ("source", "float"), ("source", "str"),
              ("tag", "any_tag"), ("tag", "neg"), ("tag", "big"), ("tag", "float"),
              ("tag", "str"), ("recvtag", "neg"), ("recvtag", "big"), ("recvtag", "float"),
              ("status", "str"), ("status", "int"), ("status", "object"), ("dtype", "mismatch")]


def bad_peer(kind, size):
    return {"size": (size, ValueError), "any_source": (MPI.ANY_SOURCE, ValueError),
            "neg": (-5, ValueError), "float": (0.0, TypeError), "str": ("0", TypeError),
            "none": (None, TypeError)}[kind]


def bad_tag(kind):
    return {"any_tag": (MPI.ANY_TAG, ValueError), "neg": (-7, ValueError),
            "big": (TAG_UB + 1, ValueError), "float": (1.0, TypeError),
            "str": ("3", TypeError)}[kind]


@pytest.mark.parametrize("op", ["send+recv", "sendrecv"])
@fuzz(30)
@given(p=st.fixed_dictionaries({
    "pattern": st.sampled_from(["ring", "null"]),
    "shift": st.integers(0, 3), "tag": st.sampled_from([0, 1, 42, 32767, TAG_UB]),
    "any_source": st.booleans(), "any_tag": st.booleans(), "status": st.booleans(),
    "fault": st.none() | st.sampled_from(P2P_FAULTS), **common}))  # half of them valid
@fail_once
def test_point_to_point(op, p):
    p = {"op": op, **p}
    agree(p)
    dtype, salt, special, form, shape = (np_dtype(p["dtype"]), p["salt"], p["special"],
                                         p["form"], p["shape"])
    fault = p["fault"] or (None, None)
    if fault[0] == "dtype" and op != "sendrecv":
        fault = (None, None)  # a recv template of another dtype is a run-time mismatch
    with communicator(p["comm"]) as (comm, rank, size):
        if p["pattern"] == "ring":
            dest, source = (rank + p["shift"]) % size, (rank - p["shift"]) % size
        else:
            dest = source = MPI.PROC_NULL
        sendtag, tag = p["tag"], p["tag"]
        recv_source = MPI.ANY_SOURCE if p["any_source"] and p["pattern"] == "ring" else source
        recvtag = MPI.ANY_TAG if p["any_tag"] else tag
        status = MPI.Status() if p["status"] else None
        errors = set()
        where, kind = fault
        if where == "dest":
            dest, err = bad_peer(kind, size)
        elif where == "source":
            recv_source, err = bad_peer(kind, size)
        elif where == "tag":
            sendtag, err = bad_tag(kind)
        elif where == "recvtag":
            recvtag, err = bad_tag(kind)
        elif where == "status":
            status, err = {"str": "s", "int": 1, "object": object()}[kind], TypeError
        tmpl_dtype = dtype
        if where == "dtype":
            tmpl_dtype, err = np.dtype(np.int32 if dtype.kind == "f" else np.float32), TypeError
            if vjpmpi_dtype(shape, tmpl_dtype, form) == vjpmpi_dtype(shape, dtype, form):
                where, tmpl_dtype = None, dtype  # e.g. two empty lists: both float64
        if where is not None:
            errors.add(err)
        x = as_form(payload(shape, dtype, rank, salt, special), form)
        template = as_form(payload(shape, tmpl_dtype, rank, salt + 1, special), form)

        def send():
            vjpmpi.send(x, dest, tag=sendtag, comm=comm)

        def recv():
            return vjpmpi.recv(template, recv_source, tag=recvtag, comm=comm, status=status)

        def send_recv():  # per cycle of the ring the lowest rank sends first: no deadlock
            if rank < math.gcd(p["shift"], size):
                send()
                return recv()
            y = recv()
            send()
            return y

        def sendrecv():
            return vjpmpi.sendrecv(x, template, recv_source, dest, sendtag=sendtag,
                                   recvtag=recvtag, comm=comm, status=status)

        # A blocking send to oneself may wait for ever (MPI allows it; MPICH does it at
        # one rank): the self ring goes through sendrecv.
        if op == "sendrecv" or (where is None and dest == rank):
            name, fn = "sendrecv", sendrecv
        elif where in ("dest", "tag"):  # only the faulty call
            name, fn = "send", send
        elif where is not None:
            name, fn = "recv", recv
        else:
            name, fn = "send+recv", send_recv

        got = run(name, fn, p["mode"], errors)
    if errors:
        return
    if p["pattern"] == "ring":
        expected = converted(payload(shape, dtype, source, salt, special), form)
    else:
        expected = converted(payload(shape, dtype, rank, salt + 1, special), form)
    check(got, expected)
    if status is not None:
        assert status.Get_source() == source
        if p["pattern"] == "ring":
            assert status.Get_tag() == tag
            assert status.Get_count(MPI.BYTE) == expected.nbytes


# ------------------------------------------------- ill-typed Python objects --
def _bad_x():
    return {
        "str": "abc", "bytes": b"ab", "dict": {"a": 1}, "set": {1, 2}, "object": object(),
        "generator": (i for i in range(3)), "list_of_str": ["a", "b"],
        "object_array": np.array([1, "a"], object), "str_array": np.array(["a", "b"]),
        "datetime": np.array(["2020-01-01"], "datetime64[D]"),
        "structured": np.zeros(2, [("a", "f4")]), "longdouble": np.ones(2, np.longdouble),
        "float8": jnp.ones(2, jnp.float8_e4m3fn), "int4": jnp.ones(2, jnp.int4),
    }


BAD = {
    "x": list(_bad_x()),
    "comm": ["str", "int", "group", "null", "freed", "inter", "op"],
    "op": ["None", "int", "mean", "empty", "padded", "MAXLOC", "REPLACE", "NO_OP", "OP_NULL",
           "user"],
    "root": ["neg", "size", "float", "str", "none", "array"],
    "dest": ["size", "any_source", "neg", "float", "str", "none"],
    "source": ["size", "neg", "float", "str", "none"],
    "tag": ["any_tag", "neg", "big", "float", "str"],
    "recvtag": ["neg", "big", "float", "str"],
    "status": ["str", "int", "object", "request", "list"],
    "recvbuf": list(_bad_x()),
}
SLOTS = {
    "allreduce": ["x", "comm", "op"], "reduce": ["x", "comm", "op", "root"],
    "bcast": ["x", "comm", "root"], "allgather": ["x", "comm"], "gather": ["x", "comm", "root"],
    "scatter": ["x", "comm", "root"], "alltoall": ["x", "comm"],
    "reduce_scatter": ["x", "comm", "op"], "scan": ["x", "comm", "op"],
    "exscan": ["x", "comm", "op"], "send": ["x", "comm", "dest", "tag"],
    "recv": ["x", "comm", "source", "tag", "status"],
    "sendrecv": ["x", "recvbuf", "comm", "dest", "source", "tag", "recvtag", "status"],
    "barrier": ["comm"], "sum_replicated": ["x", "comm"], "use_replicated": ["x", "comm"],
}


@st.composite
def bad_calls(draw):
    op = draw(st.sampled_from(list(SLOTS)))
    slot = draw(st.sampled_from(SLOTS[op]))
    return {"op": op, "slot": slot, "bad": draw(st.sampled_from(BAD[slot])),
            "mode": draw(st.sampled_from(["eager", "jit"]))}


@contextlib.contextmanager
def bad_comm(kind):
    """A bad `comm` argument (made and freed collectively on every rank)."""
    if kind == "freed":
        dup = WORLD.Dup()
        dup.Free()
        yield dup, ValueError
    elif kind == "inter" and WORLD.size > 1:
        color = WORLD.rank % 2
        local = WORLD.Split(color, WORLD.rank)
        inter = local.Create_intercomm(0, WORLD, 1 - color, tag=17)
        try:
            yield inter, TypeError
        finally:
            inter.Free()
            local.Free()
    elif kind == "null":
        yield MPI.COMM_NULL, ValueError
    else:  # (no intercommunicator at one rank: a group instead)
        yield {"str": "world", "int": 0, "group": WORLD.Get_group(), "inter": WORLD.Get_group(),
               "op": MPI.SUM}[kind], TypeError


def bad_op(kind):
    ops = {"None": None, "int": 0, "mean": "mean", "empty": "", "padded": " sum",
           "MAXLOC": MPI.MAXLOC, "REPLACE": MPI.REPLACE, "NO_OP": MPI.NO_OP,
           "OP_NULL": MPI.OP_NULL}
    return ops[kind] if kind in ops else MPI.Op.Create(lambda a, b, t: None, commute=True)


@pytest.mark.filterwarnings("ignore:Data type alias:DeprecationWarning")  # jnp.asarray(["a"])
@fuzz(60)
@given(p=bad_calls())
@fail_once
def test_bad_python_objects(p):
    agree(p)
    op, slot, bad = p["op"], p["slot"], p["bad"]
    size = WORLD.size
    args = {"x": jnp.ones((size, 2)), "recvbuf": jnp.ones((size, 2)), "op": MPI.SUM, "root": 0,
            "dest": MPI.PROC_NULL, "source": MPI.PROC_NULL, "tag": 0, "recvtag": 0,
            "comm": None, "status": None}
    with contextlib.ExitStack() as stack:
        if slot in ("x", "recvbuf"):
            value, err = _bad_x()[bad], TypeError
        elif slot == "comm":
            value, err = stack.enter_context(bad_comm(bad))
        elif slot == "op":
            value, err = bad_op(bad), ValueError
            if bad == "user":
                stack.callback(value.Free)
        elif slot == "root" and bad == "array":
            value, err = np.array([0]), TypeError
        elif slot == "root":
            value, _, (err,) = resolve(bad, 0, size)
        elif slot in ("dest", "source"):
            value, err = bad_peer(bad, size)
        elif slot in ("tag", "recvtag"):
            value, err = bad_tag("neg" if (op, bad) == ("recv", "any_tag") else bad)
        else:
            value, err = {"str": "s", "int": 1, "object": object(), "request": MPI.Request(),
                          "list": [MPI.Status()]}[bad], TypeError
        a = {**args, slot: value}
        calls = {
            "allreduce": lambda: vjpmpi.allreduce(a["x"], a["op"], comm=a["comm"]),
            "reduce": lambda: vjpmpi.reduce(a["x"], a["op"], a["root"], comm=a["comm"]),
            "bcast": lambda: vjpmpi.bcast(a["x"], a["root"], comm=a["comm"]),
            "allgather": lambda: vjpmpi.allgather(a["x"], comm=a["comm"]),
            "gather": lambda: vjpmpi.gather(a["x"], a["root"], comm=a["comm"]),
            "scatter": lambda: vjpmpi.scatter(a["x"], a["root"], comm=a["comm"]),
            "alltoall": lambda: vjpmpi.alltoall(a["x"], comm=a["comm"]),
            "reduce_scatter": lambda: vjpmpi.reduce_scatter(a["x"], a["op"], comm=a["comm"]),
            "scan": lambda: vjpmpi.scan(a["x"], a["op"], comm=a["comm"]),
            "exscan": lambda: vjpmpi.exscan(a["x"], a["op"], comm=a["comm"]),
            "send": lambda: vjpmpi.send(a["x"], a["dest"], tag=a["tag"], comm=a["comm"]),
            "recv": lambda: vjpmpi.recv(a["x"], a["source"], tag=a["tag"], comm=a["comm"],
                                        status=a["status"]),
            "sendrecv": lambda: vjpmpi.sendrecv(
                a["x"], a["recvbuf"], a["source"], a["dest"], sendtag=a["tag"],
                recvtag=a["recvtag"], comm=a["comm"], status=a["status"]),
            "barrier": lambda: vjpmpi.barrier(comm=a["comm"]),
            "sum_replicated": lambda: vjpmpi.sum_replicated(a["x"], comm=a["comm"]),
            "use_replicated": lambda: vjpmpi.use_replicated(a["x"], comm=a["comm"]),
        }
        run(op, calls[op], p["mode"], {err})


# Inputs jnp.asarray itself rejects: vjpmpi re-raises its error as a TypeError
# naming the op and the argument.  Bad on every rank, so nothing hangs.
UNCLEAR = {
    "None": lambda: None,
    "list_with_None": lambda: [1.0, None],
    "ragged_list": lambda: [[1.0, 2.0], [3.0]],
    "int_beyond_int64": lambda: 2**63,
    "masked_array": lambda: np.ma.masked_array([1.0, 2.0], mask=[0, 1]),
}


@pytest.mark.parametrize("name", list(UNCLEAR))
def test_conversion_errors_name_the_op(name):
    with pytest.raises(TypeError, match=r"^vjpmpi\.allreduce: argument 'x'"):
        vjpmpi.allreduce(UNCLEAR[name](), MPI.SUM)
