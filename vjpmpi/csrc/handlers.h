// The XLA FFI handlers' common path, written once for every backend (module layer:
// compiled into each backend module, on the core library's API). A backend (a struct,
// bindings.h) brings a memory policy `Mem`, made for each call, with:
//   void Prepare(Call&)                       before anything (may switch c.copy)
//   const void* In(const void* buf, size_t)   a pointer MPI may read
//   void* Out(void* buf, size_t)              a pointer MPI may write (aliases kept)
//   std::string Begin()                       inputs ready (e.g. stream synchronised)
//   std::string End()                         outputs in place (e.g. copied back)
//   std::string Copy(void*, const void*, size_t)  a local copy (hold)
// Per call: Run (communicator, busy flag, asynchronous or not), then Tail (guard,
// agreement, staging, the MPI call: mpi_ops.h / p2p.h). handler_ops.h builds each op's
// handler on these, bindings.h binds them to XLA.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "agree.h"
#include "async.h"
#include "mpi_ops.h"
#include "p2p.h"
#include "runtime.h"
#include "xla/ffi/api/ffi.h"

namespace vjpmpi {
// What a handler that may run its call asynchronously returns: the call's end where it
// ended on the calling thread (an error, or none), else the future its thread completes.
// XLA gets an XLA_FFI_Error* in the first case (no future for it to create, wait on and
// free: most calls are small and end where they start), an XLA_FFI_Future* in the second.
struct Outcome {
  std::string error;                  // (a call that ended here)
  std::optional<xla::ffi::Future> future;  // (a call that goes on elsewhere)
};
}  // namespace vjpmpi

// An Outcome as XLA takes it (the encoding XLA's FFI documents for handlers that can
// return either an error or a future).
template <xla::ffi::ExecutionStage stage>
struct xla::ffi::ResultEncoding<stage, vjpmpi::Outcome> {
  static std::variant<XLA_FFI_Error*, XLA_FFI_Future*> Encode(const XLA_FFI_Api* api,
                                                               XLA_FFI_ExecutionContext* ctx,
                                                               vjpmpi::Outcome outcome) {
    if (outcome.future) {
      return ResultEncoding<stage, Future>::Encode(api, ctx, std::move(*outcome.future));
    }
    if (outcome.error.empty()) return static_cast<XLA_FFI_Error*>(nullptr);
    return internal::CreateError(api, Error::Internal(std::move(outcome.error)));
  }
};

namespace vjpmpi {

namespace ffi = xla::ffi;

inline Kind KindOf(ffi::DataType t) {
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
  int64_t layout = 0;  // a device call's devices' layout (device_ops.h; not an attribute)
};

inline Call MakeCall(const char* name, const Attrs& a, int uses) {
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
  c.layout = a.layout;
  c.run = a.layout != 0 ? a.run : 0;  // (device calls only)
  return c;
}

inline void SetDims(const ffi::AnyBuffer::Dimensions& d, size_t skip, const int64_t** dims, int* ndim) {
  *dims = d.size() > skip ? d.begin() + skip : nullptr;
  *ndim = d.size() > skip ? static_cast<int>(d.size() - skip) : 0;
}

inline std::string Unsupported(const char* name) {
  return std::string("vjpmpi.") + name + ": unsupported dtype";
}

inline void FillStatus(Runtime& rt, int64_t slot, const MPI_Status& st) {
  std::lock_guard<std::mutex> lock(rt.status_mutex);
  auto it = rt.statuses.find(slot);
  if (it != rt.statuses.end()) *it->second = st;  // (a dead MPI.Status has no slot)
}

// What a handler returns: an error, or (where calls may run asynchronously) an Outcome.
template <bool Async>
using Result = std::conditional_t<Async, Outcome, ffi::Error>;

// The run a started call belongs to, in its key: XLA's run id; 0 for a call started by a
// program of its own (an eager vjpmpi.start: its slot is negative) and waited for by another.
inline int64_t StartedRun(int64_t slot, int64_t run) { return slot < 0 ? 0 : run; }

// A started call's copy of the array it sends (taken in the start: XLA may reuse x's
// buffer once the start has returned).
inline const void* Keep(std::vector<unsigned char>& own, ffi::AnyBuffer x) {
  own = TakeBuffer(x.size_bytes(), false);  // (overwritten below)
  if (!own.empty()) HostCopy(own.data(), x.untyped_data(), own.size());
  return own.data();
}

// A started call's buffer for the array it receives; holding the template where nothing
// will arrive (from MPI_PROC_NULL, which keeps it).
inline void* Receive(std::vector<unsigned char>& own, ffi::AnyBuffer tmpl, bool keep) {
  own = TakeBuffer(tmpl.size_bytes(), !keep);
  if (keep && !own.empty()) HostCopy(own.data(), tmpl.untyped_data(), own.size());
  return own.data();
}

template <bool Async>
Result<Async> Finish(std::string e) {
  if constexpr (Async) {
    return Outcome{std::move(e), std::nullopt};
  } else {
    return e.empty() ? ffi::Error::Success() : ffi::Error::Internal(std::move(e));
  }
}

// The part of a call that moves data, after Run has found its communicator: the guard
// (trace, counters, watchdog entry), the ranks' agreement on a collective
// (agree.h) or the opt-in point-to-point check, the memory policy's staging
// before and after, `body(mem, c)` (the MPI call) and the receive status of a status slot.
// The ranks' agreement on a collective (agree.h), on the calling thread (its
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

// A started call moving more than this is polled by the communicator's thread from its
// start where that pays (Started::poll_from_start: a large message moves only while a
// thread tests it); a smaller one goes in one piece (MPI's eager protocol), and its wait
// tests it first.
inline constexpr size_t kPollFromStartBytes = size_t{1} << 16;

// Everything a handler does around its MPI call: the communicator the program names
// (alive, and for a collective this thread's), `prepare` (what needs the communicator,
// such as its size), then Tail. `body` copies what it uses (raw pointers, not XLA's
// buffer objects): where calls may run asynchronously (Async, host memory), a call that
// moves at least the threshold (its larger side, in or out: `moved`; GoesAsync) returns
// at once and Tail runs on the communicator's thread (async.h), which completes
// the future.
//
// `started` (a point-to-point call that vjpmpi.start began, between buffers of its own):
// Tail runs on the communicator's thread whatever the threshold, the handler returns at
// once, and the call's end goes to `started` (for its wait) instead of a future.
template <bool Async, typename Mem, typename Prepare, typename Body>
Result<Async> Run(Mem& mem, Call& c, const Attrs& a, bool collective, size_t moved,
                  Prepare prepare, Body body, std::shared_ptr<Started> started = nullptr) {
  Runtime* rt = &runtime;  // (the core library's one runtime)
  CommEntry* ce = nullptr;
  std::string e = a.comm >= 0 ? CheckAlive(c.op)
                              : std::string("vjpmpi.") + c.op + ": this program's call attributes "
                                "are not the ones these kernels take (a program lowered by "
                                "another vjpmpi release); trace it again";
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
    // A direct call posts its messages here, on XLA's thread (nothing to copy first, and
    // no hand-off to wait for), unless started calls of this communicator are still to be
    // posted on its thread (they come first).
    const bool here = started->direct && ce->started.load(std::memory_order_acquire) == 0;
    started->poll_from_start = PollsFromStart(*ce);
    // ("auto": polled from its start while its site's program computes between its start
    // and its wait; SiteRecord)
    if (here && started->poll_from_start && moved > kPollFromStartBytes && AutoDecides(*ce)) {
      started->record = SiteRecordOf(ce->id, a.site, a.run);
      if (started->record->StaysSynchronous()) {
        started->poll_from_start = false;
        started->record = nullptr;
        rt->auto_kept_calls.fetch_add(1, std::memory_order_relaxed);
      }
    }
    started->wait_to_end = here && !started->poll_from_start;
    if (ThreadMultiple() && !here) {
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
    } else {  // (here, or below MPI_THREAD_MULTIPLE: the start makes the whole call)
      std::string e = Tail(*rt, mem, c, a, ce, collective, body);
      if (started->record) {  // (from the messages' post)
        started->started_by.emplace();
        started->started_by->Restart();
      }
      if (!started->posted || !e.empty()) started->Finish(std::move(e));
    }
    return Finish<Async>(std::string());
  }
  }
  if (e.empty()) {
    if constexpr (Async) {
      bool go = GoesAsync(moved, *ce);
      // ("auto": where this call site's last asynchronous runs had nothing beside them,
      // it stays here for a while; SiteRecord)
      std::shared_ptr<SiteRecord> record;
      if (go && AutoDecides(*ce)) {
        record = SiteRecordOf(ce->id, a.site, a.run);
        if (record->StaysSynchronous()) {
          go = false;
          record = nullptr;
          rt->auto_kept_calls.fetch_add(1, std::memory_order_relaxed);
        }
      }
      // (the agreement here, on the calling thread, before the post: on the
      // communicator's thread a later program's first collective once waited for ever
      // in MPICH, probably the blocking/nonblocking mismatch of async.h's
      // GoesAsync, which that version had; not tried again since)
      if (go && Agreeing(*rt, collective)) e = AgreeStep(*rt, c, a, ce, nullptr);
      const int64_t k = go && collective ? ce->count : 0;
      if (go && e.empty()) {
        rt->async_calls.fetch_add(1, std::memory_order_relaxed);
        ffi::Promise promise;
        ffi::Future future(promise);
        // (the dimensions live in XLA's call frame, which ends when this returns)
        std::vector<int64_t> dims(c.dims, c.dims + c.ndim), dims2(c.dims2, c.dims2 + c.ndim2);
        // (what this thread computes while the call runs, where "auto" asks)
        std::optional<ThreadCpu> xla;
        if (record) xla.emplace();
        PostOn(ce->id, [rt, mem, c, a, ce, collective, busy, body, promise, k, record, xla,
                        dims = std::move(dims), dims2 = std::move(dims2)]() mutable {
          c.dims = dims.data();
          c.dims2 = dims2.data();
          const auto began = std::chrono::steady_clock::now();
          if (xla) xla->Restart();  // (not the post's own work: a new thread's start)
          std::string e = Tail(*rt, mem, c, a, ce, collective, body, true, k);
          if (record) {
            record->Measured(xla->Beside(), std::chrono::duration_cast<std::chrono::nanoseconds>(
                                               std::chrono::steady_clock::now() - began).count());
          }
          if (busy) ce->busy.store(false, std::memory_order_release);
          if (!e.empty()) ForgetRun(a.run);
          // (completing the future runs XLA's continuation, the program's next steps,
          // on this thread: the loop goes on without it, and the continuation's next
          // call here takes another thread, where the completion would have woken one)
          CurrentCommThread()->Handoff();
          if (e.empty()) {
            promise.SetAvailable();
          } else {
            promise.SetError(ffi::Error::Internal(e));
          }
        });
        return Outcome{{}, std::move(future)};
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
  return Finish<Async>(std::move(e));
}

inline std::string Ok() { return {}; }

// (under s.test_mutex) Tests a started call's posted messages once; true once they are
// done (it has ended then: its watch goes, and Finish completes its wait).
inline bool TestStarted(Started& s, uint64_t watch) {
  if (s.settled) return true;
  bool done = false;
  std::string e = TestPosted(s.test_call, s.req.get(), &done);
  if (!done) return false;
  s.settled = true;
  if (s.awaited) AwaitedStarted().fetch_sub(1, std::memory_order_relaxed);
  Unwatch(runtime, watch);
  s.Finish(std::move(e));
  return true;
}

// Has the communicator's thread poll the started call between its jobs until it is done,
// if it does not yet (on that thread: from now).
inline void PollStarted(const std::shared_ptr<Started>& started) {
  {
    std::lock_guard<std::mutex> lock(started->test_mutex);
    if (started->polled || started->settled) return;
    started->polled = true;
  }
  using Poll = CommThread::Poll;
  auto poll = [started]() {  // (busy: another thread tests it; next round)
    if (started->waiting.load(std::memory_order_acquire)) {  // (its wait tests it)
      runtime.started_polls_parked.fetch_add(1, std::memory_order_relaxed);
      return Poll::kParked;
    }
    std::unique_lock<std::mutex> lock(started->test_mutex, std::try_to_lock);
    return lock.owns_lock() && started->test() ? Poll::kDone : Poll::kPending;
  };
  if (CommThread* thread = CurrentCommThread()) {
    thread->AddPoll(std::move(poll));
  } else {
    PostOn(std::get<0>(started->key),
           [poll]() mutable { CurrentCommThread()->AddPoll(std::move(poll)); });
  }
}

// The MPI calls of a started call (vjpmpi.start): its messages posted (Post), then tested
// until they are done, which ends `started`. Posted on the communicator's thread, or, a
// direct call (XLA's buffers), on XLA's thread; the communicator's thread polls it (a
// large one from the start, a small one where its wait finds it not done). Where MPI is
// below MPI_THREAD_MULTIPLE, `blocking()` (the start makes the whole call).
template <typename Blocking>
std::string PostStarted(const Call& c, const void* send, void* recv,
                        const std::shared_ptr<Started>& started, Blocking blocking) {
  CommThread* thread = CurrentCommThread();
  if (thread == nullptr && !(started->direct && ThreadMultiple())) return blocking();
  auto posted = std::make_shared<Posted>();
  std::string e = Post(c, send, recv, posted.get());
  if (!e.empty()) return e;
  started->posted = true;
  const uint64_t watch = WatchCall(runtime, c.op, c.site, c.comm);  // (until they are done)
  {
    std::lock_guard<std::mutex> lock(started->test_mutex);
    started->test_dims.assign(c.dims, c.dims + c.ndim);
    started->test_dims2.assign(c.dims2, c.dims2 + c.ndim2);
    started->test_call = c;
    started->test_call.dims = started->test_dims.data();
    started->test_call.dims2 = started->test_dims2.data();
    started->req = posted;
    Started* s = started.get();  // (the function is its own: it never outlives it)
    started->test = [s, watch]() { return TestStarted(*s, watch); };
  }
  const size_t bytes = std::max(c.count, c.count2) * ByteSize(c.kind);
  if (thread != nullptr || (bytes > kPollFromStartBytes && started->poll_from_start)) {
    if (thread == nullptr) runtime.started_polled_from_start.fetch_add(1, std::memory_order_relaxed);
    PollStarted(started);
  }
  return {};
}

}  // namespace vjpmpi
