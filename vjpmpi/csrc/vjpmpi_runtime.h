// Run-time services shared by every backend's handlers: the one Runtime (call
// sites, communicators, status slots, settings, counters, trace, watchdog) and how
// modules share it, the per-call guard (overlap counter, opt-in trace, watch slot), the
// agreement of the ranks on each collective (vjpmpi_agree.h) and the watchdog, which
// warns about a call stuck past VJPMPI_WARN_AFTER (60 s by default) and ends the job
// past VJPMPI_TIMEOUT (opt-in).
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
  std::atomic<double> warn_seconds{60.0};  // VJPMPI_WARN_AFTER (0: no warnings)

  // The default communicator's entry, its window opened at import (OpenWorld): each
  // rank's header there says whether it has called MPI_Finalize and what it refused at
  // trace time, for the ranks that wait for it on any communicator.
  std::atomic<CommEntry*> world{nullptr};
  int64_t refusal_serial = 0;  // (under site_mutex)
  // Held by the watchdog while it reads a window, and by CloseChannel while it frees one.
  std::mutex channel_mutex;

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
  uint64_t next_watch = 1;
  std::once_flag watchdog_started;
};

// Bump when Runtime changes (members, order or meaning).
inline constexpr uint32_t kRuntimeLayout = 5;
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

// Whether the watchdog looks at calls: it warns (VJPMPI_WARN_AFTER) or ends the job
// (VJPMPI_TIMEOUT).
inline bool Watching(const Runtime& rt) {
  return rt.timeout_seconds.load(std::memory_order_relaxed) > 0 ||
         rt.warn_seconds.load(std::memory_order_relaxed) > 0;
}

// The watchdog's other entries (Runtime::watched): WatchCall returns 0 (nothing watched)
// while it does not look.
inline uint64_t WatchCall(Runtime& rt, const char* op, int64_t site, MPI_Comm comm) {
  if (!Watching(rt)) return 0;
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

// This thread's watch slot, held until the thread ends (nullptr: every slot is taken).
inline WatchSlot* ThreadSlot(Runtime& rt) {
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
    Unwatch(rt, watch);
    rt.in_flight.fetch_sub(1, std::memory_order_acq_rel);
  }
  // The ranks' agreement keeps time itself (it says where each rank is): the watchdog
  // looks at the collective only once it starts moving data, as collective #k of its
  // communicator.
  void Pause() {
    if (slot != nullptr) slot->call.store(0, std::memory_order_release);
    Rewatch(rt, watch, 0);
  }
  void Resume(int64_t k) {
    if (slot != nullptr) {
      std::atomic_thread_fence(std::memory_order_release);
      slot->k.store(k, std::memory_order_relaxed);
      slot->call.store(++slot->serial, std::memory_order_release);
    }
    Rewatch(rt, watch, NowNs());
  }
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
  Channel* ch;
  {
    std::lock_guard<std::mutex> reading(rt.channel_mutex);  // (after the watchdog's read)
    ch = e.channel;
    if (ch == nullptr) return;
    e.channel = nullptr;
    if (rt.world.load() == &e) rt.world.store(nullptr);
  }
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

// Each rank's place in the default communicator `world` (CommEntry::in_world, group).
// Local MPI calls only.
inline void PlaceInWorld(CommEntry& e, MPI_Comm comm, MPI_Comm world) {
  MPI_Group group, all;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(world, &all);
  std::vector<int> ranks(e.size);
  e.in_world.assign(e.size, MPI_UNDEFINED);
  for (int i = 0; i < e.size; ++i) ranks[i] = i;
  MPI_Group_translate_ranks(group, e.size, ranks.data(), all, e.in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&all);
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (int& w : e.in_world) {
    if (w == MPI_UNDEFINED) w = -1;
    h = Mix(h, static_cast<uint64_t>(static_cast<int64_t>(w)));
  }
  e.group = h;
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
  if (CommEntry* world = rt.world.load()) PlaceInWorld(*entry, comm, world->comm.load());
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
// What one read of another rank's window gives: its header's first fields and one slot.
struct Peek {
  int64_t finalized, invalid_k, count;
  Entry entry;
};

// Wait for `n` requests; with a deadline (ns since epoch, 0: none) give up when it passes
// (*late; the requests are left to the job's end).
inline std::string AwaitReads(int n, MPI_Request* r, const char* op, int64_t deadline,
                              bool* late) {
  for (int64_t nap = 0;;) {  // (a rank outside MPI may leave its reads pending)
    int done = 0;
    std::string e = Check(MPI_Testall(n, r, &done, MPI_STATUSES_IGNORE), op,
                          "MPI_Testall (agreement)");
    if (!e.empty() || done) return e;
    if (deadline != 0 && NowNs() > deadline) {
      *late = true;
      return {};
    }
    nap = nap == 0 ? 1000 : std::min<int64_t>(nap * 2, 1000000);
    std::this_thread::sleep_for(std::chrono::nanoseconds(nap));
  }
}

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
  return AwaitReads(2, r, op, deadline, late);
}

// Rank q (of `e`)'s header in the default communicator's window, up to its message: its
// finalized flag and refusal note. False when there is no such window, q is not in it, or
// MPI does not complete the read within a second.
inline bool ReadPresence(Runtime& rt, const CommEntry& e, int q, Header* out) {
  CommEntry* world = rt.world.load();
  if (world == nullptr || world->channel == nullptr || q < 0 ||
      q >= static_cast<int>(e.in_world.size()) || e.in_world[q] < 0) {
    return false;
  }
  constexpr int kBytes = offsetof(Header, message);
  MPI_Request r;
  if (MPI_Rget(out, kBytes, MPI_BYTE, e.in_world[q], 0, kBytes, MPI_BYTE, world->channel->win,
               &r) != MPI_SUCCESS) {
    return false;
  }
  bool late = false;
  return AwaitReads(1, &r, "agreement", NowNs() + 1000000000, &late).empty() && !late;
}

// Whether rank q's refusal note `n` refuses collective #k of `e`, `op` with root `root`
// (-1: an op without one).
inline bool Refuses(const Refusal& n, const CommEntry& e, int64_t k, const char* op, int root) {
  return n.serial != 0 && n.serial == n.serial_end && n.k == k && n.group == e.group &&
         std::strncmp(n.op, op, sizeof(n.op)) == 0 && n.root == root;
}

// A peer's refusal note, as a rank that waits for that peer sees it: acted on once the
// same note has stood for a second (the refusing rank clears its note when it goes on to
// its next collective there: a rank that skipped the refused call is not taken for one
// that refused the next).
struct RefusalSeen {
  static constexpr int64_t kSettleNs = 1000000000;
  int peer = -1;
  int64_t serial = 0, since = 0;
  bool Settled(int q, const Refusal& n, int64_t now) {
    if (q != peer || n.serial != serial) {
      peer = q;
      serial = n.serial;
      since = now;
    }
    return now - since >= kSettleNs;
  }
};

inline std::string RefusalText(const Refusal& n) {
  return std::string(n.message, strnlen(n.message, sizeof(n.message)));
}

// The error of a rank whose peer q refused the collective it waits in.
inline std::string RefusedError(int q, const Refusal& n, const std::string& where) {
  return RefusalText(n) + "\n(rank " + std::to_string(q) + " refused it when it traced the call, "
         "raising this there, and will not run it; the ranks waiting in it stop here: " + where +
         ")";
}

// The limit a wait that keeps its own time gives up at: VJPMPI_TIMEOUT, else 60 s under
// VJPMPI_CHECK, else none (0).
inline double TimeLimit(const Runtime& rt) {
  double limit = rt.timeout_seconds.load();
  if (limit <= 0 && rt.check_enabled.load(std::memory_order_relaxed)) limit = 60.0;
  return limit;
}

// What a call is, in messages: its call site's description, else its op and arrays.
inline std::string CallText(Runtime& rt, const Call& c) {
  std::string site = c.site ? SiteText(rt, c.site) : std::string();
  if (!site.empty()) return site;
  Entry e{};
  Fingerprint(c, e);
  return Describe(e);
}

// "rank 0 of 4 has waited 61.0 s in <what>, on a communicator of 2 ranks (rank 0 there)"
inline std::string Waiting(const std::string& what, int csize, int crank, double waited) {
  int world = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  char head[96];
  std::snprintf(head, sizeof(head), "rank %d of %d has waited %.1f s in ", world, size, waited);
  return head + what + ", on a communicator of " + std::to_string(csize) + " ranks (rank " +
         std::to_string(crank) + " there)";
}

// What a warning says after where the call is.
inline std::string StillWaiting(const Runtime& rt) {
  char tail[512];
  std::snprintf(tail, sizeof(tail),
                " Still waiting: another rank may still be computing or compiling, or be in "
                "other calls (a rank-dependent branch or trip count, a tag or peer that does "
                "not match, collectives on two communicators in crossed orders). %s "
                "VJPMPI_WARN_AFTER=<seconds> sets when this warning comes (0: never).",
                rt.timeout_seconds.load() > 0 ? "VJPMPI_TIMEOUT ends the job at its limit."
                                              : "VJPMPI_TIMEOUT=<seconds> ends the job at a limit.");
  return tail;
}

inline void Warn(const Runtime& rt, const std::string& what) {
  std::fprintf(stderr, "vjpmpi: warning (VJPMPI_WARN_AFTER=%g s): %s\n",
               rt.warn_seconds.load(), what.c_str());
  std::fflush(stderr);
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

// A window's communicator, duplicated without blocking (MPI_Comm_idup): every rank joins
// it at its first collective on `e`. While the others have not, the ranks that have wait
// here, reading the others' headers in the default communicator's window: one that called
// MPI_Finalize ends the job, a refusal of this very collective (RefusalSeen) is this rank's
// error (the idup stays pending in `e`: the next collective there completes it); past
// VJPMPI_WARN_AFTER a warning, past TimeLimit the end of the job.
inline std::string AwaitOpening(Runtime& rt, CommEntry& e, const Call& c) {
  const int64_t start = NowNs();
  const double limit = TimeLimit(rt), warn = rt.warn_seconds.load();
  const int root = (c.uses & kUsesRoot) ? c.root : -1;
  bool warned = false;
  // (the others' headers: from 0.1 s on, every 0.1 s plus 1 ms a rank)
  const int64_t every = 100000000 + 1000000 * static_cast<int64_t>(e.size);
  int64_t next_look = start + 100000000;
  RefusalSeen refused;
  for (int64_t nap = 0;;) {
    int done = 0;
    std::string err = Check(MPI_Test(&e.opening, &done, MPI_STATUS_IGNORE), c.op,
                            "MPI_Comm_idup (agreement)");
    if (!err.empty() || done) return err;
    const int64_t now = NowNs();
    const double waited = (now - start) * 1e-9;
    auto where = [&] {
      return Waiting(CallText(rt, c), e.size, e.rank, waited) +
             ", its first collective there (which opens the communicator's agreement window, "
             "collectively: every rank of it joins at its own first collective there)";
    };
    if (now >= next_look) {
      next_look = now + every;
      for (int q = 0; q < e.size; ++q) {
        Header h{};
        if (q == e.rank || !ReadPresence(rt, e, q, &h)) continue;
        const bool refuses = Refuses(h.refused, e, 1, c.op, root);
        if (h.finalized && !refuses) {
          AbortWith("vjpmpi: " + where() + "; rank " + std::to_string(q) +
                        " has called MPI_Finalize without running it.",
                    "");
        }
        // (a rank gone since its refusal goes on nowhere: no second to wait)
        if (refuses && (h.finalized || refused.Settled(q, h.refused, now))) {
          return RefusedError(q, h.refused, "the first collective on a communicator of " +
                                                      std::to_string(e.size) + " ranks");
        }
      }
    }
    if (!warned && warn > 0 && waited >= warn && !(limit > 0 && waited >= limit)) {
      warned = true;
      Warn(rt, where() + "; not every rank has joined it." + StillWaiting(rt));
    }
    if (limit > 0 && waited >= limit) {
      char head[64];
      std::snprintf(head, sizeof(head), "vjpmpi: timeout (%s=%g s): ",
                    rt.timeout_seconds.load() > 0 ? "VJPMPI_TIMEOUT" : "VJPMPI_CHECK's limit",
                    limit);
      AbortWith(head + where() + "; the other ranks did not join it.", "");
    }
    nap = nap == 0 ? 1000 : std::min<int64_t>(nap * 2, 1000000);
    if (nap < 20000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::nanoseconds(nap));
    }
  }
}

// A communicator's window, opened at its first collective `c` (collectively; the default
// communicator's at import, `c` null).
inline std::string OpenChannel(Runtime& rt, CommEntry& e, const Call* c) {
  const char* op = c ? c->op : "import";
  std::string err;
  if (e.opening == MPI_REQUEST_NULL && e.opening_dup == MPI_COMM_NULL) {
    err = Check(MPI_Comm_idup(e.comm.load(), &e.opening_dup, &e.opening), op,
                "MPI_Comm_idup (agreement)");
    if (!err.empty()) return err;
  }
  if (c != nullptr) {
    err = AwaitOpening(rt, e, *c);
  } else {
    err = Check(MPI_Wait(&e.opening, MPI_STATUS_IGNORE), op, "MPI_Comm_idup (agreement)");
  }
  if (!err.empty()) return err;
  auto* ch = new Channel;
  ch->dup = e.opening_dup;
  e.opening_dup = MPI_COMM_NULL;
  MPI_Comm_set_errhandler(ch->dup, MPI_ERRORS_RETURN);
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shm", "true");  // (MPICH: shared memory between local ranks)
  err = Check(MPI_Win_allocate(static_cast<MPI_Aint>(Channel::kBytes), 1, info, ch->dup,
                               &ch->base, &ch->win),
              op, "MPI_Win_allocate (agreement)");
  MPI_Info_free(&info);
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
  {
    std::lock_guard<std::mutex> reading(rt.channel_mutex);
    e.channel = ch;
  }
  std::lock_guard<std::mutex> lock(rt.comms.mutex);
  rt.open_channels.push_back(&e);
  return {};
}

// The default communicator (vjpmpi's number `id`): its window opened at import, where
// every rank makes it (vjpmpi._mpi.default_comm), and its ranks' places (each rank's
// place in it is the identity).
inline std::string OpenWorld(Runtime& rt, int64_t id) {
  CommEntry* e = rt.comms.Get(id);
  if (e == nullptr) return "vjpmpi: no such communicator number";
  PlaceInWorld(*e, e->comm.load(), e->comm.load());
  if (e->size > 1 && e->channel == nullptr) {
    std::string err = OpenChannel(rt, *e, nullptr);
    if (!err.empty()) return err;
  }
  rt.world.store(e);
  std::lock_guard<std::mutex> lock(rt.comms.mutex);  // (those numbered before)
  for (int64_t i = 1; i < rt.comms.next; ++i) {
    CommEntry* other = rt.comms.Get(i);
    MPI_Comm comm = other ? other->comm.load() : MPI_COMM_NULL;
    if (other != nullptr && other != e && comm != MPI_COMM_NULL) PlaceInWorld(*other, comm, e->comm.load());
  }
  return {};
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
// (kRefused: it refused this collective at trace time, RefusalSeen)
enum PeerState { kWaiting, kHave, kAhead, kFinalized, kUnread, kRefused };

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
    } else if (state[q] == kRefused) {
      s += "refused it (its argument error, above) and will not run it";
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


// Where each rank is (Rows), and the last collective of those that have not come: what a
// warning or a timeout of the ranks' agreement on collective #k says.
inline std::string Places(Runtime& rt, Channel& ch, const std::vector<Entry>& all,
                          const std::vector<int>& state, int me, const char* op) {
  std::string msg = Rows(rt, all, state, me);
  Peek p{};
  const int64_t soon = NowNs() + 1000000000;  // (what arrives within a second)
  for (size_t q = 0; q < all.size(); ++q) {
    bool gone = false;
    if (state[q] != kWaiting) continue;
    if (Read(ch, static_cast<int>(q), 0, &p, op, soon, &gone).empty() && !gone && p.count > 0 &&
        Read(ch, static_cast<int>(q), p.count, &p, op, soon, &gone).empty() && !gone &&
        p.entry.k == p.entry.k_end && p.entry.k > 0) {
      msg += "\n  (rank " + std::to_string(q) + "'s last collective there: #" +
             std::to_string(p.entry.k) + ", " + Describe(p.entry) + ")";
    }
  }
  return msg;
}

// Wait for every other rank's entry for collective `mine.k`; compare; "" when they
// agree, else the error (raised when every rank compares, else the job ends). *refused:
// the error is a rank's refusal of this collective at trace time (RefusalSeen): that rank
// never publishes it, and the caller takes this rank's entry back.
inline std::string Verify(Runtime& rt, CommEntry& ce, Call& c, const Entry& mine,
                          const std::string& invalid_message, std::vector<Entry>& all,
                          std::vector<int>& state, bool* refused) {
  Channel& ch = *ce.channel;
  const int n = ce.size, me = ce.rank;
  const int64_t k = mine.k;
  all.assign(n, Entry{});
  state.assign(n, kWaiting);
  all[me] = mine;
  state[me] = kHave;
  bool check = rt.check_enabled.load(std::memory_order_relaxed);
  const double limit = TimeLimit(rt), warn = rt.warn_seconds.load();
  const int64_t start = NowNs();
  const int64_t deadline = limit > 0 ? start + static_cast<int64_t>(limit * 1e9) : 0;
  const int root = (mine.flags & kUsesRoot) ? mine.root : -1;
  int waiting = n - 1;
  int64_t nap_ns = 0, next_look = start + 100000000;
  Peek p{};
  bool late = false, warned = false;
  RefusalSeen seen;
  Refusal note{};
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
        Header h{};  // (gone since it refused this collective: its refusal says why)
        if (ReadPresence(rt, ce, q, &h) && Refuses(h.refused, ce, k, c.op, root) &&
            p.count == k - 1) {
          state[q] = kRefused;
          note = h.refused;
          *refused = true;
        }
      } else {
        continue;
      }
      --waiting;
      progress = true;
    }
    if (*refused) break;
    if (waiting == 0) break;
    const int64_t now = NowNs();
    const double waited = (now - start) * 1e-9;
    if (!late && now >= next_look) {  // a rank that refused this collective at trace time
      next_look = now + 100000000;
      for (int q = 0; q < n && !*refused; ++q) {
        Header h{};
        bool gone = false;
        if (state[q] != kWaiting || !ReadPresence(rt, ce, q, &h) ||
            !Refuses(h.refused, ce, k, c.op, root)) {
          continue;
        }
        // (one short of it: it has not run anything there since)
        if (Read(ch, q, 0, &p, c.op, now + 1000000000, &gone).empty() && !gone &&
            p.count == k - 1 && seen.Settled(q, h.refused, now)) {
          state[q] = kRefused;
          note = h.refused;
          *refused = true;
        }
      }
      if (*refused) break;
    }
    auto where = [&] {
      return Waiting(mine.site ? Site(rt, mine.site, c.op) : Describe(mine), n, me, waited);
    };
    if (!warned && warn > 0 && waited >= warn && !late && !(limit > 0 && waited >= limit)) {
      warned = true;
      Warn(rt, where() + ", for the ranks' agreement on it (their collective #" +
                   std::to_string(k) + " there: no data moves before every rank has "
                   "published what it runs there); each rank:" +
                   Places(rt, ch, all, state, me, c.op) + "\n" + StillWaiting(rt));
    }
    if (late || (limit > 0 && waited >= limit)) {  // (as the watchdog says, and where each rank is)
      char head[64];
      std::snprintf(head, sizeof(head), "vjpmpi: timeout (%s=%g s): ",
                    rt.timeout_seconds.load() > 0 ? "VJPMPI_TIMEOUT" : "VJPMPI_CHECK's limit",
                    limit);
      const bool unread = std::find(state.begin(), state.end(), kUnread) != state.end();
      AbortWith(head + where() + "; " +
                    (unread ? "MPI did not complete its read of another rank's entry"
                            : "the other ranks did not join it") +
                    " (it is their collective #" + std::to_string(k) + " there); each rank:" +
                    Places(rt, ch, all, state, me, c.op),
                "");
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
  if (*refused) {  // (no barrier: the refusing rank never comes)
    int q = static_cast<int>(std::find(state.begin(), state.end(), kRefused) - state.begin());
    std::string error = RefusedError(q, note, "their collective #" + std::to_string(k) +
                                                        " on a communicator of " +
                                                        std::to_string(n) + " ranks; each rank:" +
                                                        Rows(rt, all, state, me));
    for (int r = 0; r < n; ++r) {
      if (r != me && state[r] == kHave && !(all[r].flags & kVerifying)) {
        AbortWith(error, ": some ranks cannot be told (they are inside the collective, having "
                         "run their program before)");
      }
    }
    return error;
  }
  rt.verified.fetch_add(1, std::memory_order_relaxed);

  // the verdict, the same on every rank that compares (it sees the same entries)
  bool all_told = true;
  for (int q = 0; q < n; ++q) {
    if (q != me && !(state[q] == kHave && (all[q].flags & kVerifying))) all_told = false;
  }
  // (`agree`: a composite's check of its arguments, which each rank's note names)
  const bool composite = std::strcmp(c.op, "agree") == 0;
  std::string head = composite ? std::string("vjpmpi: ") : std::string("vjpmpi.") + c.op + ": ";
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
    if (composite && what == "shape") {
      what = "the arguments";
      several = true;
    }
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

// A communicator's window, opened at its first collective `c` (collectively: every rank
// of it runs that collective; AwaitOpening keeps its time).
inline std::string EnsureChannel(Runtime& rt, CommEntry& ce, const Call& c) {
  if (ce.size <= 1 || ce.channel != nullptr) return {};
  return OpenChannel(rt, ce, &c);
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
  const uint64_t history_before = ce.history;
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
  s->site_text[0] = '\0';  // (read by the ranks that compare: a verified run leaves it out)
  if (c.site && verifying) {
    std::snprintf(s->site_text, sizeof(s->site_text), "%s", SiteText(rt, c.site).c_str());
  }
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
  bool refused = false;
  std::string e = Verify(rt, ce, c, mine, invalid_message, all, state, &refused);
  if (refused) {  // the refusing rank never published #k: neither did this one, now
    __atomic_store_n(&s->k_end, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->k, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&ch.header()->count, k - 1, __ATOMIC_RELEASE);
    ce.count = k - 1;
    ce.history = history_before;
    --ce.position;
  }
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
inline std::vector<InFlight> InFlightCalls(Runtime& rt) {
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
inline std::string Inspect(Runtime& rt, const InFlight& c, Seen& seen, double waited,
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
[[noreturn]] inline void TimedOut(Runtime& rt, const char* op, int64_t site, MPI_Comm comm,
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
inline void Watchdog(Runtime* rtp) {
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
inline void Configure(Runtime& rt, bool check, double timeout, double warn) {
  rt.check_enabled.store(check);
  rt.timeout_seconds.store(timeout);
  rt.warn_seconds.store(warn);
  if (timeout > 0 || warn > 0) {
    Runtime* p = &rt;
    std::call_once(rt.watchdog_started, [p] { std::thread(Watchdog, p).detach(); });
  }
}

// A collective refused at trace time on communicator `id` (vjpmpi.scatter's root, with
// `root`; -1: an op without one), for the ranks that wait in it (Refusal, in this rank's
// header of the default communicator's window). `op` "": this rank goes on with a call
// on `id`, and the note goes if it is about a communicator of the same ranks (its Dups
// share the group's hash); returns whether a note is left.
inline bool NoteRefusal(Runtime& rt, int64_t id, const std::string& op, int root,
                        const std::string& message) {
  CommEntry* world = rt.world.load();
  CommEntry* e = rt.comms.Get(id);
  if (world == nullptr || world->channel == nullptr || e == nullptr) return false;
  std::lock_guard<std::mutex> lock(rt.site_mutex);  // (one writer at a time)
  Refusal& n = world->channel->header()->refused;
  if (op.empty() && (n.k == 0 || n.group != e->group)) return n.k != 0;
  __atomic_store_n(&n.serial_end, 0, __ATOMIC_RELAXED);
  std::atomic_thread_fence(std::memory_order_release);
  n.group = e->group;
  n.k = op.empty() ? 0 : __atomic_load_n(&e->count, __ATOMIC_RELAXED) + 1;
  n.root = root;
  std::memset(n.op, 0, sizeof(n.op));
  std::strncpy(n.op, op.c_str(), sizeof(n.op) - 1);
  std::snprintf(n.message, sizeof(n.message), "%s", message.c_str());
  const int64_t serial = ++rt.refusal_serial;
  std::atomic_thread_fence(std::memory_order_release);
  __atomic_store_n(&n.serial, serial, __ATOMIC_RELAXED);
  __atomic_store_n(&n.serial_end, serial, __ATOMIC_RELEASE);
  return n.k != 0;
}

}  // namespace vjpmpi
