// Each op's handler body, generic over the backend's memory policy (`Mem`) and whether
// it may run asynchronously (`Async`): the buffers' shapes and pointers into a Call,
// then Run (handlers.h) with the MPI call of mpi_ops.h / p2p.h / ragged.h as its body.
// bindings.h binds them to XLA for each backend.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "handlers.h"
#include "ragged.h"

namespace vjpmpi {

// (x, token) -> (y, token): every collective with one array in and one out.
template <bool Async, Impl F, Count N, int Uses, typename Mem>
Result<Async> Unary(Mem mem, const char* name, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    const Attrs& a) {
  Call c = MakeCall(name, a, Uses);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported) return Finish<Async>(Unsupported(name));
  c.host_op = F == OthersProduct;  // multiplies on the host
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (N == Count::kOut) {
    SetDims(yd, 0, &c.dims, &c.ndim);
  } else {
    SetDims(xd, N == Count::kInPerRank ? 1 : 0, &c.dims, &c.ndim);
  }
  SetDims(yd, 0, &c.dims2, &c.ndim2);  // (a receive's template)
  const void* xp = x.untyped_data();
  void* yp = y->untyped_data();
  size_t xb = x.size_bytes(), yb = y->size_bytes();
  return Run<Async>(mem, c, a, true, std::max(xb, yb), [&] {
    if (N == Count::kIn) {
      c.count = x.element_count();
    } else if (N == Count::kOut) {
      c.count = y->element_count();
    } else {
      int size = 1;
      MPI_Comm_size(c.comm, &size);
      c.count = x.element_count() / static_cast<size_t>(size);
    }
    c.count2 = c.count;
    return Ok();
  }, [=](Mem& mem, const Call& c) {
    const void* in = mem.In(xp, xb);
    void* out = mem.Out(yp, yb);
    std::string e = mem.Begin();
    return e.empty() ? F(c, in, out) : e;
  });
}

// (x, token) -> token
// (`started`: the array sent is copied into its buffer, unless it is direct)
template <bool Async, typename Mem>
Result<Async> SendH(Mem mem, ffi::AnyBuffer x, const Attrs& a,
                    std::shared_ptr<Started> started = nullptr) {
  Call c = MakeCall("send", a, 0);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported) return Finish<Async>(Unsupported("send"));
  c.count = c.count2 = x.element_count();
  SetDims(x.dimensions(), 0, &c.dims, &c.ndim);
  const void* xp = started && !started->direct ? Keep(started->send, x) : x.untyped_data();
  size_t xb = x.size_bytes();
  return Run<Async>(mem, c, a, false, xb, Ok, [=](Mem& mem, const Call& c) {
    const void* in = mem.In(xp, xb);
    std::string e = mem.Begin();
    if (!e.empty()) return e;
    auto blocking = [&] { return Send(c, in, nullptr); };
    return started ? PostStarted(c, in, nullptr, started, blocking) : blocking();
  }, started);
}

// (x, template, token) -> (y, token), a receive into y; `started`: into its buffer (which
// holds the template where nothing arrives, from MPI_PROC_NULL), or, direct, into y (the
// start's result).
template <bool Async, typename Mem>
Result<Async> RecvH(Mem mem, ffi::AnyBuffer tmpl, void* yp, const Attrs& a,
                    std::shared_ptr<Started> started = nullptr) {
  Call c = MakeCall("recv", a, 0);
  c.kind = KindOf(tmpl.element_type());
  if (c.kind == Kind::kUnsupported) return Finish<Async>(Unsupported("recv"));
  c.count = c.count2 = tmpl.element_count();
  SetDims(tmpl.dimensions(), 0, &c.dims, &c.ndim);
  SetDims(tmpl.dimensions(), 0, &c.dims2, &c.ndim2);
  size_t yb = tmpl.size_bytes();
  const void* tp = tmpl.untyped_data();
  if (started && !started->direct) {
    tp = yp = Receive(started->recv, tmpl, c.peer2 == MPI_PROC_NULL);
  }
  return Run<Async>(mem, c, a, false, yb, Ok, [=](Mem& mem, const Call& c) {
    mem.In(tp, yb);  // (staged where memory is: nothing arrives from MPI_PROC_NULL)
    void* out = mem.Out(yp, yb);
    std::string e = mem.Begin();
    if (!e.empty()) return e;
    auto blocking = [&] { return Recv(c, nullptr, out); };
    return started ? PostStarted(c, nullptr, out, started, blocking) : blocking();
  }, started);
}

// (x, recv template, token) -> (y, token); y aliases the template.
// (y has the template's shape and dtype; `started`: both arrays in its buffers)
template <bool Async, typename Mem>
Result<Async> SendrecvH(Mem mem, ffi::AnyBuffer x, ffi::AnyBuffer tmpl, void* yp,
                        const Attrs& a, std::shared_ptr<Started> started = nullptr) {
  Call c = MakeCall("sendrecv", a, 0);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported || KindOf(tmpl.element_type()) != c.kind) {
    return Finish<Async>(Unsupported("sendrecv"));
  }
  c.count = x.element_count();
  c.count2 = tmpl.element_count();
  SetDims(x.dimensions(), 0, &c.dims, &c.ndim);
  SetDims(tmpl.dimensions(), 0, &c.dims2, &c.ndim2);
  const bool own = started && !started->direct;  // (else y is the start's result)
  const void* xp = own ? Keep(started->send, x) : x.untyped_data();
  const void* tp = tmpl.untyped_data();
  if (own) tp = yp = Receive(started->recv, tmpl, c.peer2 == MPI_PROC_NULL);
  size_t xb = x.size_bytes(), tb = tmpl.size_bytes(), yb = tmpl.size_bytes();
  return Run<Async>(mem, c, a, false, std::max(xb, yb), Ok, [=](Mem& mem, const Call& c) {
    const void* in = mem.In(xp, xb);
    mem.In(tp, tb);  // unreceived elements keep it
    void* out = mem.Out(yp, yb);
    std::string e = mem.Begin();
    if (!e.empty()) return e;
    auto blocking = [&] { return Sendrecv(c, in, out); };
    return started ? PostStarted(c, in, out, started, blocking) : blocking();
  }, started);
}

// (a, b, token) -> (e, token): the linear recurrence scan; e may alias b.
template <bool Async, typename Mem>
Result<Async> RecurrenceH(Mem mem, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::Result<ffi::AnyBuffer> y, const Attrs& attrs) {
  Call c = MakeCall("recurrence", attrs, 0);
  c.kind = KindOf(b.element_type());
  if (AffinePair(c.kind).op == MPI_OP_NULL || KindOf(a.element_type()) != c.kind ||
      a.element_count() != b.element_count()) {
    return Finish<Async>(Unsupported("recurrence"));
  }
  c.count = c.count2 = b.element_count();
  c.host_op = true;
  SetDims(b.dimensions(), 0, &c.dims, &c.ndim);
  const void* ap = a.untyped_data();
  const void* bp = b.untyped_data();
  void* yp = y->untyped_data();
  size_t ab = a.size_bytes(), bb = b.size_bytes(), yb = y->size_bytes();
  return Run<Async>(mem, c, attrs, true, std::max({ab, bb, yb}), Ok, [=](Mem& mem, const Call& c) {
    const void* pa = mem.In(ap, ab);
    const void* pb = mem.In(bp, bb);
    void* out = mem.Out(yp, yb);
    std::string e = mem.Begin();
    return e.empty() ? Recurrence(c, pa, pb, out) : e;
  });
}

// token -> token
template <bool Async, typename Mem>
Result<Async> BarrierH(Mem mem, const Attrs& a) {
  Call c = MakeCall("barrier", a, kWaitsForAll);
  c.kind = Kind::kU8;
  return Run<Async>(mem, c, a, true, 0, Ok, [=](Mem& mem, const Call& c) {
    std::string e = mem.Begin();
    return e.empty() ? Barrier(c, nullptr, nullptr) : e;
  });
}

// The ragged exchange (ragged.h): (a0, a1, input_offsets, send_sizes,
// output_offsets, recv_sizes, token) -> (r0, r1, token). Forward: a0 the operand, a1 the
// output (r0, in place), r1 the rows received per slice (int32). Reverse (the transpose,
// `reverse`): a0 the output-shaped cotangent, a1 the operand-shaped accumulator (r0, in
// place), r1 the cotangent with its received rows zeroed. The four int32 arrays have one
// length n, a multiple of the communicator's size; `form` names the public op, `groups`
// the packed forms' segments (a batch folded into one call). Host memory only.
struct RaggedArgs {
  const char* name;
  Call c;
  std::string error;
  bool back;
  int n, f, g;
  int64_t rows_in, rows_out;
  size_t row_bytes, b0, b1, c1;
  std::vector<int64_t> block;  // what the ranks agree on: n and one row's shape
  const void *p0, *p1;
  const int32_t* meta[4];
  void *q0, *q1;

  RaggedArgs(ffi::AnyBuffer a0, ffi::AnyBuffer a1, ffi::AnyBuffer io, ffi::AnyBuffer ss,
             ffi::AnyBuffer oo, ffi::AnyBuffer rs, ffi::Result<ffi::AnyBuffer>& r0,
             ffi::Result<ffi::AnyBuffer>& r1, const Attrs& at, int64_t form, int64_t groups)
      : name(RaggedName(static_cast<int>(form))),
        c(MakeCall(name, at, kWaitsForAll | (form == kGatherv || form == kScatterv ? kUsesRoot : 0))),
        back(at.reverse != 0), f(static_cast<int>(form)), g(static_cast<int>(groups)) {
    c.kind = KindOf(a0.element_type());
    for (auto* b : {&io, &ss, &oo, &rs}) {
      if (b->element_type() != ffi::DataType::S32) {
        error = std::string("vjpmpi.") + name + ": offsets and sizes must be int32 (a vjpmpi bug)";
      }
    }
    if (c.kind == Kind::kUnsupported || KindOf(a1.element_type()) != c.kind) error = Unsupported(name);
    ffi::AnyBuffer& operand = back ? a1 : a0;  // (operand-shaped, output-shaped)
    ffi::AnyBuffer& output = back ? a0 : a1;
    auto od = operand.dimensions(), yd = output.dimensions();
    n = static_cast<int>(io.element_count());
    rows_in = od.size() ? od[0] : 0;
    rows_out = yd.size() ? yd[0] : 0;
    row_bytes = ByteSize(c.kind);
    for (size_t d = 1; d < od.size(); ++d) row_bytes *= static_cast<size_t>(od[d]);
    block.push_back(n);
    for (size_t d = 1; d < od.size(); ++d) block.push_back(od[d]);
    c.dims = block.data();
    c.ndim = static_cast<int>(block.size());
    c.count = c.count2 = operand.element_count();
    p0 = a0.untyped_data();
    p1 = a1.untyped_data();
    meta[0] = io.typed_data<int32_t>();
    meta[1] = ss.typed_data<int32_t>();
    meta[2] = oo.typed_data<int32_t>();
    meta[3] = rs.typed_data<int32_t>();
    q0 = r0->untyped_data();
    q1 = r1->untyped_data();
    b0 = a0.size_bytes();
    b1 = a1.size_bytes();
    c1 = r1->size_bytes();
  }
  RaggedArgs(const RaggedArgs&) = delete;

  std::string SizeCheck(int size) const {
    if (n % size == 0) return {};
    return std::string("vjpmpi.") + name + ": " + std::to_string(n) +
           " offsets and sizes are not a multiple of the communicator's size " +
           std::to_string(size);
  }

  // The exchange, between the ranks `peers` reaches (null: the processes of c.comm).
  std::string Exchange(const Call& call, RaggedPeers* peers) const {
    std::vector<int64_t> mine{rows_in, rows_out};
    for (const int32_t* v : meta) mine.insert(mine.end(), v, v + n);
    // (r0 holds a1, and reverse's r1 holds a0, where XLA gave them buffers of their own)
    if (q0 != p1 && b1) HostCopy(q0, p1, b1);
    if (back && q1 != p0 && c1) HostCopy(q1, p0, c1);
    void* masked = back ? q1 : nullptr;
    int32_t* received = back ? nullptr : static_cast<int32_t*>(q1);
    if (peers == nullptr) return Ragged(call, f, g, back, row_bytes, mine, n, p0, q0, masked, received);
    return RaggedWith(*peers, call, f, g, back, row_bytes, mine, n, p0, q0, masked, received);
  }
};

template <bool Async, typename Mem>
Result<Async> RaggedH(Mem mem, ffi::AnyBuffer a0, ffi::AnyBuffer a1, ffi::AnyBuffer io,
                      ffi::AnyBuffer ss, ffi::AnyBuffer oo, ffi::AnyBuffer rs,
                      ffi::Result<ffi::AnyBuffer> r0, ffi::Result<ffi::AnyBuffer> r1,
                      const Attrs& at, int64_t form, int64_t groups) {
  auto args = std::make_shared<RaggedArgs>(a0, a1, io, ss, oo, rs, r0, r1, at, form, groups);
  if (!args->error.empty()) return Finish<Async>(args->error);
  Call& c = args->c;
  return Run<Async>(mem, c, at, true, std::max(args->b0, args->b1), [&] {
    int size = 1;
    MPI_Comm_size(c.comm, &size);
    return args->SizeCheck(size);
  }, [=](decltype(mem)& m, const Call& c) {
    std::string e = m.Begin();
    return e.empty() ? args->Exchange(c, nullptr) : e;
  });
}

// How long a wait tests its call's messages itself before it hands them to the
// communicator's thread (and XLA's thread to the program's other work): what a small
// message takes to arrive, without the hand-offs. A call that thread does not poll from
// its start (Started::wait_to_end) is tested by its wait until it is done, as MPI_Wait
// would: on a busy node waking that thread took 0.1-0.6 ms, during which nothing moved
// (a started 1 MiB exchange: 2.0x mpi4py's Sendrecv where it outlasted the spin).
inline constexpr auto kWaitSpin = std::chrono::microseconds(500);

// vjpmpi.wait: the started call (comm, slot) ended: (its arrays, token) -> (y, token), y
// the array received (a direct call's: in place, y aliasing the start's result; else
// copied from the call's buffer); a send's: (x, token) -> token. The future completes when
// the call has ended.
inline ffi::Future WaitFor(int64_t comm, int64_t slot, int64_t run, void* y, size_t yb) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::shared_ptr<Started> s = TakeStarted(comm, slot, run);
  auto finish = [s, y, yb, run](ffi::Promise& promise) {
    if (!s->error.empty()) {
      ForgetRun(run);
      promise.SetError(ffi::Error::Internal(s->error));
    } else if (!s->direct && s->recv.size() != yb) {
      promise.SetError(ffi::Error::Internal("vjpmpi.wait: the started call's result does not "
                                            "have the size of the wait's (a vjpmpi bug)"));
    } else {
      if (!s->direct && yb) HostCopy(y, s->recv.data(), yb);
      promise.SetAvailable();
    }
  };
  if (s == nullptr) {
    promise.SetError(ffi::Error::Internal(
        "vjpmpi.wait: no started call to wait for (an earlier vjpmpi call of this run "
        "failed, or its start did not run: a vjpmpi bug)"));
    return future;
  }
  // (whether the program computed between the start and now: the starting thread's CPU
  // time or the process's, whichever is more; SiteRecord. The process's counts the
  // communicator's thread polling the call too: that errs towards polling from the start)
  if (s->record) {
    const int64_t beside =
        s->started_by ? std::max(s->started_by->Since(), s->started_by->ProcessSince()) : -1;
    s->record->Measured(beside, 0);
  }
  const auto until = std::chrono::steady_clock::now() + kWaitSpin;
  bool handed = false;  // (to the communicator's thread: not done within the spin)
  s->waiting.store(true, std::memory_order_release);
  for (;;) {  // (tested here a while: most messages are done by now, or soon)
    {
      std::lock_guard<std::mutex> lock(s->test_mutex);
      if (s->settled || !s->test || s->test()) break;
    }
    if (!s->wait_to_end && std::chrono::steady_clock::now() > until) {
      {  // (the program now waits for it: its thread polls it without sleeping)
        std::lock_guard<std::mutex> lock(s->test_mutex);
        if (!s->settled && s->test && !s->awaited) {
          s->awaited = true;
          AwaitedStarted().fetch_add(1, std::memory_order_relaxed);
          runtime.started_handed_over.fetch_add(1, std::memory_order_relaxed);
        }
      }
      PollStarted(s);
      handed = true;
      break;
    }
  }
  s->waiting.store(false, std::memory_order_release);
  // (the communicator's thread may sleep with this call's poll parked: it wakes to poll it)
  if (handed) PostOn(std::get<0>(s->key), [] {});
  std::unique_lock<std::mutex> lock(s->mutex);
  if (s->done) {
    lock.unlock();
    finish(promise);
  } else {
    s->then = [finish, promise]() mutable { finish(promise); };
  }
  return future;
}

}  // namespace vjpmpi
