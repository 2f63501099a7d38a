// Run-time services shared by every backend's handlers: the one Runtime (call sites,
// communicators, status slots, settings, counters, trace, watchdog), which lives in the
// core library (libvjpmpi_core.so, runtime.cc) that every backend module links, the
// per-call guard (overlap counter, opt-in trace, watch slot) and the watchdog, which
// warns about a call stuck past VJPMPI_WARN_AFTER (60 s by default) and ends the job
// past VJPMPI_TIMEOUT (opt-in).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "agree.h"
#include "devices.h"
#include "mpi_ops.h"

namespace vjpmpi {


// One call in flight, as the watchdog sees it: in a slot of the thread that runs it
// (Guard), the fields stored relaxed and then published by `call` (the call's number in
// this slot, never reused; 0: none, or paused while the call keeps its own time). The
// watchdog reads `call`, the fields, then `call` again, and keeps what it read only when
// the two agree. A call costs a few stores here, and no clock: the watchdog times a call
// from when it first sees it.
struct WatchSlot {
  std::atomic<bool> taken{false};  // (a thread holds this slot)
  std::atomic<uint64_t> call{0};
  std::atomic<const char*> op{nullptr};
  std::atomic<int64_t> site{0};
  std::atomic<MPI_Comm> comm{MPI_COMM_NULL};
  std::atomic<CommEntry*> entry{nullptr};  // its communicator
  std::atomic<int64_t> k{0};     // a collective's number there, once it moves data (else 0)
  std::atomic<int> peer{-1};     // a point-to-point call's peer (-1: none)
  uint64_t serial = 0;           // the last call number given (the holding thread's)
};

// ---------------------------------------------------------------- runtime --
// All run-time state of vjpmpi lives in ONE Runtime, `runtime` (runtime.cc), in the
// core library that every backend module links: call sites, settings, counters, the
// trace and the single watchdog are the same whichever backend's handler runs.
struct Runtime {
  // Call sites: Python registers a description of each call site ("bcast(root=0)
  // float32[8] at train.py:12") when the check or the timeout is on, and passes
  // the hash of its text as the `site` attribute (0: none); the same in every process.
  std::mutex site_mutex;
  std::unordered_map<int64_t, std::string> sites;

  // Communicators by vjpmpi's number for them (the `comm` attribute), and those with
  // an agreement window (closed at finalize by CommEntry::close_key, last first: windows
  // that threads of one process opened in another order than its peers' still close in
  // the same order on every rank), and the windows this process has opened.
  CommTable comms;
  std::vector<CommEntry*> open_channels;
  std::atomic<int64_t> channels_opened{0};
  int comm_key = MPI_KEYVAL_INVALID;  // the attribute that holds a communicator's number
  std::once_flag comm_keys;
  // The node of each COMM_WORLD rank (a number per node; set once from Python at import,
  // before the first communicator gets its number); empty: not known.
  std::vector<int> world_nodes;

  // Receive statuses by slot (the `status` attribute): the address of a live
  // mpi4py MPI.Status, removed when the object dies.
  std::mutex status_mutex;
  std::unordered_map<int64_t, MPI_Status*> statuses;

  // Settings (configure()); `agreement` is off only in the benchmark that measures it.
  std::atomic<bool> check_enabled{false};
  std::atomic<bool> agreement{true};
  std::atomic<double> timeout_seconds{0.0};
  std::atomic<double> warn_seconds{60.0};  // VJPMPI_WARN_AFTER (0: no warnings)

  // The default communicator's entry, its window opened at import (OpenWorld): each
  // rank's header there says whether it has called MPI_Finalize and what it refused at
  // trace time, for the ranks that wait for it on any communicator.
  std::atomic<CommEntry*> world{nullptr};
  int64_t refusal_serial = 0;  // (under site_mutex)
  int64_t refusal_comm = 0;    // the communicator of the note's refused call (site_mutex)
  // Whether this rank's header holds a refusal note (NoteRefusal): its next collective on
  // those ranks keeps it standing until the others have left the refused call (Agree).
  std::atomic<bool> refusal_standing{false};
  // Held by the watchdog while it reads a window, and by CloseChannel while it frees one.
  std::mutex channel_mutex;

  // Kernel entries that found another vjpmpi kernel of this process still
  // running: with a correct token chain this stays 0 (checked by the tests).
  std::atomic<int64_t> in_flight{0};
  std::atomic<int64_t> overlaps{0};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> async_calls{0};  // calls run on a communicator's thread
  // calls that "auto" kept on XLA's thread: their site's last asynchronous runs had
  // nothing beside them (SiteRecord)
  std::atomic<int64_t> auto_kept_calls{0};
  std::atomic<int64_t> started_polled_from_start{0};  // direct started calls (PostStarted)
  std::atomic<int64_t> started_handed_over{0};  // by their wait, not done (WaitFor)
  // polls of started calls on a communicator's thread that found the call's wait testing
  // it (parked: the thread then sleeps until a job comes, CommThread::Poll)
  std::atomic<int64_t> started_polls_parked{0};
  // asynchronous calls completed on the thread that ran them, which handed its loop over
  // first (CommThread::Handoff), and the loops that thread took back afterwards
  std::atomic<int64_t> loop_handoffs{0};
  std::atomic<int64_t> loops_taken_back{0};
  // Collectives whose ranks were compared before they ran (first runs of programs,
  // every collective under VJPMPI_CHECK): what the agreement costs, for the tests.
  std::atomic<int64_t> verified{0};

  // Opt-in trace (VJPMPI_TRACE, read at import by vjpmpi/_kernels.py: set_tracing): the
  // sequence of collectives this process ran, to compare across ranks.
  std::atomic<bool> tracing{false};
  std::mutex trace_mutex;
  std::vector<std::string> trace_log;

  // The calls the watchdog looks at: each thread's call moving data in its slot (Guard),
  // and here the others (started calls in flight, a thread's second call), by a number
  // of their own, from their start (NowNs; 0: paused) until they end.
  static constexpr int kSlots = 512;
  WatchSlot slots[kSlots];
  std::atomic<int> slots_used{0};  // (slots past this one were never taken)
  struct Watch {
    const char* op;
    int64_t site;
    MPI_Comm comm;
    int64_t start;
  };
  std::mutex watch_mutex;
  std::map<uint64_t, Watch> watched;
  // Many devices per process (devices.h): each communicator's devices, by (its number,
  // the number of devices of the programs that use them).
  std::mutex devices_mutex;
  std::map<std::pair<int64_t, int>, std::unique_ptr<DeviceSet>> devices;
  // Runs (XLA's run ids) in which a device call failed, and why: the program's other
  // devices stop waiting (for a meeting, a letter, the ranks' agreement) with the error.
  std::mutex failed_mutex;
  std::map<int64_t, std::string> failed_runs;
  uint64_t next_watch = 1;
  std::once_flag watchdog_started;
};

extern Runtime runtime;

// Call sites: the text of a registered hash ("" if none), else `op`.
std::string SiteText(Runtime& rt, int64_t site);
std::string Site(Runtime& rt, int64_t site, const char* op);
int64_t RegisterSite(Runtime& rt, const std::string& text);
// (Call::site_text: the one runtime's)
std::string SiteOf(int64_t site);

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Whether the watchdog looks at calls: it warns (VJPMPI_WARN_AFTER) or ends the job
// (VJPMPI_TIMEOUT).
inline bool Watching(const Runtime& rt) {
  return rt.timeout_seconds.load(std::memory_order_relaxed) > 0 ||
         rt.warn_seconds.load(std::memory_order_relaxed) > 0;
}
// The watchdog's other entries (Runtime::watched): WatchCall returns 0 (nothing watched)
// while it does not look; Rewatch `start` 0: paused.
uint64_t WatchCall(Runtime& rt, const char* op, int64_t site, MPI_Comm comm);
void Rewatch(Runtime& rt, uint64_t id, int64_t start);
void Unwatch(Runtime& rt, uint64_t id);
// This thread's watch slot, held until the thread ends (nullptr: every slot is taken).
WatchSlot* ThreadSlot(Runtime& rt);
// How many calls the watchdog sees in flight now (for the tests).
int64_t WatchedCalls(Runtime& rt);

// A point-to-point call's peer, the rank it waits for (-1: none, or any).
inline int PeerOf(const Call& c, bool collective) {
  if (collective) return -1;
  int peer = std::strcmp(c.op, "send") == 0 ? c.peer : c.peer2;
  return peer >= 0 ? peer : -1;
}

struct Guard {
  Runtime& rt;
  WatchSlot* slot = nullptr;  // this thread's, holding this call
  uint64_t watch = 0;         // else an entry of Runtime::watched
  // (`k`: a collective's number on `entry`, where the ranks have agreed on it already)
  Guard(Runtime& r, const char* name, int64_t site, MPI_Comm comm, CommEntry* entry = nullptr,
        int peer = -1, int64_t k = 0)
      : rt(r) {
    if (rt.tracing) {
      std::lock_guard<std::mutex> lock(rt.trace_mutex);
      rt.trace_log.emplace_back(name);
    }
    rt.calls.fetch_add(1, std::memory_order_relaxed);
    if (rt.in_flight.fetch_add(1, std::memory_order_acq_rel) != 0) {
      rt.overlaps.fetch_add(1, std::memory_order_relaxed);
    }
    if (!Watching(rt)) return;
    WatchSlot* s = ThreadSlot(rt);
    if (s == nullptr || s->call.load(std::memory_order_relaxed) != 0) {  // (a second call)
      watch = WatchCall(rt, name, site, comm);
      return;
    }
    slot = s;
    // (what the watchdog reads past this fence belongs to a call number it has not seen)
    std::atomic_thread_fence(std::memory_order_release);
    s->op.store(name, std::memory_order_relaxed);
    s->site.store(site, std::memory_order_relaxed);
    s->comm.store(comm, std::memory_order_relaxed);
    s->entry.store(entry, std::memory_order_relaxed);
    s->k.store(k, std::memory_order_relaxed);
    s->peer.store(peer, std::memory_order_relaxed);
    s->call.store(++s->serial, std::memory_order_release);
  }
  ~Guard() {
    if (slot != nullptr) slot->call.store(0, std::memory_order_release);
    if (watch != 0) Unwatch(rt, watch);
    rt.in_flight.fetch_sub(1, std::memory_order_acq_rel);
  }
  // The ranks' agreement keeps time itself (it says where each rank is): the watchdog
  // looks at the collective only once it starts moving data, as collective #k of its
  // communicator.
  void Pause() {
    if (slot != nullptr) slot->call.store(0, std::memory_order_release);
    if (watch != 0) Rewatch(rt, watch, 0);
  }
  void Resume(int64_t k) {
    if (slot != nullptr) {
      std::atomic_thread_fence(std::memory_order_release);
      slot->k.store(k, std::memory_order_relaxed);
      slot->call.store(++slot->serial, std::memory_order_release);
    }
    if (watch != 0) Rewatch(rt, watch, NowNs());
  }
};
// A device call of run `run` failed with `error` (NoteRunFailure); why run `run` failed
// ("": it did not; 0: no run).
void NoteRunFailure(Runtime& rt, int64_t run, const std::string& error);
std::string RunFailure(Runtime& rt, int64_t run);

// Using vjpmpi after MPI_Finalize is an error, not a crash.
std::string CheckAlive(const char* op);

// configure(): the settings, and the one watchdog (started once, by the first
// configuration that needs it).
void Configure(Runtime& rt, bool check, double timeout, double warn);

// Whether the calling thread is a Python thread (XLA's own worker threads are not).
// The core library does not link Python: each module sets the test at its import
// (module_common.cc); until then, no thread is.
using ThreadTest = bool (*)();
void SetPythonThreadTest(ThreadTest test);
bool OnPythonThread();

// --------------------------------------------------------------- messages --
// (agree.cc) Waits that keep their own time give up at TimeLimit: VJPMPI_TIMEOUT, else
// 60 s under VJPMPI_CHECK, else none (0).
double TimeLimit(const Runtime& rt);
// What a call is, in messages: its call site's description, else its op and arrays.
std::string CallText(Runtime& rt, const Call& c);
// "rank 0 of 4 has waited 61.0 s in <what>, on a communicator of 2 ranks (rank 0 there)"
std::string Waiting(const std::string& what, int csize, int crank, double waited);
// What a warning says after where the call is.
std::string StillWaiting(const Runtime& rt);
void Warn(const Runtime& rt, const std::string& what);
// The job ends with `msg` (on stderr) when the ranks that must hear of an error cannot.
[[noreturn]] void AbortWith(const std::string& msg, const char* why);

}  // namespace vjpmpi
