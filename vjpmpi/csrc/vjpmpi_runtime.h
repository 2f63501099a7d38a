// Run-time services shared by every backend's handlers: the per-call guard
// (overlap counter, opt-in trace), the opt-in collective mismatch check
// (VJPMPI_CHECK) and the opt-in timeout watchdog (VJPMPI_TIMEOUT).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "vjpmpi_mpi.h"

namespace vjpmpi {

// ------------------------------------------------------------ call sites --
// Python registers a description of each call site ("bcast(root=0) float32[8]
// at train.py:12") when the check or the timeout is on, and passes its id as
// the `site` attribute (0: none).
inline std::mutex site_mutex;
inline std::vector<std::string> sites{""};

inline int64_t RegisterSite(const std::string& text) {
  std::lock_guard<std::mutex> lock(site_mutex);
  sites.push_back(text);
  return static_cast<int64_t>(sites.size() - 1);
}

inline std::string Site(int64_t id, const char* op) {
  std::lock_guard<std::mutex> lock(site_mutex);
  if (id > 0 && static_cast<size_t>(id) < sites.size()) return sites[id];
  return op;
}

// ----------------------------------------------------------- settings --
inline std::atomic<bool> check_enabled{false};
inline std::atomic<double> timeout_seconds{0.0};

// ------------------------------------------------- counters and tracing --
// Kernel entries that found another vjpmpi kernel of this process still
// running: with a correct token chain this stays 0 (checked by the tests).
inline std::atomic<int64_t> in_flight{0};
inline std::atomic<int64_t> overlaps{0};
inline std::atomic<int64_t> calls{0};

// Opt-in trace (VJPMPI_TRACE=1 at import): the sequence of collectives this
// process ran, to compare across ranks.
inline const bool tracing = [] {
  const char* v = std::getenv("VJPMPI_TRACE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}();
inline std::mutex trace_mutex;
inline std::vector<std::string> trace_log;

// The call the watchdog looks at: start time (ns since epoch, 0 = idle).
inline std::atomic<int64_t> watch_start{0};
inline std::atomic<int64_t> watch_site{0};
inline std::atomic<const char*> watch_op{nullptr};
inline std::atomic<MPI_Comm> watch_comm{MPI_COMM_NULL};

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Guard {
  Guard(const char* name, int64_t site, MPI_Comm comm) {
    if (tracing) {
      std::lock_guard<std::mutex> lock(trace_mutex);
      trace_log.emplace_back(name);
    }
    calls.fetch_add(1, std::memory_order_relaxed);
    if (in_flight.fetch_add(1, std::memory_order_acq_rel) != 0) {
      overlaps.fetch_add(1, std::memory_order_relaxed);
    }
    if (timeout_seconds.load(std::memory_order_relaxed) > 0) {
      watch_op.store(name);
      watch_site.store(site);
      watch_comm.store(comm);
      watch_start.store(NowNs());
    }
  }
  ~Guard() {
    watch_start.store(0);
    in_flight.fetch_sub(1, std::memory_order_acq_rel);
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
inline std::string CheckCollective(const Call& c, int64_t site) {
  Fingerprint mine{};
  CopyText(mine.op, sizeof(mine.op), c.op);
  mine.kind = static_cast<int32_t>(c.kind);
  mine.red = static_cast<int32_t>(c.red);
  mine.root = c.root;
  mine.count = static_cast<int64_t>(c.count);
  CopyText(mine.where, sizeof(mine.where), Site(site, c.op));
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
inline void Watchdog() {
  for (;;) {
    double limit = timeout_seconds.load();
    auto nap = std::chrono::milliseconds(limit < 2.0 ? 20 : 100);
    std::this_thread::sleep_for(nap);
    int64_t start = watch_start.load();
    if (start == 0 || limit <= 0) continue;
    double waited = (NowNs() - start) * 1e-9;
    if (waited < limit) continue;
    int world = 0, size = 0, rank = -1, csize = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm comm = watch_comm.load();
    if (comm != MPI_COMM_NULL) {
      MPI_Comm_rank(comm, &rank);
      MPI_Comm_size(comm, &csize);
    }
    const char* op = watch_op.load();
    std::string where = Site(watch_site.load(), op ? op : "?");
    std::fprintf(stderr,
                 "vjpmpi: timeout (VJPMPI_TIMEOUT=%g s): rank %d of %d has waited %.1f s in "
                 "%s, on a communicator of %d ranks (rank %d there); the other ranks did not "
                 "join it. Aborting the job.\n",
                 limit, world, size, waited, where.c_str(), csize, rank);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::_Exit(3);
  }
}

inline void Configure(bool check, double timeout) {
  check_enabled.store(check);
  timeout_seconds.store(timeout);
  static std::once_flag started;
  if (timeout > 0) {
    std::call_once(started, [] { std::thread(Watchdog).detach(); });
  }
}

}  // namespace vjpmpi
