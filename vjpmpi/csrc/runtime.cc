// The one Runtime of the process (`runtime`, in the core library every backend module
// links): call sites, the watchdog's entries and the watchdog itself, which warns about
// a call stuck past VJPMPI_WARN_AFTER (60 s by default) and ends the job past
// VJPMPI_TIMEOUT (opt-in); the Python-thread test the modules inject (runtime.h).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>
#include "agree.h"
#include "async.h"
#include "runtime.h"

namespace vjpmpi {

Runtime runtime;

namespace {
std::atomic<ThreadTest> python_thread_test{nullptr};
}  // namespace

void SetPythonThreadTest(ThreadTest test) { python_thread_test.store(test); }

bool OnPythonThread() {
  ThreadTest test = python_thread_test.load(std::memory_order_acquire);
  return test != nullptr && test();
}

std::string SiteOf(int64_t site) { return SiteText(runtime, site); }

std::string SiteText(Runtime& rt, int64_t site) {
  std::lock_guard<std::mutex> lock(rt.site_mutex);
  auto it = rt.sites.find(site);
  return it == rt.sites.end() ? std::string() : it->second;
}

std::string Site(Runtime& rt, int64_t site, const char* op) {
  std::string text = site ? SiteText(rt, site) : std::string();
  return text.empty() ? std::string(op) : text;
}

int64_t RegisterSite(Runtime& rt, const std::string& text) {
  int64_t h = TextHash(text);
  std::lock_guard<std::mutex> lock(rt.site_mutex);
  rt.sites.emplace(h, text);
  return h;
}


// The watchdog's other entries (Runtime::watched): WatchCall returns 0 (nothing watched)
// while it does not look.
uint64_t WatchCall(Runtime& rt, const char* op, int64_t site, MPI_Comm comm) {
  if (!Watching(rt)) return 0;
  std::lock_guard<std::mutex> lock(rt.watch_mutex);
  uint64_t id = rt.next_watch++;
  rt.watched[id] = Runtime::Watch{op, site, comm, NowNs()};
  return id;
}
// (`start` 0: paused)
void Rewatch(Runtime& rt, uint64_t id, int64_t start) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lock(rt.watch_mutex);
  auto it = rt.watched.find(id);
  if (it != rt.watched.end()) it->second.start = start;
}
void Unwatch(Runtime& rt, uint64_t id) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lock(rt.watch_mutex);
  rt.watched.erase(id);
}

// This thread's watch slot, held until the thread ends (nullptr: every slot is taken).
WatchSlot* ThreadSlot(Runtime& rt) {
  struct Held {
    WatchSlot* slot = nullptr;
    ~Held() {
      if (slot != nullptr) {
        slot->call.store(0, std::memory_order_release);
        slot->taken.store(false, std::memory_order_release);
      }
    }
  };
  thread_local Held held;
  if (held.slot != nullptr) return held.slot;
  for (int i = 0; i < Runtime::kSlots; ++i) {
    bool free = false;
    if (rt.slots[i].taken.load(std::memory_order_relaxed) ||
        !rt.slots[i].taken.compare_exchange_strong(free, true, std::memory_order_acq_rel)) {
      continue;
    }
    held.slot = &rt.slots[i];
    int used = rt.slots_used.load(std::memory_order_acquire);
    while (used < i + 1 && !rt.slots_used.compare_exchange_weak(used, i + 1)) {
    }
    break;
  }
  return held.slot;
}



// Using vjpmpi after MPI_Finalize is an error, not a crash.
std::string CheckAlive(const char* op) {
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin) return std::string("vjpmpi.") + op + ": MPI has already been finalized";
  return {};
}


// ------------------------------------------------------------ watchdog --
// A call in flight, as the watchdog sees it.
struct InFlight {
  uint64_t key;   // its slot (< Runtime::kSlots), or kSlots + its Runtime::watched number
  uint64_t call;  // its number there
  const char* op;
  int64_t site;
  MPI_Comm comm;
  CommEntry* entry;
  int64_t k;
  int peer;
  int64_t start;  // when it started (0: not known; timed from when the watchdog sees it)
};

// What the watchdog remembers of a call between its looks.
struct Seen {
  uint64_t call = 0;
  int64_t since = 0;
  bool warned = false;
  int64_t look = 0, every = 0;  // the next inspection, and the interval after it
  RefusalSeen refusal;
};

// The calls in flight now: each slot's (what its thread published, read twice), and
// Runtime::watched's.
std::vector<InFlight> InFlightCalls(Runtime& rt) {
  std::vector<InFlight> out;
  const int used = rt.slots_used.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) {
    WatchSlot& w = rt.slots[i];
    const uint64_t call = w.call.load(std::memory_order_acquire);
    if (call == 0) continue;
    InFlight f{static_cast<uint64_t>(i), call, w.op.load(std::memory_order_relaxed),
               w.site.load(std::memory_order_relaxed), w.comm.load(std::memory_order_relaxed),
               w.entry.load(std::memory_order_relaxed), w.k.load(std::memory_order_relaxed),
               w.peer.load(std::memory_order_relaxed), 0};
    std::atomic_thread_fence(std::memory_order_acquire);
    if (w.call.load(std::memory_order_relaxed) == call) out.push_back(f);
  }
  std::lock_guard<std::mutex> lock(rt.watch_mutex);
  for (const auto& [id, w] : rt.watched) {
    if (w.start == 0) continue;
    out.push_back(InFlight{Runtime::kSlots + id, id, w.op, w.site, w.comm, nullptr, 0, -1, w.start});
  }
  return out;
}

// Where the other ranks of a call stuck in MPI are, read from their windows by this thread
// (so only under MPI_THREAD_MULTIPLE, and not while a window is being freed): for
// collective #k, the ranks that have not reached it (`report`: the text, else ""). A
// rank that called MPI_Finalize before reaching it (a point-to-point call's peer: at all),
// or refused it at trace time (a note that has stood for a second), ends the job: the
// ranks inside the call cannot be told.
std::string Inspect(Runtime& rt, const InFlight& c, Seen& seen, double waited,
                           bool report) {
  if (c.entry == nullptr || ThreadLevel() < MPI_THREAD_MULTIPLE) return {};
  std::unique_lock<std::mutex> lock(rt.channel_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return {};
  CommEntry& e = *c.entry;
  const std::string what = Site(rt, c.site, c.op ? c.op : "?");
  auto where = [&] { return "vjpmpi: " + Waiting(what, e.size, e.rank, waited); };
  const char* cannot = " (the ranks inside the call cannot be told)";
  if (c.k <= 0) {
    Header h{};
    if (c.peer >= 0 && ReadPresence(rt, e, c.peer, &h) && h.finalized) {
      AbortWith(where() + "; rank " + std::to_string(c.peer) + ", its peer, has called "
                "MPI_Finalize.", cannot);
    }
    return report && c.peer >= 0 ? " It waits for rank " + std::to_string(c.peer) + "." : "";
  }
  if (e.channel == nullptr) return {};
  Channel& ch = *e.channel;
  const Entry mine = *ch.slot(c.k);  // (this rank's entry #k, in its own window)
  const int root = (mine.flags & kUsesRoot) ? mine.root : -1;
  std::string behind;
  int unknown = 0;
  for (int q = 0; q < e.size; ++q) {
    Peek p{};
    bool late = false;
    if (q == e.rank) continue;
    if (!Read(ch, q, 0, &p, "watchdog", NowNs() + 1000000000, &late).empty() || late) {
      ++unknown;
      continue;
    }
    if (p.count >= c.k) continue;  // (in it, or past it)
    const std::string k_text = "collective #" + std::to_string(c.k);
    Header h{};
    const bool refuses = p.count == c.k - 1 && ReadPresence(rt, e, q, &h) &&
                         Refuses(h.refused, e, c.k, mine.op, root);
    if (p.finalized && !refuses) {
      AbortWith(where() + " (its " + k_text + " there); rank " + std::to_string(q) +
                    " has called MPI_Finalize without running it.",
                cannot);
    }
    if (refuses && (p.finalized || seen.refusal.Settled(q, h.refused, NowNs()))) {
      AbortWith(RefusedError(q, h.refused, "their " + k_text + " on a communicator of " +
                                                         std::to_string(e.size) + " ranks"),
                cannot);
    }
    if (!report) continue;
    behind += (behind.empty() ? "" : "; ") + std::string("rank ") + std::to_string(q);
    if (p.count > 0 && Read(ch, q, p.count, &p, "watchdog", NowNs() + 1000000000, &late).empty() &&
        !late && p.entry.k == p.entry.k_end && p.entry.k > 0) {
      behind += " (its last collective there: #" + std::to_string(p.entry.k) + ", " +
                Describe(p.entry) + ")";
    } else if (p.count == 0) {
      behind += " (no collective there yet)";
    }
  }
  if (!report) return {};
  std::string text = " It is their collective #" + std::to_string(c.k) + " there; ";
  if (!behind.empty()) return text + "not there yet: " + behind + ".";
  if (unknown > 0) return text + "where the other ranks are could not be read.";
  return text + "every rank has reached it (a rank in it with another array, or a message "
                "not matched?).";
}

// The end of a call that has waited past VJPMPI_TIMEOUT: the message, then the job ends.
[[noreturn]] void TimedOut(Runtime& rt, const char* op, int64_t site, MPI_Comm comm,
                                  double waited, double limit, const std::string& more) {
  int world = 0, size = 0, rank = -1, csize = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (comm != MPI_COMM_NULL) {
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &csize);
  }
  std::string where = Site(rt, site, op ? op : "?");
  std::fprintf(stderr,
               "vjpmpi: timeout (VJPMPI_TIMEOUT=%g s): rank %d of %d has waited %.1f s in "
               "%s, on a communicator of %d ranks (rank %d there); the other ranks did not "
               "join it.%s Aborting the job.\n",
               limit, world, size, waited, where.c_str(), csize, rank, more.c_str());
  std::fflush(stderr);
  // Give the launcher time to forward the message: when another rank has already
  // exited, mpiexec may tear the job down as soon as MPI_Abort starts and drop it.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);
}

// The watchdog: a call in flight (timed from its start, or from when this thread first
// sees it) is inspected from its first second on (Inspect: every 1, 2, 4, then 5 s),
// warned about once past VJPMPI_WARN_AFTER, and ends the job past VJPMPI_TIMEOUT (the
// call that has waited longest).
void Watchdog(Runtime* rtp) {
  Runtime& rt = *rtp;
  std::unordered_map<uint64_t, Seen> seen;
  constexpr int64_t kSecond = 1000000000;
  for (;;) {
    const double limit = rt.timeout_seconds.load(), warn = rt.warn_seconds.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(limit > 0 && limit < 2.0 ? 20 : 100));
    if (limit <= 0 && warn <= 0) {
      seen.clear();
      continue;
    }
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) continue;
    const int64_t now = NowNs();
    std::unordered_map<uint64_t, Seen> next;
    const InFlight* longest = nullptr;
    double longest_wait = -1;
    std::vector<InFlight> calls = InFlightCalls(rt);
    for (const InFlight& c : calls) {
      auto it = seen.find(c.key);
      Seen s = it != seen.end() && it->second.call == c.call ? it->second : Seen{};
      if (s.call != c.call) {
        s.call = c.call;
        s.since = c.start != 0 ? c.start : now;
        s.look = s.since + kSecond;
        s.every = kSecond;
      }
      const double waited = (now - s.since) * 1e-9;
      if (now >= s.look) {
        Inspect(rt, c, s, waited, false);
        s.look = now + s.every;
        s.every = std::min<int64_t>(2 * s.every, 5 * kSecond);
      }
      if (!s.warned && warn > 0 && waited >= warn && !(limit > 0 && waited >= limit)) {
        s.warned = true;
        Warn(rt, Waiting(Site(rt, c.site, c.op ? c.op : "?"), c.entry ? c.entry->size : 0,
                         c.entry ? c.entry->rank : -1, waited) +
                     "." + Inspect(rt, c, s, waited, true) + StillWaiting(rt));
      }
      if (waited > longest_wait) {
        longest_wait = waited;
        longest = &c;
      }
      next[c.key] = s;
    }
    seen.swap(next);
    if (longest != nullptr && limit > 0 && longest_wait >= limit) {
      Seen s;
      std::string more = Inspect(rt, *longest, s, longest_wait, true);
      TimedOut(rt, longest->op, longest->site, longest->comm, longest_wait, limit, more);
    }
  }
}

// One watchdog per runtime, whichever module configures it.
void Configure(Runtime& rt, bool check, double timeout, double warn) {
  rt.check_enabled.store(check);
  rt.timeout_seconds.store(timeout);
  rt.warn_seconds.store(warn);
  if (timeout > 0 || warn > 0) {
    Runtime* p = &rt;
    std::call_once(rt.watchdog_started, [p] { std::thread(Watchdog, p).detach(); });
  }
}

// A collective refused at trace time on communicator `id` (vjpmpi.scatter's root, with

int64_t WatchedCalls(Runtime& rt) { return static_cast<int64_t>(InFlightCalls(rt).size()); }

}  // namespace vjpmpi
