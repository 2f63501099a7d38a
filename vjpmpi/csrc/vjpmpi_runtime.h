// Run-time services shared by every backend's handlers: the one Runtime (call
// sites, settings, counters, trace, watchdog) and how modules share it, the
// per-call guard (overlap counter, opt-in trace), the opt-in collective mismatch
// check (VJPMPI_CHECK) and the opt-in timeout watchdog (VJPMPI_TIMEOUT).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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
  // its id as the `site` attribute (0: none).
  std::mutex site_mutex;
  std::vector<std::string> sites{""};

  // Settings (configure()).
  std::atomic<bool> check_enabled{false};
  std::atomic<double> timeout_seconds{0.0};

  // Kernel entries that found another vjpmpi kernel of this process still
  // running: with a correct token chain this stays 0 (checked by the tests).
  std::atomic<int64_t> in_flight{0};
  std::atomic<int64_t> overlaps{0};
  std::atomic<int64_t> calls{0};

  // Opt-in trace (VJPMPI_TRACE=1 when the CPU module is loaded): the sequence of
  // collectives this process ran, to compare across ranks.
  const bool tracing = [] {
    const char* v = std::getenv("VJPMPI_TRACE");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  std::mutex trace_mutex;
  std::vector<std::string> trace_log;

  // The call the watchdog looks at: start time (ns since epoch, 0 = idle).
  std::atomic<int64_t> watch_start{0};
  std::atomic<int64_t> watch_site{0};
  std::atomic<const char*> watch_op{nullptr};
  std::atomic<MPI_Comm> watch_comm{MPI_COMM_NULL};
  std::once_flag watchdog_started;
};

// Bump when Runtime changes (members, order or meaning).
inline constexpr uint32_t kRuntimeLayout = 1;
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

inline std::string Site(Runtime& rt, int64_t id, const char* op) {
  std::lock_guard<std::mutex> lock(rt.site_mutex);
  if (id > 0 && static_cast<size_t>(id) < rt.sites.size()) return rt.sites[id];
  return op;
}

inline int64_t RegisterSite(Runtime& rt, const std::string& text) {
  std::lock_guard<std::mutex> lock(rt.site_mutex);
  rt.sites.push_back(text);
  return static_cast<int64_t>(rt.sites.size() - 1);
}

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Guard {
  Runtime& rt;
  Guard(Runtime& r, const char* name, int64_t site, MPI_Comm comm) : rt(r) {
    if (rt.tracing) {
      std::lock_guard<std::mutex> lock(rt.trace_mutex);
      rt.trace_log.emplace_back(name);
    }
    rt.calls.fetch_add(1, std::memory_order_relaxed);
    if (rt.in_flight.fetch_add(1, std::memory_order_acq_rel) != 0) {
      rt.overlaps.fetch_add(1, std::memory_order_relaxed);
    }
    if (rt.timeout_seconds.load(std::memory_order_relaxed) > 0) {
      rt.watch_op.store(name);
      rt.watch_site.store(site);
      rt.watch_comm.store(comm);
      rt.watch_start.store(NowNs());
    }
  }
  ~Guard() {
    rt.watch_start.store(0);
    rt.in_flight.fetch_sub(1, std::memory_order_acq_rel);
  }
};

// Using vjpmpi after MPI_Finalize is an error, not a crash.
inline std::string CheckAlive(const char* op) {
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin) return std::string("vjpmpi.") + op + ": MPI has already been finalized";
  return {};
}

// ------------------------------------------------------ mismatch check --
struct Fingerprint {
  char op[24];
  int32_t kind, red, root, pad;
  int64_t count;
  char where[224];
};

inline void CopyText(char* dst, size_t n, const std::string& s) {
  std::snprintf(dst, n, "%s", s.c_str());
}

// Before a collective: every rank of `c.comm` shares what it is about to run;
// on disagreement every rank returns the same message listing all of them.
inline std::string CheckCollective(Runtime& rt, const Call& c, int64_t site) {
  Fingerprint mine{};
  CopyText(mine.op, sizeof(mine.op), c.op);
  mine.kind = static_cast<int32_t>(c.kind);
  mine.red = static_cast<int32_t>(c.red);
  mine.root = c.root;
  mine.count = static_cast<int64_t>(c.count);
  CopyText(mine.where, sizeof(mine.where), Site(rt, site, c.op));
  int size = 1;
  MPI_Comm_size(c.comm, &size);
  std::vector<Fingerprint> all(size);
  std::string e = Check(MPI_Allgather(&mine, sizeof(mine), MPI_BYTE, all.data(), sizeof(mine),
                                      MPI_BYTE, c.comm),
                        c.op, "MPI_Allgather (VJPMPI_CHECK)");
  if (!e.empty()) return e;
  bool same = true;
  for (const Fingerprint& f : all) {
    same = same && std::strncmp(f.op, all[0].op, sizeof(f.op)) == 0 && f.kind == all[0].kind &&
           f.red == all[0].red && f.root == all[0].root && f.count == all[0].count;
  }
  if (same) return {};
  std::string msg = "vjpmpi: collective mismatch (VJPMPI_CHECK) on a communicator of " +
                    std::to_string(size) + " ranks; each rank was about to run:";
  for (int r = 0; r < size; ++r) {
    msg += "\n  rank " + std::to_string(r) + ": " + all[r].where + " [" + all[r].op + ", " +
           std::to_string(all[r].count) + " elements of " + KindName(static_cast<Kind>(all[r].kind)) +
           "]";
  }
  return msg;
}

// ------------------------------------------------------------ watchdog --
inline void Watchdog(Runtime* rtp) {
  Runtime& rt = *rtp;
  for (;;) {
    double limit = rt.timeout_seconds.load();
    auto nap = std::chrono::milliseconds(limit < 2.0 ? 20 : 100);
    std::this_thread::sleep_for(nap);
    int64_t start = rt.watch_start.load();
    if (start == 0 || limit <= 0) continue;
    double waited = (NowNs() - start) * 1e-9;
    if (waited < limit) continue;
    int world = 0, size = 0, rank = -1, csize = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm comm = rt.watch_comm.load();
    if (comm != MPI_COMM_NULL) {
      MPI_Comm_rank(comm, &rank);
      MPI_Comm_size(comm, &csize);
    }
    const char* op = rt.watch_op.load();
    std::string where = Site(rt, rt.watch_site.load(), op ? op : "?");
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
