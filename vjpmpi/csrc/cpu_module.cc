// The CPU backend module (_vjpmpi_cpu): XLA's buffers are host memory, handed to MPI as
// they are (large ones on huge pages: HugePages); handlers return a future, and a large
// call runs on its communicator's thread (async.h). This module also carries vjpmpi's
// Python interface to the one runtime (configure, comm_number, ...), which lives in the
// core library (libvjpmpi_core.so) that every backend module links.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "registrations.h"
#include "module_common.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/vector.h"

namespace nb = nanobind;

namespace vjpmpi {
namespace {

struct HostMem {
  void Prepare(Call&) {}
  const void* In(const void* buf, size_t n) {
    HugePages(buf, n);
    return buf;
  }
  void* Out(void* buf, size_t n) {
    HugePages(buf, n);
    return buf;
  }
  std::string Begin() { return {}; }
  std::string End() { return {}; }
  std::string Copy(void* dst, const void* src, size_t n) {
    HostCopy(dst, src, n);
    return {};
  }
};

struct CpuBackend {
  static constexpr bool kAsync = true;  // large calls run on a communicator thread
  using Ctx = NoContext;
  using Mem = HostMem;
  using DevMem = HostMem;  // (device calls: devices.h)
  static Mem MakeMem(NoContext) { return {}; }
  static DevMem MakeDevMem(NoContext) { return {}; }
};

// vjpmpi's Python interface to the runtime (vjpmpi/_kernels.py, _mpi.py, the tests).
void DefineRuntime(nb::module_& m) {
  // configure(check, timeout_seconds, warn_seconds): the opt-in mismatch check, the
  // watchdog's limit (0: none) and when it warns (0: never)
  m.def("configure", [](bool check, double timeout, double warn) {
    Configure(runtime, check, timeout, warn);
  });
  // open_world(number): the default communicator's window, at import (collective)
  m.def("open_world", [](int64_t id) {
    std::string e = OpenWorld(runtime, id);
    if (!e.empty()) throw std::runtime_error(e);
  });
  // note_refusal(number, op, root, message): a collective this rank refused at trace
  // time, for the ranks that wait in it; op "": this rank goes on with a call there (the
  // note goes if it is about that communicator's ranks). Whether a note is left.
  m.def("note_refusal", [](int64_t id, const std::string& op, int root, const std::string& message) {
    return NoteRefusal(runtime, id, op, root, message);
  });
  // register_site(text) -> its hash (the `site` attribute; also argument errors' texts)
  m.def("register_site", [](const std::string& text) { return RegisterSite(runtime, text); });
  // comm_number(handle) -> vjpmpi's number for the communicator (the `comm` attribute)
  m.def("comm_number", [](int64_t handle) {
    int64_t id = 0;
    std::string e = CommNumber(runtime, FromHandle<MPI_Comm>(handle), &id);
    if (!e.empty()) throw std::runtime_error(e);
    return id;
  });
  // A status slot (the `status` attribute) filled at the address of a live MPI.Status;
  // release_status when the object dies (calls then fill nothing).
  m.def("register_status", [](int64_t slot, int64_t address) {
    std::lock_guard<std::mutex> lock(runtime.status_mutex);
    runtime.statuses[slot] = reinterpret_cast<MPI_Status*>(static_cast<uintptr_t>(address));
  });
  m.def("release_status", [](int64_t slot) {
    std::lock_guard<std::mutex> lock(runtime.status_mutex);
    runtime.statuses.erase(slot);
  });
  m.def("_status_slots", []() {  // (live ones, for the tests)
    std::lock_guard<std::mutex> lock(runtime.status_mutex);
    return static_cast<int64_t>(runtime.statuses.size());
  });
  // (collectives this process ran on a communicator, program signatures verified on it,
  // freed) for the tests; the number of collectives compared across ranks so far.
  m.def("_comm_info", [](int64_t id) {
    CommEntry* e = runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    return nb::make_tuple(e->count, static_cast<int64_t>(e->verified.size()),
                          e->comm.load() == MPI_COMM_NULL);
  });
  m.def("verified_count", []() { return runtime.verified.load(); });
  // The benchmark of the agreement's cost turns it off and on (benchmarks/suite.py);
  // _forget_verified makes the next run of every program on a communicator a first one.
  m.def("_set_agreement", [](bool on) { runtime.agreement.store(on); });
  m.def("_forget_verified", [](int64_t id) {
    CommEntry* e = runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    e->verified.clear();
    e->last_verified = 0;
    e->ran = false;
  });
  m.def("comm_alive", [](int64_t id) {
    CommEntry* e = runtime.comms.Get(id);
    return e != nullptr && e->comm.load() != MPI_COMM_NULL;
  });
  m.def("open_channels", []() {
    std::lock_guard<std::mutex> lock(runtime.comms.mutex);
    return static_cast<int64_t>(runtime.open_channels.size());
  });
  // claim_thread(number, thread) -> the thread that owns the communicator (the first
  // to claim it), the error text for Python when that is another thread
  m.def("claim_thread", [](int64_t id, uint64_t thread) {
    CommEntry* e = runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    uint64_t owner = 0;
    e->owner.compare_exchange_strong(owner, thread);
    owner = e->owner.load();
    return nb::make_tuple(owner, owner == thread ? std::string()
                                                 : ThreadError(thread, owner, id, e->size));
  });
  m.def("trace_enabled", []() { return runtime.tracing.load(); });
  // set_tracing(on): VJPMPI_TRACE, as vjpmpi/_kernels.py reads it at import
  m.def("set_tracing", [](bool on) { runtime.tracing.store(on); });
  // Returns and clears the recorded sequence of collectives.
  m.def("take_trace", []() {
    std::lock_guard<std::mutex> lock(runtime.trace_mutex);
    std::vector<std::string> out;
    out.swap(runtime.trace_log);
    return out;
  });
  // (kernel calls, calls that overlapped another running vjpmpi kernel), every backend's
  // vjpmpi calls running now (guarded, in any thread), for the tests of overlap
  m.def("_in_flight", []() { return runtime.in_flight.load(); });
  m.def("_async_calls", []() { return runtime.async_calls.load(); });
  m.def("_auto_kept_calls", []() { return runtime.auto_kept_calls.load(); });
  // A call site's record under "auto" (SiteRecord), fresh, through `runs` runs: each
  // asks whether it stays on XLA's thread, and one that does not measures the next of
  // `measured` ((ns computed beside it, ns the call took), in turn); returns whether each
  // run stayed.
  m.def("_site_record_probe", [](int64_t runs, std::vector<std::pair<int64_t, int64_t>> measured) {
    SiteRecord record;
    std::vector<bool> kept;
    size_t next = 0;
    for (int64_t i = 0; i < runs; ++i) {
      kept.push_back(record.StaysSynchronous());
      if (!kept.back() && !measured.empty()) {
        record.Measured(measured[next].first, measured[next].second);
        next = (next + 1) % measured.size();
      }
    }
    return kept;
  });
  // The CPU time (us) of a thread that spins, read on its clock (ThreadCpu) from this
  // thread once the thread has read `spin_us` on its own clock, while it still spins.
  m.def("_thread_cpu_probe", [](int64_t spin_us) {
    std::optional<ThreadCpu> clock;
    std::mutex mutex;
    std::condition_variable cv;
    bool spun = false;
    std::atomic<bool> stop{false};
    std::thread t([&] {
      {
        std::lock_guard<std::mutex> lock(mutex);
        clock.emplace();
      }
      while (clock->Since() < spin_us * 1000) {
      }
      {
        std::lock_guard<std::mutex> lock(mutex);
        spun = true;
      }
      cv.notify_all();
      while (!stop.load()) {
      }
    });
    int64_t ns;
    {
      nb::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mutex);
      cv.wait(lock, [&] { return spun; });
      ns = clock->Since();
      stop.store(true);
    }
    t.join();
    return static_cast<double>(ns) / 1000;
  });
  m.def("_started_polled_from_start",
        []() { return runtime.started_polled_from_start.load(); });
  m.def("_started_handed_over", []() { return runtime.started_handed_over.load(); });
  m.def("_started_polls_parked", []() { return runtime.started_polls_parked.load(); });
  // started calls (vjpmpi.start) whose wait has not taken them, and the calls the watchdog
  // watches now, for the tests of their lifetimes
  m.def("_started_calls", &StartedCount);
  m.def("_watched_calls", []() {
    return WatchedCalls(runtime);
  });
  m.def("_on_comm_thread", []() { return OnCommThread(); });
  m.def("_loop_handoffs", []() { return runtime.loop_handoffs.load(); });
  m.def("_loops_taken_back", []() { return runtime.loops_taken_back.load(); });
  // A loop of its own (CommThread, no MPI): its first job hands the loop over, posts a
  // second job and then stays away `away_us` (as XLA's continuation computing on that
  // thread); returns how long, in us, the second job waited to run after its post.
  m.def("_handoff_probe", [](int64_t away_us) {
    using Clock = std::chrono::steady_clock;
    struct Probe {
      std::mutex mutex;
      std::condition_variable cv;
      Clock::time_point posted, ran;
      int done = 0;  // (both jobs have returned at 2)
    };
    auto p = std::make_shared<Probe>();
    auto end = [p] {
      std::lock_guard<std::mutex> lock(p->mutex);
      ++p->done;
      p->cv.notify_all();
    };
    auto* loop = new CommThread(true);
    loop->Post([p, loop, away_us, end] {
      loop->Handoff();
      p->posted = Clock::now();
      loop->Post([p, end] {
        p->ran = Clock::now();
        end();
      });
      std::this_thread::sleep_for(std::chrono::microseconds(away_us));
      end();
    });
    {
      nb::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(p->mutex);
      p->cv.wait(lock, [&p] { return p->done == 2; });
    }
    loop->Stop();
    return std::chrono::duration<double, std::micro>(p->ran - p->posted).count();
  });
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
    std::lock_guard<std::mutex> lock(runtime.comms.mutex);
    runtime.world_nodes = std::move(nodes);
  });
  m.def("_spans_nodes", [](int64_t id) {
    CommEntry* e = runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    return e->spans_nodes;
  });
  m.def("call_counts", []() {
    return nb::make_tuple(runtime.calls.load(), runtime.overlaps.load());
  });
}

}  // namespace
}  // namespace vjpmpi

NB_MODULE(_vjpmpi_cpu, m) {
  vjpmpi::DefineCommon(m, vjpmpi::Registrations<vjpmpi::CpuBackend>());
  vjpmpi::DefineRuntime(m);
}
