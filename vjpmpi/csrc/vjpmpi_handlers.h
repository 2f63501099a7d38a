// XLA FFI handlers of every collective, written once for all backends.
//
// A backend file defines, before including this header:
//   VJPMPI_CTX_BIND          extra FFI bindings before the arguments (e.g. the stream)
//   VJPMPI_CTX_PARAMS_FIRST  the matching handler parameters, each followed by a comma
//   VJPMPI_MEM               an expression making the memory policy from those parameters
//   VJPMPI_RUNTIME_OWNER     (the CPU backend only) this module owns the runtime and
//                            exports it; every other module gets attach_runtime()
// and a memory policy type with:
//   void Prepare(Call&)                       before anything (may switch c.copy)
//   const void* In(const void* buf, size_t)   a pointer MPI may read
//   void* Out(void* buf, size_t)              a pointer MPI may write (aliases kept)
//   std::string Begin()                       inputs ready (e.g. stream synchronised)
//   std::string End()                         outputs in place (e.g. copied back)
// Every handler takes the ordering token last and returns it last; the token
// carries no data, it only orders the custom calls inside one XLA program.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_set>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "vjpmpi_mpi.h"
#include "vjpmpi_ragged.h"
#include "vjpmpi_runtime.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace vjpmpi {
namespace {

Kind KindOf(ffi::DataType t) {
  switch (t) {
#define VJPMPI_X(e, name, xla, mpi, bytes) \
  case ffi::DataType::xla:                 \
    return Kind::e;
    VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
    default: return Kind::kUnsupported;
  }
}

using Impl = std::string (*)(const Call&, const void*, void*);

// How the element count of one MPI block follows from the buffers.
enum class Count { kIn, kOut, kInPerRank };

struct Attrs {
  int64_t comm, red, root, peer, peer2, tag, tag2, status, reverse, site, sig, invalid;
  int64_t run;  // the XLA run id of this execution (not an attribute)
};

Call MakeCall(const char* name, const Attrs& a, int uses) {
  Call c{};
  c.op = name;
  c.comm = MPI_COMM_NULL;  // (resolved from the program's communicator number by Run)
  c.red = static_cast<Red>(a.red);
  c.root = static_cast<int>(a.root);
  c.peer = static_cast<int>(a.peer);
  c.peer2 = static_cast<int>(a.peer2);
  c.tag = static_cast<int>(a.tag);
  c.tag2 = static_cast<int>(a.tag2);
  c.status = nullptr;  // (a slot's status: Run)
  c.reverse = a.reverse != 0;
  c.uses = uses;
  return c;
}

void SetDims(const ffi::AnyBuffer::Dimensions& d, size_t skip, const int64_t** dims, int* ndim) {
  *dims = d.size() > skip ? d.begin() + skip : nullptr;
  *ndim = d.size() > skip ? static_cast<int>(d.size() - skip) : 0;
}

std::string Unsupported(const char* name) {
  return std::string("vjpmpi.") + name + ": unsupported dtype";
}

std::string SiteOf(int64_t site) {
  Runtime* rt = CurrentRuntime();
  return rt ? SiteText(*rt, site) : std::string();
}

void FillStatus(Runtime& rt, int64_t slot, const MPI_Status& st) {
  std::lock_guard<std::mutex> lock(rt.status_mutex);
  auto it = rt.statuses.find(slot);
  if (it != rt.statuses.end()) *it->second = st;  // (a dead MPI.Status has no slot)
}

// What a handler returns: an error, or (where calls may run asynchronously) a future.
template <bool Async>
using Result = std::conditional_t<Async, ffi::Future, ffi::Error>;

// The run a started call belongs to, in its key: XLA's run id; 0 for a call started by a
// program of its own (an eager vjpmpi.start: its slot is negative) and waited for by another.
inline int64_t StartedRun(int64_t slot, int64_t run) { return slot < 0 ? 0 : run; }

// A started call's copy of the array it sends (taken in the start: XLA may reuse x's
// buffer once the start has returned).
inline const void* Keep(std::vector<unsigned char>& own, ffi::AnyBuffer x) {
  own.resize(x.size_bytes());
  if (!own.empty()) HostCopy(own.data(), x.untyped_data(), own.size());
  return own.data();
}

// A started call's buffer for the array it receives; holding the template where nothing
// will arrive (from MPI_PROC_NULL, which keeps it).
inline void* Receive(std::vector<unsigned char>& own, ffi::AnyBuffer tmpl, bool keep) {
  own.resize(tmpl.size_bytes());
  if (keep && !own.empty()) HostCopy(own.data(), tmpl.untyped_data(), own.size());
  return own.data();
}

template <bool Async>
Result<Async> Finish(const std::string& e) {
  ffi::Error error = e.empty() ? ffi::Error::Success() : ffi::Error::Internal(e);
  if constexpr (Async) {
    ffi::Promise promise;
    ffi::Future future(promise);
    if (e.empty()) {
      promise.SetAvailable();
    } else {
      promise.SetError(std::move(error));
    }
    return future;
  } else {
    return error;
  }
}

// The part of a call that moves data, after Run has found its communicator: the guard
// (trace, counters, watchdog entry), the ranks' agreement on a collective
// (vjpmpi_agree.h) or the opt-in point-to-point check, the memory policy's staging
// before and after, `body(mem, c)` (the MPI call) and the receive status of a status slot.
// The ranks' agreement on a collective (vjpmpi_agree.h), on the calling thread (its
// reads of the other ranks' windows stay on the thread that runs the program; the
// guard, where there is one, does not count its wait).
inline std::string AgreeStep(Runtime& rt, Call& c, const Attrs& a, CommEntry* ce, Guard* guard) {
  c.site = a.site;
  c.site_text = &SiteOf;
  std::string invalid = a.invalid ? SiteText(rt, a.invalid) : std::string();
  if (a.invalid && invalid.empty()) invalid = "an argument error (its text is not known here)";
  if (guard) guard->Pause();
  std::string e = EnsureChannel(rt, *ce, c);
  if (e.empty()) e = Agree(rt, *ce, c, static_cast<uint64_t>(a.sig), a.run, invalid);
  if (guard) guard->Resume(ce->count);
  return e;
}

inline bool Agreeing(Runtime& rt, bool collective) {
  return collective && rt.agreement.load(std::memory_order_relaxed);
}

// (`agreed`: the agreement ran before, on the thread that posted this call, as the
// collective's number `k` there)
template <typename Mem, typename Body>
std::string Tail(Runtime& rt, Mem& mem, Call& c, const Attrs& a, CommEntry* ce, bool collective,
                 Body& body, bool agreed = false, int64_t k = 0) {
  std::string e;
  mem.Prepare(c);
  Guard guard(rt, c.op, a.site, c.comm, ce, PeerOf(c, collective), k);
  c.site = a.site;
  c.site_text = &SiteOf;
  MPI_Status status{};
  if (a.status) c.status = &status;
  if (Agreeing(rt, collective)) {
    if (!agreed) e = AgreeStep(rt, c, a, ce, &guard);
  } else {
    c.check_p2p = rt.check_enabled.load(std::memory_order_relaxed);
    if (a.invalid) {  // (its peers wait in point-to-point calls with it: they cannot be told)
      std::string why = SiteText(rt, a.invalid);
      if (why.empty()) why = std::string("vjpmpi.") + c.op + ": an argument error (its text is not known here)";
      if (!collective && ce->size > 1) {
        guard.Pause();
        AbortWith(why, " (the ranks it exchanges messages with cannot be told)");
      }
      e = why;
    }
  }
  if (e.empty()) e = body(mem, c);
  std::string end = mem.End();
  if (e.empty()) e = end;
  if (a.status) FillStatus(rt, a.status, status);
  return e;
}

// Everything a handler does around its MPI call: the communicator the program names
// (alive, and for a collective this thread's), `prepare` (what needs the communicator,
// such as its size), then Tail. `body` copies what it uses (raw pointers, not XLA's
// buffer objects): where calls may run asynchronously (Async, host memory), a call that
// moves at least the threshold (its larger side, in or out: `moved`; GoesAsync) returns
// at once and Tail runs on the communicator's thread (vjpmpi_async.h), which completes
// the future.
//
// `started` (a point-to-point call that vjpmpi.start began, between buffers of its own):
// Tail runs on the communicator's thread whatever the threshold, the handler returns at
// once, and the call's end goes to `started` (for its wait) instead of a future.
template <bool Async, typename Mem, typename Prepare, typename Body>
Result<Async> Run(Mem& mem, Call& c, const Attrs& a, bool collective, size_t moved,
                  Prepare prepare, Body body, std::shared_ptr<Started> started = nullptr) {
  Runtime* rt = CurrentRuntime();
  if (rt == nullptr) {  // only a module imported around vjpmpi/_kernels.py
    return Finish<Async>(std::string("vjpmpi.") + c.op +
                         ": this backend's module is not attached to vjpmpi's runtime "
                         "(import vjpmpi, which attaches it)");
  }
  CommEntry* ce = nullptr;
  std::string e = CheckAlive(c.op);
  if (e.empty()) e = Resolve(*rt, c, a.comm, collective, &ce);
  bool busy = false;  // (one collective at a time on a communicator, in this process)
  if (e.empty() && collective) {
    if (ce->busy.exchange(true, std::memory_order_acquire)) {
      e = std::string("vjpmpi.") + c.op + ": " + BusyError(ce->id, ce->size);
    } else {
      busy = true;
    }
  }
  if (e.empty()) e = prepare();
  if constexpr (Async) {  // (started calls exist where calls may run asynchronously)
  if (e.empty() && started) {
    if (ThreadMultiple()) {
      ce->started.fetch_add(1, std::memory_order_acq_rel);
      rt->async_calls.fetch_add(1, std::memory_order_relaxed);
      std::vector<int64_t> dims(c.dims, c.dims + c.ndim), dims2(c.dims2, c.dims2 + c.ndim2);
      PostOn(ce->id, [rt, mem, c, a, ce, collective, body, started, dims = std::move(dims),
                      dims2 = std::move(dims2)]() mutable {
        c.dims = dims.data();
        c.dims2 = dims2.data();
        std::string e = Tail(*rt, mem, c, a, ce, collective, body);
        ce->started.fetch_sub(1, std::memory_order_acq_rel);
        if (!e.empty()) ForgetRun(a.run);
        if (!started->posted || !e.empty()) started->Finish(std::move(e));
      });
    } else {
      started->Finish(Tail(*rt, mem, c, a, ce, collective, body));
    }
    return Finish<Async>(std::string());
  }
  }
  if (e.empty()) {
    if constexpr (Async) {
      const bool go = GoesAsync(moved, *ce);
      // (the agreement here, on the calling thread, before the post: on the
      // communicator's thread a later program's first collective once waited for ever
      // in MPICH, probably the blocking/nonblocking mismatch of vjpmpi_async.h's
      // GoesAsync, which that version had; not tried again since)
      if (go && Agreeing(*rt, collective)) e = AgreeStep(*rt, c, a, ce, nullptr);
      const int64_t k = go && collective ? ce->count : 0;
      if (go && e.empty()) {
        rt->async_calls.fetch_add(1, std::memory_order_relaxed);
        ffi::Promise promise;
        ffi::Future future(promise);
        // (the dimensions live in XLA's call frame, which ends when this returns)
        std::vector<int64_t> dims(c.dims, c.dims + c.ndim), dims2(c.dims2, c.dims2 + c.ndim2);
        PostOn(ce->id, [rt, mem, c, a, ce, collective, busy, body, promise, k,
                        dims = std::move(dims), dims2 = std::move(dims2)]() mutable {
          c.dims = dims.data();
          c.dims2 = dims2.data();
          std::string e = Tail(*rt, mem, c, a, ce, collective, body, true, k);
          if (busy) ce->busy.store(false, std::memory_order_release);
          if (!e.empty()) ForgetRun(a.run);
          Complete([promise, e = std::move(e)]() mutable {
            if (e.empty()) {
              promise.SetAvailable();
            } else {
              promise.SetError(ffi::Error::Internal(e));
            }
          });
        });
        return future;
      }
    }
    if (e.empty()) e = Tail(*rt, mem, c, a, ce, collective, body);
  }
  if (busy) ce->busy.store(false, std::memory_order_release);
  if (started) {  // a start that failed: its wait never comes
    started->Finish(e);
    ForgetStarted(*started);
  }
  if (!e.empty()) ForgetRun(a.run);
  return Finish<Async>(e);
}

inline std::string Ok() { return {}; }

// The MPI calls of a started call (vjpmpi.start), on the communicator's thread: its
// messages posted (Post), then polled there between the thread's jobs until they are
// done, which ends `started`. Where there is no such thread (MPI below
// MPI_THREAD_MULTIPLE: the start makes the whole call), `blocking()`.
template <typename Blocking>
std::string PostStarted(const Call& c, const void* send, void* recv,
                        const std::shared_ptr<Started>& started, Blocking blocking) {
  CommThread* thread = CurrentCommThread();
  if (thread == nullptr) return blocking();
  auto posted = std::make_shared<Posted>();
  std::string e = Post(c, send, recv, posted.get());
  if (!e.empty()) return e;
  started->posted = true;
  Runtime* rt = CurrentRuntime();
  std::vector<int64_t> dims(c.dims, c.dims + c.ndim), dims2(c.dims2, c.dims2 + c.ndim2);
  uint64_t watch = rt ? WatchCall(*rt, c.op, c.site, c.comm) : 0;  // (until its messages are done)
  thread->AddPoll([c = Call(c), posted, started, rt, watch, dims = std::move(dims),
                   dims2 = std::move(dims2)]() mutable {
    c.dims = dims.data();
    c.dims2 = dims2.data();
    bool done = false;
    std::string e = TestPosted(c, posted.get(), &done);
    if (!done) return false;
    if (rt) Unwatch(*rt, watch);
    started->Finish(std::move(e));
    return true;
  });
  return {};
}

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
// (`started`: the array sent is copied into its buffer, and the call goes there)
template <bool Async, typename Mem>
Result<Async> SendH(Mem mem, ffi::AnyBuffer x, const Attrs& a,
                    std::shared_ptr<Started> started = nullptr) {
  Call c = MakeCall("send", a, 0);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported) return Finish<Async>(Unsupported("send"));
  c.count = c.count2 = x.element_count();
  SetDims(x.dimensions(), 0, &c.dims, &c.ndim);
  const void* xp = started ? Keep(started->send, x) : x.untyped_data();
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
// holds the template where nothing arrives, from MPI_PROC_NULL).
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
  if (started) tp = yp = Receive(started->recv, tmpl, c.peer2 == MPI_PROC_NULL);
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
  const void* xp = started ? Keep(started->send, x) : x.untyped_data();
  const void* tp = tmpl.untyped_data();
  if (started) tp = yp = Receive(started->recv, tmpl, c.peer2 == MPI_PROC_NULL);
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

#define VJPMPI_ATTR_PARAMS                                                                   \
  int64_t comm, int64_t red, int64_t root, int64_t peer, int64_t peer2, int64_t tag,        \
      int64_t tag2, int64_t status, int64_t reverse, int64_t site, int64_t sig,             \
      int64_t invalid
#define VJPMPI_ATTRS_OF                                                                       \
  Attrs{comm, red, root, peer, peer2, tag, tag2, status, reverse, site, sig, invalid, run.run_id}
#define VJPMPI_ATTRS                                                                \
  .Attr<int64_t>("comm")       /* vjpmpi's number of the communicator */           \
      .Attr<int64_t>("red")    /* reduction code, see Red */                       \
      .Attr<int64_t>("root")   /* root rank */                                     \
      .Attr<int64_t>("peer")   /* destination rank */                              \
      .Attr<int64_t>("peer2")  /* source rank */                                   \
      .Attr<int64_t>("tag")    /* send tag */                                      \
      .Attr<int64_t>("tag2")   /* receive tag */                                   \
      .Attr<int64_t>("status") /* status slot to fill (a live MPI.Status), or 0 */ \
      .Attr<int64_t>("reverse") /* scans: 1 = from the last rank down */            \
      .Attr<int64_t>("site")   /* call-site hash (check/timeout), or 0 */          \
      .Attr<int64_t>("sig")    /* the program's signature on the communicator */   \
      .Attr<int64_t>("invalid") /* hash of an argument error found at trace time */

// Every handler binds the backend's context, then the execution's run id.
#define VJPMPI_BIND ffi::Ffi::Bind() VJPMPI_CTX_BIND.Ctx<ffi::RunId>()
#define VJPMPI_PARAMS_FIRST VJPMPI_CTX_PARAMS_FIRST ffi::RunId run,

// A backend that defines VJPMPI_HOST_ASYNC (the CPU) has handlers that return a future
// and run a large call on the communicator's thread (vjpmpi_async.h); the others return
// when their MPI call has.
#ifdef VJPMPI_HOST_ASYNC
constexpr bool kHostAsync = true;
#else
constexpr bool kHostAsync = false;
#endif
#define VJPMPI_DEFINE(Symbol, Impl, ...) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Symbol, Impl<kHostAsync>, __VA_ARGS__)

#define VJPMPI_UNARY(Symbol, name, F, N, Uses)                                            \
  template <bool Async>                                                                    \
  Result<Async> Symbol##Impl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::Token,            \
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,       \
                             VJPMPI_ATTR_PARAMS) {                                         \
    return Unary<Async, F, N, Uses>(VJPMPI_MEM, name, x, y, VJPMPI_ATTRS_OF);              \
  }                                                                                        \
  VJPMPI_DEFINE(Symbol, Symbol##Impl,                                                 \
                     VJPMPI_BIND                                                           \
                         .Arg<ffi::AnyBuffer>() /* x */                                    \
                         .Arg<ffi::Token>()     /* ordering token */                       \
                         .Ret<ffi::AnyBuffer>() /* y */                                    \
                         .Ret<ffi::Token>()     /* ordering token */                       \
                             VJPMPI_ATTRS)

constexpr int kRed = kUsesRed, kRoot = kUsesRoot, kAll = kWaitsForAll;
VJPMPI_UNARY(kAllreduce, "allreduce", Allreduce, Count::kIn, kRed | kAll);
VJPMPI_UNARY(kReduce, "reduce", Reduce, Count::kIn, kRed | kRoot);
VJPMPI_UNARY(kBcast, "bcast", Bcast, Count::kIn, kRoot);
VJPMPI_UNARY(kAllgather, "allgather", Allgather, Count::kIn, kAll);
VJPMPI_UNARY(kGather, "gather", Gather, Count::kIn, kRoot);
VJPMPI_UNARY(kScatter, "scatter", Scatter, Count::kOut, kRoot);
VJPMPI_UNARY(kAlltoall, "alltoall", Alltoall, Count::kInPerRank, kAll);
VJPMPI_UNARY(kReduceScatter, "reduce_scatter", ReduceScatter, Count::kOut, kRed | kAll);
VJPMPI_UNARY(kScan, "scan", Scan, Count::kIn, kRed);
VJPMPI_UNARY(kExscan, "exscan", Exscan, Count::kIn, kRed);
VJPMPI_UNARY(kOthersProduct, "others_product", OthersProduct, Count::kIn, kAll);
VJPMPI_UNARY(kAgree, "agree", AgreeOnly, Count::kIn, 0);

template <bool Async>
Result<Async> SendImpl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::Token>,
                       VJPMPI_ATTR_PARAMS) {
  return SendH<Async>(VJPMPI_MEM, x, VJPMPI_ATTRS_OF);
}
VJPMPI_DEFINE(kSend, SendImpl,
                   VJPMPI_BIND
                       .Arg<ffi::AnyBuffer>()  // x
                       .Arg<ffi::Token>()      // ordering token
                       .Ret<ffi::Token>()      // ordering token
                           VJPMPI_ATTRS);

// (template, token) -> (y, token); y may alias the template
template <bool Async>
Result<Async> RecvImpl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::Token,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                       VJPMPI_ATTR_PARAMS) {
  return RecvH<Async>(VJPMPI_MEM, x, y->untyped_data(), VJPMPI_ATTRS_OF);
}
VJPMPI_DEFINE(kRecv, RecvImpl,
                   VJPMPI_BIND
                       .Arg<ffi::AnyBuffer>()  // template
                       .Arg<ffi::Token>()      // ordering token
                       .Ret<ffi::AnyBuffer>()  // y
                       .Ret<ffi::Token>()      // ordering token
                           VJPMPI_ATTRS);

template <bool Async, typename Mem>
Result<Async> SendrecvIntoY(Mem mem, ffi::AnyBuffer x, ffi::AnyBuffer tmpl,
                            ffi::Result<ffi::AnyBuffer> y, const Attrs& a) {
  return SendrecvH<Async>(std::move(mem), x, tmpl, y->untyped_data(), a);
}

// Two arrays in, one out (which may alias the second): sendrecv, the recurrence.
#define VJPMPI_BINARY(Symbol, Handler)                                                       \
  template <bool Async>                                                                      \
  Result<Async> Symbol##Impl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer a, ffi::AnyBuffer b,        \
                             ffi::Token, ffi::Result<ffi::AnyBuffer> y,                      \
                             ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS) {                  \
    return Handler<Async>(VJPMPI_MEM, a, b, y, VJPMPI_ATTRS_OF);                             \
  }                                                                                          \
  VJPMPI_DEFINE(Symbol, Symbol##Impl,                                                   \
                     VJPMPI_BIND                                                             \
                         .Arg<ffi::AnyBuffer>() /* a */                                      \
                         .Arg<ffi::AnyBuffer>() /* b */                                      \
                         .Arg<ffi::Token>()     /* ordering token */                         \
                         .Ret<ffi::AnyBuffer>() /* y */                                      \
                         .Ret<ffi::Token>()     /* ordering token */                         \
                             VJPMPI_ATTRS)

// sendrecv: a is sent to peer; y, received from peer2, aliases b (the receive template)
VJPMPI_BINARY(kSendrecv, SendrecvIntoY);
// recurrence: a, the coefficients, and b, the inputs; y may alias b
VJPMPI_BINARY(kRecurrence, RecurrenceH);

template <bool Async>
Result<Async> BarrierImpl(VJPMPI_PARAMS_FIRST ffi::Token, ffi::Result<ffi::Token>,
                          VJPMPI_ATTR_PARAMS) {
  return BarrierH<Async>(VJPMPI_MEM, VJPMPI_ATTRS_OF);
}
VJPMPI_DEFINE(kBarrier, BarrierImpl,
                   VJPMPI_BIND
                       .Arg<ffi::Token>()  // ordering token
                       .Ret<ffi::Token>()  // ordering token
                           VJPMPI_ATTRS);

// hold: (x, token) -> (y, token), y = x in x's buffer (aliased; a copy only where XLA
// gave y a buffer of its own). No MPI, no trace, never asynchronous: a point of the
// program's order that XLA's fusion cannot cross (vjpmpi.nn's pipeline holds values there).
template <bool Async>
Result<Async> HoldImpl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::Token,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                       VJPMPI_ATTR_PARAMS) {
  (void)run;
  void* out = y->untyped_data();
  const void* in = x.untyped_data();
  auto mem = VJPMPI_MEM;
  return Finish<Async>(out == in ? std::string() : mem.Copy(out, in, x.size_bytes()));
}
VJPMPI_DEFINE(kHold, HoldImpl,
                   VJPMPI_BIND
                       .Arg<ffi::AnyBuffer>()  // x
                       .Arg<ffi::Token>()      // ordering token
                       .Ret<ffi::AnyBuffer>()  // y
                       .Ret<ffi::Token>()      // ordering token
                           VJPMPI_ATTRS);

#ifdef VJPMPI_HOST_ASYNC
// The ragged exchange (vjpmpi_ragged.h): (a0, a1, input_offsets, send_sizes,
// output_offsets, recv_sizes, token) -> (r0, r1, token). Forward: a0 the operand, a1 the
// output (r0, in place), r1 the rows received per slice (int32). Reverse (the transpose,
// `reverse`): a0 the output-shaped cotangent, a1 the operand-shaped accumulator (r0, in
// place), r1 the cotangent with its received rows zeroed. The four int32 arrays have one
// length n, a multiple of the communicator's size; `form` names the public op, `groups`
// the packed forms' segments (a batch folded into one call). Host memory only.
template <bool Async>
Result<Async> RaggedImpl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer a0, ffi::AnyBuffer a1,
                         ffi::AnyBuffer io, ffi::AnyBuffer ss, ffi::AnyBuffer oo,
                         ffi::AnyBuffer rs, ffi::Token, ffi::Result<ffi::AnyBuffer> r0,
                         ffi::Result<ffi::AnyBuffer> r1, ffi::Result<ffi::Token>,
                         VJPMPI_ATTR_PARAMS, int64_t form, int64_t groups) {
  auto mem = VJPMPI_MEM;
  Attrs at = VJPMPI_ATTRS_OF;
  const char* name = RaggedName(static_cast<int>(form));
  Call c = MakeCall(name, at, kWaitsForAll | (form == kGatherv || form == kScatterv ? kUsesRoot : 0));
  c.kind = KindOf(a0.element_type());
  for (auto* b : {&io, &ss, &oo, &rs}) {
    if (b->element_type() != ffi::DataType::S32) {
      return Finish<Async>(std::string("vjpmpi.") + name + ": offsets and sizes must be int32 (a vjpmpi bug)");
    }
  }
  if (c.kind == Kind::kUnsupported || KindOf(a1.element_type()) != c.kind) {
    return Finish<Async>(Unsupported(name));
  }
  const bool back = at.reverse != 0;
  ffi::AnyBuffer& operand = back ? a1 : a0;  // (operand-shaped, output-shaped)
  ffi::AnyBuffer& output = back ? a0 : a1;
  auto od = operand.dimensions(), yd = output.dimensions();
  const int n = static_cast<int>(io.element_count());
  const int64_t rows_in = od.size() ? od[0] : 0, rows_out = yd.size() ? yd[0] : 0;
  size_t row_bytes = ByteSize(c.kind);
  for (size_t d = 1; d < od.size(); ++d) row_bytes *= static_cast<size_t>(od[d]);
  // What the ranks agree on: n and one row's shape.
  std::vector<int64_t> block{n};
  for (size_t d = 1; d < od.size(); ++d) block.push_back(od[d]);
  c.dims = block.data();
  c.ndim = static_cast<int>(block.size());
  c.count = c.count2 = operand.element_count();
  const void* p0 = a0.untyped_data();
  const void* p1 = a1.untyped_data();
  const int32_t* meta[4] = {io.typed_data<int32_t>(), ss.typed_data<int32_t>(),
                            oo.typed_data<int32_t>(), rs.typed_data<int32_t>()};
  void* q0 = r0->untyped_data();
  void* q1 = r1->untyped_data();
  size_t b0 = a0.size_bytes(), b1 = a1.size_bytes(), c1 = r1->size_bytes();
  int g = static_cast<int>(groups);
  int f = static_cast<int>(form);
  return Run<Async>(mem, c, at, true, std::max(b0, b1), [&] {
    int size = 1;
    MPI_Comm_size(c.comm, &size);
    if (n % size != 0) {
      return std::string("vjpmpi.") + name + ": " + std::to_string(n) +
             " offsets and sizes are not a multiple of the communicator's size " + std::to_string(size);
    }
    return Ok();
  }, [=](decltype(mem)& m, const Call& c) {
    std::string e = m.Begin();
    if (!e.empty()) return e;
    std::vector<int64_t> mine{rows_in, rows_out};
    for (const int32_t* v : meta) mine.insert(mine.end(), v, v + n);
    // (r0 holds a1, and reverse's r1 holds a0, where XLA gave them buffers of their own)
    if (q0 != p1 && b1) HostCopy(q0, p1, b1);
    if (back && q1 != p0 && c1) HostCopy(q1, p0, c1);
    return Ragged(c, f, g, back, row_bytes, mine, n, p0, q0, back ? q1 : nullptr,
                  back ? nullptr : static_cast<int32_t*>(q1));
  });
}
VJPMPI_DEFINE(kRaggedAlltoall, RaggedImpl,
              VJPMPI_BIND
                  .Arg<ffi::AnyBuffer>()  // a0
                  .Arg<ffi::AnyBuffer>()  // a1
                  .Arg<ffi::AnyBuffer>()  // input_offsets
                  .Arg<ffi::AnyBuffer>()  // send_sizes
                  .Arg<ffi::AnyBuffer>()  // output_offsets
                  .Arg<ffi::AnyBuffer>()  // recv_sizes
                  .Arg<ffi::Token>()      // ordering token
                  .Ret<ffi::AnyBuffer>()  // r0
                  .Ret<ffi::AnyBuffer>()  // r1
                  .Ret<ffi::Token>()      // ordering token
                      VJPMPI_ATTRS
                  .Attr<int64_t>("form")     // which public op (RaggedForm)
                  .Attr<int64_t>("groups"));  // the packed forms' segments

// vjpmpi.start of a point-to-point call: (its arrays, token) -> token. The call runs on
// the communicator's thread between buffers of its own (Started); `slot` names it for
// its wait. Host memory only (the CPU backend).
#define VJPMPI_START_ATTRS VJPMPI_ATTRS.Attr<int64_t>("slot") /* the call, for its wait */

template <bool Async>
Result<Async> SendStartImpl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::Token>,
                            VJPMPI_ATTR_PARAMS, int64_t slot) {
  return SendH<Async>(VJPMPI_MEM, x, VJPMPI_ATTRS_OF, NewStarted(comm, slot, StartedRun(slot, run.run_id)));
}
VJPMPI_DEFINE(kSendStart, SendStartImpl,
              VJPMPI_BIND
                  .Arg<ffi::AnyBuffer>()  // x
                  .Arg<ffi::Token>()      // ordering token
                  .Ret<ffi::Token>()      // ordering token
                      VJPMPI_START_ATTRS);

template <bool Async>
Result<Async> RecvStartImpl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::Token>,
                            VJPMPI_ATTR_PARAMS, int64_t slot) {
  return RecvH<Async>(VJPMPI_MEM, x, nullptr, VJPMPI_ATTRS_OF, NewStarted(comm, slot, StartedRun(slot, run.run_id)));
}
VJPMPI_DEFINE(kRecvStart, RecvStartImpl,
              VJPMPI_BIND
                  .Arg<ffi::AnyBuffer>()  // template
                  .Arg<ffi::Token>()      // ordering token
                  .Ret<ffi::Token>()      // ordering token
                      VJPMPI_START_ATTRS);

template <bool Async>
Result<Async> SendrecvStartImpl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::AnyBuffer tmpl, ffi::Token,
                                ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS, int64_t slot) {
  return SendrecvH<Async>(VJPMPI_MEM, x, tmpl, nullptr, VJPMPI_ATTRS_OF, NewStarted(comm, slot, StartedRun(slot, run.run_id)));
}
VJPMPI_DEFINE(kSendrecvStart, SendrecvStartImpl,
              VJPMPI_BIND
                  .Arg<ffi::AnyBuffer>()  // x
                  .Arg<ffi::AnyBuffer>()  // template
                  .Arg<ffi::Token>()      // ordering token
                  .Ret<ffi::Token>()      // ordering token
                      VJPMPI_START_ATTRS);

// vjpmpi.wait: token -> (y, token), the array the started call (comm, slot) received,
// once it has; a send's: token -> token. The future completes when the call has ended.
ffi::Future WaitFor(int64_t comm, int64_t slot, int64_t run, void* y, size_t yb) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::shared_ptr<Started> s = TakeStarted(comm, slot, run);
  auto finish = [s, y, yb, run](ffi::Promise& promise) {
    if (!s->error.empty()) {
      ForgetRun(run);
      promise.SetError(ffi::Error::Internal(s->error));
    } else if (s->recv.size() != yb) {
      promise.SetError(ffi::Error::Internal("vjpmpi.wait: the started call's result does not "
                                            "have the size of the wait's (a vjpmpi bug)"));
    } else {
      if (yb) HostCopy(y, s->recv.data(), yb);
      promise.SetAvailable();
    }
  };
  if (s == nullptr) {
    promise.SetError(ffi::Error::Internal(
        "vjpmpi.wait: no started call to wait for (an earlier vjpmpi call of this run "
        "failed, or its start did not run: a vjpmpi bug)"));
    return future;
  }
  std::unique_lock<std::mutex> lock(s->mutex);
  if (s->done) {
    lock.unlock();
    finish(promise);
  } else {
    s->then = [finish, promise]() mutable { finish(promise); };
  }
  return future;
}

ffi::Future WaitImpl(ffi::RunId run, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t comm, int64_t slot) {
  return WaitFor(comm, slot, StartedRun(slot, run.run_id), y->untyped_data(), y->size_bytes());
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kWait, WaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Token>()      // ordering token
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::Token>()      // ordering token
                                  .Attr<int64_t>("comm")  // vjpmpi's number of the communicator
                                  .Attr<int64_t>("slot"));  // the started call

ffi::Future WaitSendImpl(ffi::RunId run, ffi::Token, ffi::Result<ffi::Token>, int64_t comm,
                         int64_t slot) {
  return WaitFor(comm, slot, StartedRun(slot, run.run_id), nullptr, 0);
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kWaitSend, WaitSendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Token>()      // ordering token
                                  .Ret<ffi::Token>()      // ordering token
                                  .Attr<int64_t>("comm")  // vjpmpi's number of the communicator
                                  .Attr<int64_t>("slot"));  // the started call
#endif

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::string LibraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING + 1];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  buf[len] = '\0';
  return std::string(buf, len);
}

Runtime& AttachedRuntime() {
  Runtime* rt = CurrentRuntime();
  if (rt == nullptr) {
    throw std::runtime_error(
        "vjpmpi: this module is not attached to vjpmpi's runtime (import vjpmpi, which "
        "attaches it)");
  }
  return *rt;
}

// Names passed to _guard_for_test, kept for the life of the process (the
// watchdog may read the name of the last call after it ended).
const char* Intern(const std::string& name) {
  static std::mutex mutex;
  static std::unordered_set<std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  return names.insert(name).first->c_str();
}

// What every backend module exports: its handlers, the tables Python builds its
// codes from, and test views of the runtime it uses.
void DefineCommon(nb::module_& m) {
  m.def("registrations", []() {
    nb::dict d;
#define VJPMPI_REGISTER(name, Symbol) d[name] = Capsule(Symbol);
    VJPMPI_REGISTER("allreduce", kAllreduce)
    VJPMPI_REGISTER("reduce", kReduce)
    VJPMPI_REGISTER("bcast", kBcast)
    VJPMPI_REGISTER("allgather", kAllgather)
    VJPMPI_REGISTER("gather", kGather)
    VJPMPI_REGISTER("scatter", kScatter)
    VJPMPI_REGISTER("alltoall", kAlltoall)
    VJPMPI_REGISTER("reduce_scatter", kReduceScatter)
    VJPMPI_REGISTER("scan", kScan)
    VJPMPI_REGISTER("exscan", kExscan)
    VJPMPI_REGISTER("send", kSend)
    VJPMPI_REGISTER("recv", kRecv)
    VJPMPI_REGISTER("sendrecv", kSendrecv)
    VJPMPI_REGISTER("barrier", kBarrier)
    VJPMPI_REGISTER("agree", kAgree)
    VJPMPI_REGISTER("recurrence", kRecurrence)
    VJPMPI_REGISTER("others_product", kOthersProduct)
    VJPMPI_REGISTER("hold", kHold)
#ifdef VJPMPI_HOST_ASYNC
    VJPMPI_REGISTER("ragged_alltoall", kRaggedAlltoall)
    VJPMPI_REGISTER("send_start", kSendStart)
    VJPMPI_REGISTER("recv_start", kRecvStart)
    VJPMPI_REGISTER("sendrecv_start", kSendrecvStart)
    VJPMPI_REGISTER("wait", kWait)
    VJPMPI_REGISTER("wait_send", kWaitSend)
#endif
#undef VJPMPI_REGISTER
    return d;
  });
  // The MPI library these kernels resolved at load time (checked at import
  // against the one mpi4py loaded).
  m.def("library_version", &LibraryVersion);
  // The reduction names in code order (the `red` attribute is the position) and
  // the NumPy names of the supported dtypes: vjpmpi/_mpi.py builds its codes from them.
  m.def("reductions", &ReductionNames);
  m.def("dtypes", &KindNames);
  // Test views of the runtime this module's handlers use: its address, a call
  // site's text, and one guarded "call" entered exactly as a handler enters one
  // (trace, call counter, overlap counter, watchdog entry), without MPI.
  m.def("_runtime_address", []() {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(CurrentRuntime()));
  });
  m.def("_site_for_test", [](int64_t id) { return Site(AttachedRuntime(), id, ""); });
  m.def("_guard_for_test", [](const std::string& name, int64_t site) {
    Guard guard(AttachedRuntime(), Intern(name), site, MPI_COMM_NULL);
  });
  m.attr("abi") = nb::str(VJPMPI_MPI_ABI);
  m.attr("mpi_version") =
      nb::str((std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION)).c_str());
  m.attr("status_size") = nb::int_(static_cast<int64_t>(sizeof(MPI_Status)));
  // The jaxlib whose XLA FFI headers this module was compiled against.
  m.attr("jaxlib_headers") = nb::str(VJPMPI_JAXLIB_HEADERS);
}

#ifdef VJPMPI_RUNTIME_OWNER
// The module that owns the runtime exports it (runtime_capsule(), for the other
// backends' attach_runtime) and its Python interface.
inline RuntimeHandle owned_handle = MakeRuntimeHandle(&owned_runtime);

void DefineRuntime(nb::module_& m) {
  m.def("runtime_capsule", []() {
    return nb::capsule(static_cast<const void*>(&owned_handle), kRuntimeCapsule);
  });
  // configure(check, timeout_seconds, warn_seconds): the opt-in mismatch check, the
  // watchdog's limit (0: none) and when it warns (0: never)
  m.def("configure", [](bool check, double timeout, double warn) {
    Configure(owned_runtime, check, timeout, warn);
  });
  // open_world(number): the default communicator's window, at import (collective)
  m.def("open_world", [](int64_t id) {
    std::string e = OpenWorld(owned_runtime, id);
    if (!e.empty()) throw std::runtime_error(e);
  });
  // note_refusal(number, op, root, message): a collective this rank refused at trace
  // time, for the ranks that wait in it; op "": this rank goes on with a call there (the
  // note goes if it is about that communicator's ranks). Whether a note is left.
  m.def("note_refusal", [](int64_t id, const std::string& op, int root, const std::string& message) {
    return NoteRefusal(owned_runtime, id, op, root, message);
  });
  // register_site(text) -> its hash (the `site` attribute; also argument errors' texts)
  m.def("register_site", [](const std::string& text) { return RegisterSite(owned_runtime, text); });
  // comm_number(handle) -> vjpmpi's number for the communicator (the `comm` attribute)
  m.def("comm_number", [](int64_t handle) {
    int64_t id = 0;
    std::string e = CommNumber(owned_runtime, FromHandle<MPI_Comm>(handle), &id);
    if (!e.empty()) throw std::runtime_error(e);
    return id;
  });
  // A status slot (the `status` attribute) filled at the address of a live MPI.Status;
  // release_status when the object dies (calls then fill nothing).
  m.def("register_status", [](int64_t slot, int64_t address) {
    std::lock_guard<std::mutex> lock(owned_runtime.status_mutex);
    owned_runtime.statuses[slot] = reinterpret_cast<MPI_Status*>(static_cast<uintptr_t>(address));
  });
  m.def("release_status", [](int64_t slot) {
    std::lock_guard<std::mutex> lock(owned_runtime.status_mutex);
    owned_runtime.statuses.erase(slot);
  });
  m.def("_status_slots", []() {  // (live ones, for the tests)
    std::lock_guard<std::mutex> lock(owned_runtime.status_mutex);
    return static_cast<int64_t>(owned_runtime.statuses.size());
  });
  // (collectives this process ran on a communicator, program signatures verified on it,
  // freed) for the tests; the number of collectives compared across ranks so far.
  m.def("_comm_info", [](int64_t id) {
    CommEntry* e = owned_runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    return nb::make_tuple(e->count, static_cast<int64_t>(e->verified.size()),
                          e->comm.load() == MPI_COMM_NULL);
  });
  m.def("verified_count", []() { return owned_runtime.verified.load(); });
  // The benchmark of the agreement's cost turns it off and on (benchmarks/suite.py);
  // _forget_verified makes the next run of every program on a communicator a first one.
  m.def("_set_agreement", [](bool on) { owned_runtime.agreement.store(on); });
  m.def("_forget_verified", [](int64_t id) {
    CommEntry* e = owned_runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    e->verified.clear();
    e->last_verified = 0;
    e->ran = false;
  });
  m.def("comm_alive", [](int64_t id) {
    CommEntry* e = owned_runtime.comms.Get(id);
    return e != nullptr && e->comm.load() != MPI_COMM_NULL;
  });
  m.def("open_channels", []() {
    std::lock_guard<std::mutex> lock(owned_runtime.comms.mutex);
    return static_cast<int64_t>(owned_runtime.open_channels.size());
  });
  // claim_thread(number, thread) -> the thread that owns the communicator (the first
  // to claim it), the error text for Python when that is another thread
  m.def("claim_thread", [](int64_t id, uint64_t thread) {
    CommEntry* e = owned_runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    uint64_t owner = 0;
    e->owner.compare_exchange_strong(owner, thread);
    owner = e->owner.load();
    return nb::make_tuple(owner, owner == thread ? std::string()
                                                 : ThreadError(thread, owner, id, e->size));
  });
  m.def("trace_enabled", []() { return owned_runtime.tracing; });
  // Returns and clears the recorded sequence of collectives.
  m.def("take_trace", []() {
    std::lock_guard<std::mutex> lock(owned_runtime.trace_mutex);
    std::vector<std::string> out;
    out.swap(owned_runtime.trace_log);
    return out;
  });
  // (kernel calls, calls that overlapped another running vjpmpi kernel), every backend's
  // vjpmpi calls running now (guarded, in any thread), for the tests of overlap
  m.def("_in_flight", []() { return owned_runtime.in_flight.load(); });
  m.def("_async_calls", []() { return owned_runtime.async_calls.load(); });
  // started calls (vjpmpi.start) whose wait has not taken them, and the calls the watchdog
  // watches now, for the tests of their lifetimes
  m.def("_started_calls", &StartedCount);
  m.def("_watched_calls", []() {
    return static_cast<int64_t>(InFlightCalls(owned_runtime).size());
  });
  m.def("_on_comm_thread", []() { return OnCommThread(); });
  // the smallest call (bytes, its larger side) that runs on the communicator's thread;
  // -1: none; -2 (async_auto): auto_async_bytes across nodes, none within one
  // (vjpmpi.async_threshold, VJPMPI_ASYNC_BYTES)
  m.def("set_async_bytes", [](int64_t n) { AsyncBytes().store(n); });
  m.def("async_bytes", []() { return AsyncBytes().load(); });
  m.attr("async_auto") = kAsyncAuto;
  m.attr("auto_async_bytes") = kAutoAsyncBytes;
  // set_world_nodes(node of each COMM_WORLD rank): at import (vjpmpi._mpi.default_comm),
  // before the first communicator gets its number (one numbered before counts as one node)
  m.def("set_world_nodes", [](std::vector<int> nodes) {
    std::lock_guard<std::mutex> lock(owned_runtime.comms.mutex);
    owned_runtime.world_nodes = std::move(nodes);
  });
  m.def("_spans_nodes", [](int64_t id) {
    CommEntry* e = owned_runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    return e->spans_nodes;
  });
  m.def("call_counts", []() {
    return nb::make_tuple(owned_runtime.calls.load(), owned_runtime.overlaps.load());
  });
}
#else
// A backend module that does not own the runtime is attached to the owner's.
void DefineAttach(nb::module_& m, const char* module) {
  // attach_runtime(_vjpmpi_cpu.runtime_capsule()): every handler of this module
  // then uses that runtime. Refuses (RuntimeError) a module from another build.
  m.def("attach_runtime", [module](nb::handle capsule) {
    if (!PyCapsule_IsValid(capsule.ptr(), kRuntimeCapsule)) {
      throw nb::type_error(
          (std::string("vjpmpi: ") + module + ".attach_runtime expects the capsule of "
           "_vjpmpi_cpu.runtime_capsule()").c_str());
    }
    auto* h = static_cast<const RuntimeHandle*>(
        PyCapsule_GetPointer(capsule.ptr(), kRuntimeCapsule));
    std::string e = AttachRuntime(h, module);
    if (!e.empty()) throw std::runtime_error(e);
  });
}
#endif

}  // namespace
}  // namespace vjpmpi
