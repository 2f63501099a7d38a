// Run-time services shared by every backend's handlers: the one Runtime (call
// sites, communicators, status slots, settings, counters, trace, watchdog) and how
// modules share it, the per-call guard (overlap counter, opt-in trace), the agreement
// of the ranks on each collective (vjpmpi_agree.h) and the opt-in timeout watchdog
// (VJPMPI_TIMEOUT).
#pragma once

#include <algorithm>
#include <atomic>
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

#include "vjpmpi_async.h"
#include "vjpmpi_agree.h"
#include "vjpmpi_mpi.h"

namespace vjpmpi {

// ---------------------------------------------------------------- runtime --
// All run-time state of vjpmpi lives in ONE Runtime, shared by every backend:
// the CPU module (_vjpmpi_cpu) owns it, and each other backend module
// (_vjpmpi_cuda) is attached to it at import (vjpmpi/_kernels.py passes the CPU
// module's runtime_capsule() to attach_runtime()).  So call sites, settings,
// counters, the trace and the single watchdog are the same whichever backend's
// handler runs.  Every module is compiled from these headers in one build; the
// handle below lets attach refuse a module built differently.
struct Runtime {
  // Call sites: Python registers a description of each call site ("bcast(root=0)
  // float32[8] at train.py:12") when the check or the timeout is on, and passes
  // the hash of its text as the `site` attribute (0: none); the same in every process.
  std::mutex site_mutex;
  std::unordered_map<int64_t, std::string> sites;

  // Communicators by vjpmpi's number for them (the `comm` attribute), and those with
  // an agreement window, in the order they were opened (closed in reverse at finalize).
  CommTable comms;
  std::vector<CommEntry*> open_channels;
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

  // Kernel entries that found another vjpmpi kernel of this process still
  // running: with a correct token chain this stays 0 (checked by the tests).
  std::atomic<int64_t> in_flight{0};
  std::atomic<int64_t> overlaps{0};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> async_calls{0};  // calls run on a communicator's thread
  // Collectives whose ranks were compared before they ran (first runs of programs,
  // every collective under VJPMPI_CHECK): what the agreement costs, for the tests.
  std::atomic<int64_t> verified{0};

  // Opt-in trace (VJPMPI_TRACE=1 when the CPU module is loaded): the sequence of
  // collectives this process ran, to compare across ranks.
  const bool tracing = [] {
    const char* v = std::getenv("VJPMPI_TRACE");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  std::mutex trace_mutex;
  std::vector<std::string> trace_log;

  // The calls the watchdog looks at, while VJPMPI_TIMEOUT is set: every call moving data
  // (on XLA's threads, the communicators' threads and started calls in flight at once),
  // by a number of its own, from its start (NowNs; 0: paused) until it ends.
  struct Watch {
    const char* op;
    int64_t site;
    MPI_Comm comm;
    int64_t start;
  };
  std::mutex watch_mutex;
  std::map<uint64_t, Watch> watched;
  uint64_t next_watch = 1;
  std::once_flag watchdog_started;
};

// Bump when Runtime changes (members, order or meaning).
inline constexpr uint32_t kRuntimeLayout = 4;
inline constexpr uint64_t kRuntimeMagic = 0x766a706d70697274ULL;  // "vjpmpirt"

#define VJPMPI_STR2(x) #x
#define VJPMPI_STR(x) VJPMPI_STR2(x)
#if defined(OPEN_MPI) && OPEN_MPI
#define VJPMPI_MPI_ABI "openmpi"
#elif defined(MPICH_VERSION)
#define VJPMPI_MPI_ABI "mpich"
#else
#define VJPMPI_MPI_ABI "unknown"
#endif
#ifdef __VERSION__
#define VJPMPI_COMPILER __VERSION__
#else
#define VJPMPI_COMPILER "unknown compiler"
#endif
// What a module's Runtime layout depends on beyond the layout number and size.
inline constexpr char kRuntimeBuild[] = VJPMPI_COMPILER
    "; libstdc++ cxx11 abi " VJPMPI_STR(_GLIBCXX_USE_CXX11_ABI) "; MPI " VJPMPI_MPI_ABI;

// What runtime_capsule() points at: a plain struct, checked field by field
// before the Runtime behind it is used.
struct RuntimeHandle {
  uint64_t magic;
  uint32_t layout;
  uint32_t size;     // sizeof(Runtime)
  char build[160];   // kRuntimeBuild
  Runtime* runtime;
};
inline constexpr const char* kRuntimeCapsule = "vjpmpi.runtime";

#ifdef VJPMPI_RUNTIME_OWNER
inline Runtime owned_runtime;
inline std::atomic<Runtime*> current_runtime{&owned_runtime};
#else
inline std::atomic<Runtime*> current_runtime{nullptr};  // set by AttachRuntime
#endif

inline Runtime* CurrentRuntime() { return current_runtime.load(std::memory_order_acquire); }

inline RuntimeHandle MakeRuntimeHandle(Runtime* rt) {
  RuntimeHandle h{};
  h.magic = kRuntimeMagic;
  h.layout = kRuntimeLayout;
  h.size = static_cast<uint32_t>(sizeof(Runtime));
  std::snprintf(h.build, sizeof(h.build), "%s", kRuntimeBuild);
  h.runtime = rt;
  return h;
}

// Attach this module to the runtime behind `h`; "" on success, else why not.
inline std::string AttachRuntime(const RuntimeHandle* h, const char* module) {
  std::string where = std::string("vjpmpi: cannot attach ") + module + " to vjpmpi's runtime: ";
  if (h == nullptr || h->magic != kRuntimeMagic) {
    return where + "the capsule does not hold a vjpmpi runtime handle";
  }
  RuntimeHandle mine = MakeRuntimeHandle(nullptr);
  if (h->layout != mine.layout || h->size != mine.size ||
      std::strncmp(h->build, mine.build, sizeof(mine.build)) != 0) {
    return where + "it was built differently from the CPU module (runtime layout " +
           std::to_string(h->layout) + ", " + std::to_string(h->size) + " bytes, built with " +
           std::string(h->build, strnlen(h->build, sizeof(h->build))) + "; this module: layout " +
           std::to_string(mine.layout) + ", " + std::to_string(mine.size) + " bytes, built with " +
           mine.build + "). Reinstall vjpmpi so that all its modules come from one build.";
  }
  if (h->runtime == nullptr) return where + "the handle holds no runtime";
  Runtime* expected = nullptr;
  if (!current_runtime.compare_exchange_strong(expected, h->runtime) && expected != h->runtime) {
    return where + "it is already attached to another runtime";
  }
  return {};
}

inline std::string SiteText(Runtime& rt, int64_t site) {
  std::lock_guard<std::mutex> lock(rt.site_mutex);
  auto it = rt.sites.find(site);
  return it == rt.sites.end() ? std::string() : it->second;
}

inline std::string Site(Runtime& rt, int64_t site, const char* op) {
  std::string text = site ? SiteText(rt, site) : std::string();
  return text.empty() ? std::string(op) : text;
}

inline int64_t RegisterSite(Runtime& rt, const std::string& text) {
  int64_t h = TextHash(text);
  std::lock_guard<std::mutex> lock(rt.site_mutex);
  rt.sites.emplace(h, text);
  return h;
}

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The watchdog's entries (Runtime::watched): WatchCall returns 0 (nothing watched) while
// VJPMPI_TIMEOUT is unset.
inline uint64_t WatchCall(Runtime& rt, const char* op, int64_t site, MPI_Comm comm) {
  if (rt.timeout_seconds.load(std::memory_order_relaxed) <= 0) return 0;
  std::lock_guard<std::mutex> lock(rt.watch_mutex);
  uint64_t id = rt.next_watch++;
  rt.watched[id] = Runtime::Watch{op, site, comm, NowNs()};
  return id;
}
// (`start` 0: paused)
inline void Rewatch(Runtime& rt, uint64_t id, int64_t start) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lock(rt.watch_mutex);
  auto it = rt.watched.find(id);
  if (it != rt.watched.end()) it->second.start = start;
}
inline void Unwatch(Runtime& rt, uint64_t id) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lock(rt.watch_mutex);
  rt.watched.erase(id);
}

struct Guard {
  Runtime& rt;
  uint64_t watch = 0;
  Guard(Runtime& r, const char* name, int64_t site, MPI_Comm comm) : rt(r) {
    if (rt.tracing) {
      std::lock_guard<std::mutex> lock(rt.trace_mutex);
      rt.trace_log.emplace_back(name);
    }
    rt.calls.fetch_add(1, std::memory_order_relaxed);
    if (rt.in_flight.fetch_add(1, std::memory_order_acq_rel) != 0) {
      rt.overlaps.fetch_add(1, std::memory_order_relaxed);
    }
    watch = WatchCall(rt, name, site, comm);
  }
  ~Guard() {
    Unwatch(rt, watch);
    rt.in_flight.fetch_sub(1, std::memory_order_acq_rel);
  }
  // The ranks' agreement keeps time itself (it says where each rank is): the
  // watchdog looks at the collective only once it starts moving data.
  void Pause() { Rewatch(rt, watch, 0); }
  void Resume() { Rewatch(rt, watch, NowNs()); }
};

// Using vjpmpi after MPI_Finalize is an error, not a crash.
inline std::string CheckAlive(const char* op) {
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin) return std::string("vjpmpi.") + op + ": MPI has already been finalized";
  return {};
}

// ------------------------------------------------------- communicators --
// MPI calls this when a communicator with a vjpmpi number is freed: its programs
// then fail (the number is never given to another communicator), and its window
// is freed with it (collectively: every rank frees the communicator).
inline void CloseChannel(Runtime& rt, CommEntry& e) {
  Channel* ch = e.channel;
  if (ch == nullptr) return;
  e.channel = nullptr;
  {
    std::lock_guard<std::mutex> lock(rt.comms.mutex);
    auto& v = rt.open_channels;
    v.erase(std::remove(v.begin(), v.end(), &e), v.end());
  }
  MPI_Win_unlock_all(ch->win);
  MPI_Win_free(&ch->win);
  MPI_Comm_free(&ch->dup);
  delete ch;
}

inline int FreedComm(MPI_Comm, int, void* value, void*) {
  Runtime* rt = CurrentRuntime();
  CommEntry* e = rt ? rt->comms.Get(static_cast<int64_t>(reinterpret_cast<intptr_t>(value))) : nullptr;
  if (e == nullptr) return MPI_SUCCESS;
  e->comm.store(MPI_COMM_NULL, std::memory_order_release);
  CloseChannel(*rt, *e);
  StopCommThread(e->id);
  return MPI_SUCCESS;
}

// MPI_Finalize deletes MPI_COMM_SELF's attributes first: each window then says so (a
// rank that waits for this one to reach a collective learns that it never will), and
// the windows are freed, collectively, in the reverse of the order they were opened in
// (every rank opened its windows in an order that ran, so the reverse order runs too).
inline int Finalizing(MPI_Comm, int, void*, void*) {
  Runtime* rt = CurrentRuntime();
  if (rt == nullptr) return MPI_SUCCESS;
  std::vector<CommEntry*> open;
  {
    std::lock_guard<std::mutex> lock(rt->comms.mutex);
    open = rt->open_channels;
  }
  for (CommEntry* e : open) __atomic_store_n(&e->channel->header()->finalized, 1, __ATOMIC_RELEASE);
  for (auto it = open.rbegin(); it != open.rend(); ++it) CloseChannel(*rt, **it);
  return MPI_SUCCESS;
}

// Whether `comm`'s processes are on more than one node, by Runtime::world_nodes (a
// process outside COMM_WORLD counts as another node; nodes not known: false). Local MPI
// calls only: a communicator's first use is no collective point.
inline bool SpansNodes(const Runtime& rt, MPI_Comm comm, int size) {
  if (size < 2 || rt.world_nodes.empty()) return false;
  MPI_Group group, world;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> ranks(size), in_world(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  MPI_Group_translate_ranks(group, size, ranks.data(), world, in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  const int n = static_cast<int>(rt.world_nodes.size());
  auto node = [&](int w) { return w >= 0 && w < n ? rt.world_nodes[w] : -1; };
  for (int w : in_world) {
    if (node(w) < 0 || node(w) != node(in_world[0])) return true;
  }
  return false;
}

// vjpmpi's number for `comm` (given at its first use, kept on it as an attribute, so
// every mpi4py object of one communicator has the same number).
inline std::string CommNumber(Runtime& rt, MPI_Comm comm, int64_t* id) {
  std::call_once(rt.comm_keys, [&rt] {
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, FreedComm, &rt.comm_key, nullptr);
    int self_key = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, Finalizing, &self_key, nullptr);
    MPI_Comm_set_attr(MPI_COMM_SELF, self_key, nullptr);
  });
  void* value = nullptr;
  int found = 0;
  std::string e = Check(MPI_Comm_get_attr(comm, rt.comm_key, &value, &found), "comm",
                        "MPI_Comm_get_attr");
  if (!e.empty()) return e;
  if (found) {
    *id = static_cast<int64_t>(reinterpret_cast<intptr_t>(value));
    return {};
  }
  std::lock_guard<std::mutex> lock(rt.comms.mutex);
  CommEntry* entry = rt.comms.Add();
  if (entry == nullptr) return "vjpmpi: too many communicators";
  MPI_Comm_size(comm, &entry->size);
  MPI_Comm_rank(comm, &entry->rank);
  entry->spans_nodes = SpansNodes(rt, comm, entry->size);
  entry->comm.store(comm, std::memory_order_release);
  *id = entry->id;
  return Check(MPI_Comm_set_attr(comm, rt.comm_key, reinterpret_cast<void*>(
                                     static_cast<intptr_t>(entry->id))),
               "comm", "MPI_Comm_set_attr");
}

// The communicator a program names, if it is alive. A collective run on a Python
// thread (XLA runs a program on the thread that calls it unless it has work to hand
// to its own threads first) must run on the thread that owns the communicator: the
// first Python thread that traced or ran a collective on it (Python sets `owner`).
inline std::string Resolve(Runtime& rt, Call& c, int64_t id, bool collective, CommEntry** out) {
  CommEntry* e = rt.comms.Get(id);
  if (e == nullptr) {
    return std::string("vjpmpi.") + c.op + ": this program names communicator #" +
           std::to_string(id) + ", which vjpmpi has not been given in this process (a "
           "program exported or cached by another process? trace it again here)";
  }
  MPI_Comm comm = e->comm.load(std::memory_order_acquire);
  if (comm == MPI_COMM_NULL) {
    return std::string("vjpmpi.") + c.op + ": the communicator this program was traced "
           "with (vjpmpi's communicator #" + std::to_string(id) + ", of " +
           std::to_string(e->size) + " ranks) has been freed; trace the function again with "
           "a live communicator";
  }
  if (collective && OnPythonThread()) {
    uint64_t me = ThreadId(), owner = e->owner.load(std::memory_order_acquire);
    if (owner != 0 && owner != me) {
      return std::string("vjpmpi.") + c.op + ": " + ThreadError(me, owner, id, e->size);
    }
  }
  c.comm = comm;
  *out = e;
  return {};
}

// ---------------------------------------------------------- agreement --
inline std::string OpenChannel(Runtime& rt, CommEntry& e, const char* op) {
  auto* ch = new Channel;
  std::string err = Check(MPI_Comm_dup(e.comm.load(), &ch->dup), op, "MPI_Comm_dup (agreement)");
  if (err.empty()) {
    MPI_Comm_set_errhandler(ch->dup, MPI_ERRORS_RETURN);
    MPI_Info info;
    MPI_Info_create(&info);
    MPI_Info_set(info, "alloc_shm", "true");  // (MPICH: shared memory between local ranks)
    err = Check(MPI_Win_allocate(static_cast<MPI_Aint>(Channel::kBytes), 1, info, ch->dup,
                                 &ch->base, &ch->win),
                op, "MPI_Win_allocate (agreement)");
    MPI_Info_free(&info);
  }
  if (err.empty()) {
    std::memset(ch->base, 0, Channel::kBytes);
    err = Check(MPI_Win_lock_all(MPI_MODE_NOCHECK, ch->win), op, "MPI_Win_lock_all");
  }
  // no rank reads another's ring before it is zeroed
  if (err.empty()) err = Check(MPI_Barrier(ch->dup), op, "MPI_Barrier (agreement)");
  if (!err.empty()) {
    delete ch;
    return err;
  }
  e.channel = ch;
  std::lock_guard<std::mutex> lock(rt.comms.mutex);
  rt.open_channels.push_back(&e);
  return {};
}

// What one read of another rank's window gives: its header's first fields and one slot.
struct Peek {
  int64_t finalized, invalid_k, count;
  Entry entry;
};

// One read of rank q's window; with a deadline (ns since epoch, 0: none) it gives up
// when the deadline passes (*late; the requests are left to the job's end).
inline std::string Read(Channel& ch, int q, int64_t slot_k, Peek* out, const char* op,
                        int64_t deadline = 0, bool* late = nullptr) {
  MPI_Request r[2];
  std::string e = Check(MPI_Rget(out, 24, MPI_BYTE, q, 0, 24, MPI_BYTE, ch.win, &r[0]), op,
                        "MPI_Rget (agreement)");
  if (!e.empty()) return e;
  e = Check(MPI_Rget(&out->entry, sizeof(Entry), MPI_BYTE, q, Channel::Offset(slot_k),
                     sizeof(Entry), MPI_BYTE, ch.win, &r[1]),
            op, "MPI_Rget (agreement)");
  if (!e.empty()) {
    MPI_Wait(&r[0], MPI_STATUS_IGNORE);
    return e;
  }
  for (int64_t nap = 0;;) {  // (a rank outside MPI may leave its reads pending)
    int done = 0;
    e = Check(MPI_Testall(2, r, &done, MPI_STATUSES_IGNORE), op, "MPI_Testall (agreement)");
    if (!e.empty() || done) return e;
    if (deadline != 0 && NowNs() > deadline) {
      *late = true;
      return {};
    }
    nap = nap == 0 ? 1000 : std::min<int64_t>(nap * 2, 1000000);
    std::this_thread::sleep_for(std::chrono::nanoseconds(nap));
  }
}

inline std::string ReadMessage(Channel& ch, int q) {
  Header h{};
  MPI_Request r;
  if (MPI_Rget(&h, sizeof(h), MPI_BYTE, q, 0, sizeof(h), MPI_BYTE, ch.win, &r) != MPI_SUCCESS) {
    return "(its message could not be read)";
  }
  MPI_Wait(&r, MPI_STATUS_IGNORE);
  h.message[sizeof(h.message) - 1] = '\0';
  return h.message;
}

// (kUnread: a read of its window that MPI did not complete by the deadline)
enum PeerState { kWaiting, kHave, kAhead, kFinalized, kUnread };

// The rows of a message: each rank's collective #k (or where it is instead).
inline std::string Rows(Runtime& rt, const std::vector<Entry>& all,
                        const std::vector<int>& state, int me) {
  std::string s;
  for (size_t q = 0; q < all.size(); ++q) {
    s += "\n  rank " + std::to_string(q) + ": ";
    if (state[q] == kHave) {
      std::string site(all[q].site_text, strnlen(all[q].site_text, sizeof(all[q].site_text)));
      if (site.empty() && all[q].site) site = SiteText(rt, all[q].site);
      s += site.empty() ? Describe(all[q]) : site;
      if (!site.empty() && site.rfind(Describe(all[q]), 0) != 0) s += " [" + Describe(all[q]) + "]";
      if (static_cast<int>(q) != me && !(all[q].flags & kVerifying)) {
        s += " (already running it: it ran this program before)";
      }
    } else if (state[q] == kFinalized) {
      s += "has called MPI_Finalize without running it";
    } else if (state[q] == kUnread) {
      s += "its window could not be read: MPI did not complete the read (with MPICH over "
           "libfabric's TCP provider, more than FI_TCP_MAX_SAVED unmatched messages from it "
           "stop the connection; it may be running ahead)";
    } else if (state[q] == kAhead) {
      s += "ran it and " + std::to_string(kRing) + " or more collectives after it, unchecked";
    } else {
      s += "has not reached it";
    }
  }
  return s;
}

// The job ends: a rank that cannot be told is inside the collective (or gone).
// The job ends with `msg` (on stderr) when the ranks that must hear of an error cannot.
[[noreturn]] inline void AbortWith(const std::string& msg, const char* why) {
  std::fprintf(stderr, "%s\nAborting the job%s.\n", msg.c_str(), why);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  MPI_Abort(MPI_COMM_WORLD, 4);
  std::_Exit(4);
}

// Wait for every other rank's entry for collective `mine.k`; compare; "" when they
// agree, else the error (raised when every rank compares, else the job ends).
inline std::string Verify(Runtime& rt, CommEntry& ce, Call& c, const Entry& mine,
                          const std::string& invalid_message, std::vector<Entry>& all,
                          std::vector<int>& state) {
  Channel& ch = *ce.channel;
  const int n = ce.size, me = ce.rank;
  const int64_t k = mine.k;
  all.assign(n, Entry{});
  state.assign(n, kWaiting);
  all[me] = mine;
  state[me] = kHave;
  bool check = rt.check_enabled.load(std::memory_order_relaxed);
  double limit = rt.timeout_seconds.load();
  if (check && limit <= 0) limit = 60.0;
  const int64_t start = NowNs();
  const int64_t deadline = limit > 0 ? start + static_cast<int64_t>(limit * 1e9) : 0;
  int waiting = n - 1;
  int64_t nap_ns = 0;
  Peek p{};
  bool late = false;
  while (waiting > 0 && !late) {
    bool progress = false;
    for (int q = 0; q < n && !late; ++q) {
      if (state[q] != kWaiting) continue;
      std::string e = Read(ch, q, k, &p, c.op, deadline, &late);
      if (!e.empty()) return e;
      if (late) {
        state[q] = kUnread;
        break;
      }
      if (p.entry.k == k && p.entry.k_end == k) {
        e = Read(ch, q, k, &p, c.op, deadline, &late);  // (complete before this read began:
        if (!e.empty()) return e;                          // consistent)
        if (late) {
          state[q] = kUnread;
          break;
        }
        all[q] = p.entry;
        state[q] = kHave;
      } else if (p.entry.k_end > k && p.entry.k_end == p.entry.k) {
        state[q] = kAhead;
      } else if (p.finalized) {
        state[q] = kFinalized;
      } else {
        continue;
      }
      --waiting;
      progress = true;
    }
    if (waiting == 0) break;
    double waited = (NowNs() - start) * 1e-9;
    if (late || (limit > 0 && waited >= limit)) {  // (as the watchdog says, and where each rank is)
      int world = 0, world_size = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &world);
      MPI_Comm_size(MPI_COMM_WORLD, &world_size);
      char head_text[160];
      std::snprintf(head_text, sizeof(head_text), "vjpmpi: timeout (%s=%g s): rank %d of %d has waited %.1f s in ",
                    rt.timeout_seconds.load() > 0 ? "VJPMPI_TIMEOUT" : "VJPMPI_CHECK's limit",
                    limit, world, world_size, waited);
      const bool unread = std::find(state.begin(), state.end(), kUnread) != state.end();
      std::string msg = head_text + (mine.site ? Site(rt, mine.site, c.op) : Describe(mine)) +
                        ", on a communicator of " + std::to_string(n) + " ranks (rank " +
                        std::to_string(me) + " there); " +
                        (unread ? "MPI did not complete its read of another rank's entry"
                                : "the other ranks did not join it") +
                        " (it is their collective #" + std::to_string(k) + " there); each rank:" +
                        Rows(rt, all, state, me);
      const int64_t soon = NowNs() + 1000000000;  // (what arrives within a second)
      for (int q = 0; q < n; ++q) {
        bool gone = false;
        if (state[q] != kWaiting) continue;
        if (Read(ch, q, 0, &p, c.op, soon, &gone).empty() && !gone && p.count > 0 &&
            Read(ch, q, p.count, &p, c.op, soon, &gone).empty() && !gone &&
            p.entry.k == p.entry.k_end && p.entry.k > 0) {
          msg += "\n  (rank " + std::to_string(q) + "'s last collective there: #" +
                 std::to_string(p.entry.k) + ", " + Describe(p.entry) + ")";
        }
      }
      AbortWith(msg, "");
    }
    if (!progress) {
      nap_ns = nap_ns == 0 ? 1000 : std::min<int64_t>(nap_ns * 2, 1000000);
      if (nap_ns < 20000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::nanoseconds(nap_ns));
      }
    }
  }
  rt.verified.fetch_add(1, std::memory_order_relaxed);

  // the verdict, the same on every rank that compares (it sees the same entries)
  bool all_told = true;
  for (int q = 0; q < n; ++q) {
    if (q != me && !(state[q] == kHave && (all[q].flags & kVerifying))) all_told = false;
  }
  std::string head = std::string("vjpmpi.") + c.op + ": ";
  std::string where = "on a communicator of " + std::to_string(n) + " ranks (their collective #" +
                      std::to_string(k) + " there)";
  std::string error;
  for (int q = 0; q < n && error.empty(); ++q) {
    if (state[q] == kHave && (all[q].flags & kInvalid)) {
      std::string msg = q == me ? invalid_message : ReadMessage(ch, q);
      error = msg + "\n(found by rank " + std::to_string(q) + ", which alone can check it; "
              "every rank of the communicator stops at this collective, #" +
              std::to_string(k) + " there; each rank was about to run:" +
              Rows(rt, all, state, me) + ")";
    }
  }
  std::vector<bool> have(n);
  bool differ = false, histories = false, positions = false, gone = false;
  for (int q = 0; q < n; ++q) {
    have[q] = state[q] == kHave;
    if (state[q] == kFinalized) gone = true;
    if (!have[q]) continue;
    if (!SameCollective(all[q], mine)) differ = true;
    else if (all[q].history != mine.history) histories = true;
    else if (check && all[q].position != mine.position) positions = true;
  }
  if (error.empty() && differ) {
    std::string what = Differences(all, have);
    bool several = what.find(" and ") != std::string::npos;
    error = head + (check ? "collective mismatch (VJPMPI_CHECK) " : "the ranks disagree ") +
            where + ": " + what + (several ? " differ" : " differs") +
            "; each rank was about to run:" + Rows(rt, all, state, me) +
            "\nEvery rank must run the same collectives, with the same dtype, shape, op and "
            "root, in the same order.";
  } else if (error.empty() && histories) {
    error = head + "the ranks agree on this collective but ran different collectives on this "
            "communicator before it (runs of programs they had each run before, which are "
            "not compared: run with VJPMPI_CHECK=1 to find the first difference); " + where +
            ", each rank is about to run:" + Rows(rt, all, state, me);
  } else if (error.empty() && positions) {
    error = head + "collective mismatch (VJPMPI_CHECK): the ranks run the same collective " +
            where + " from different points of their programs (a rank-dependent trip count "
            "or branch leaves some ranks with more collectives than others):";
    for (int q = 0; q < n; ++q) {
      error += "\n  rank " + std::to_string(q) + ": collective " +
               std::to_string(all[q].position) + " of this run of its program, " +
               (all[q].site ? Site(rt, all[q].site, "") : Describe(all[q]));
    }
  } else if (error.empty() && gone) {
    error = head + "not every rank runs this collective " + where + "; each rank:" +
            Rows(rt, all, state, me);
  }
  // When every rank compares, none runs ahead before every rank has read what it needs.
  // Otherwise a rank whose reads were done could run on, and the collectives after this
  // one (a root's, with eager sends) could queue more messages to a rank still reading
  // than its MPI library holds unmatched: with MPICH over libfabric's TCP provider (64
  // per connection, FI_TCP_MAX_SAVED) the connection stops there and the read's reply
  // waits behind them for ever. A collective that no rank leaves before every rank has
  // entered it (kWaitsForAll, set in the handlers' table) is that barrier already (when
  // it runs: not after an error); before the others, a barrier on the window's
  // communicator (its messages travel before any of those).
  if (all_told && (!error.empty() || !(c.uses & kWaitsForAll))) {
    std::string e = Check(MPI_Barrier(ch.dup), c.op, "MPI_Barrier (agreement)");
    if (!e.empty()) return e;
  }
  if (error.empty()) return {};
  if (!all_told) {
    AbortWith(error, ": some ranks cannot be told (they are inside the collective, having run "
                     "their program before, or gone)");
  }
  // every rank raises at this collective: they start again from one history
  ce.history = Mix(0x76a7ULL, static_cast<uint64_t>(k));
  return error;
}

// A communicator's window, opened at its first collective (collectively: every rank of
// it runs that collective). The watchdog watches this, as it watches a collective.
inline std::string EnsureChannel(Runtime& rt, CommEntry& ce, const char* op) {
  if (ce.size <= 1 || ce.channel != nullptr) return {};
  return OpenChannel(rt, ce, op);
}

// Before a collective's data moves: number and publish it; when this rank compares
// this run of its program (a program new to it here, or VJPMPI_CHECK), compare it.
inline std::string Agree(Runtime& rt, CommEntry& ce, Call& c, uint64_t sig, int64_t run,
                         const std::string& invalid_message) {
  if (ce.size <= 1) {
    return invalid_message.empty() ? std::string()
                                   : std::string("vjpmpi.") + c.op + ": " + invalid_message;
  }
  bool first = !ce.ran || run != ce.run;
  if (first) {
    ce.ran = true;
    ce.run = run;
    ce.position = 0;
    bool known = sig != 0 && (sig == ce.last_verified || ce.verified.count(sig) != 0);
    ce.mode = rt.check_enabled.load(std::memory_order_relaxed) ? 2 : known ? 0 : 1;
    if (known) ce.last_verified = sig;
  }
  bool verifying = ce.mode != 0 || !invalid_message.empty();
  // Written in place (a few stores): what the other ranks read when they compare.
  Channel& ch = *ce.channel;
  const int64_t k = ++ce.count;
  Entry* s = ch.slot(k);
  __atomic_store_n(&s->k_end, 0, __ATOMIC_RELAXED);
  std::atomic_thread_fence(std::memory_order_release);
  __atomic_store_n(&s->k, k, __ATOMIC_RELAXED);
  Fingerprint(c, *s);
  ce.history = Mix(ce.history, FingerprintHash(*s));
  s->history = ce.history;
  s->sig = sig;
  s->site = c.site;
  s->site_text[0] = '\0';
  if (c.site) std::snprintf(s->site_text, sizeof(s->site_text), "%s", SiteText(rt, c.site).c_str());
  s->position = ++ce.position;
  if (!invalid_message.empty()) {
    s->flags |= kInvalid;
    Header* h = ch.header();
    std::snprintf(h->message, sizeof(h->message), "%s", invalid_message.c_str());
    __atomic_store_n(&h->invalid_k, k, __ATOMIC_RELEASE);
  }
  if (verifying) s->flags |= kVerifying;
  __atomic_store_n(&s->k_end, k, __ATOMIC_RELEASE);
  __atomic_store_n(&ch.header()->count, k, __ATOMIC_RELEASE);
  if (!verifying) return {};
  const Entry mine = *s;
  std::vector<Entry> all;
  std::vector<int> state;
  std::string e = Verify(rt, ce, c, mine, invalid_message, all, state);
  if (!e.empty()) return e;
  if (ce.mode == 1) {  // the first collective of a new program's run: aligned?
    bool aligned = mine.position == 1 && sig != 0;
    for (int q = 0; q < ce.size && aligned; ++q) {
      aligned = state[q] == kHave && all[q].sig == sig && all[q].position == 1;
    }
    if (aligned) {
      ce.verified.insert(sig);
      ce.last_verified = sig;
      ce.mode = 0;
    } else {
      ce.mode = 2;  // the ranks' programs differ: compare each collective of this run
    }
  }
  return {};
}

// ------------------------------------------------------------ watchdog --
// The end of a call that has waited past VJPMPI_TIMEOUT: the message, then the job ends.
[[noreturn]] inline void TimedOut(Runtime& rt, const char* op, int64_t site, MPI_Comm comm,
                                  double waited, double limit) {
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
               "join it. Aborting the job.\n",
               limit, world, size, waited, where.c_str(), csize, rank);
  std::fflush(stderr);
  // Give the launcher time to forward the message: when another rank has already
  // exited, mpiexec may tear the job down as soon as MPI_Abort starts and drop it.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);
}

// The watchdog ends the job when any watched call has waited past the limit (the one
// that has waited longest).
inline void Watchdog(Runtime* rtp) {
  Runtime& rt = *rtp;
  for (;;) {
    double limit = rt.timeout_seconds.load();
    auto nap = std::chrono::milliseconds(limit < 2.0 ? 20 : 100);
    std::this_thread::sleep_for(nap);
    if (limit <= 0) continue;
    Runtime::Watch oldest{nullptr, 0, MPI_COMM_NULL, 0};
    {
      std::lock_guard<std::mutex> lock(rt.watch_mutex);
      for (const auto& [id, w] : rt.watched) {
        if (w.start != 0 && (oldest.start == 0 || w.start < oldest.start)) oldest = w;
      }
    }
    if (oldest.start == 0) continue;
    double waited = (NowNs() - oldest.start) * 1e-9;
    if (waited < limit) continue;
    TimedOut(rt, oldest.op, oldest.site, oldest.comm, waited, limit);
  }
}

// One watchdog per runtime, whichever module configures it.
inline void Configure(Runtime& rt, bool check, double timeout) {
  rt.check_enabled.store(check);
  rt.timeout_seconds.store(timeout);
  if (timeout > 0) {
    Runtime* p = &rt;
    std::call_once(rt.watchdog_started, [p] { std::thread(Watchdog, p).detach(); });
  }
}

}  // namespace vjpmpi
