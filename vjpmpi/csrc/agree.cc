// The ranks of a communicator agree on each collective before any data moves.
//
// Communicators: a program names a communicator by vjpmpi's own number for it
// (CommEntry, never reused), not by MPI's handle, which MPI hands to the next
// communicator once this one is freed; a freed communicator's programs fail.
// Its collectives belong to the first thread that runs one (MPI leaves collectives
// issued from several threads on one communicator in an undefined order).
//
// Agreement: on each communicator, every rank publishes each collective it is about to
// run (op, dtype, per-rank block shape, root, reduction, and a hash of everything it ran
// before) in a ring of entries in an MPI window of its own (MPI_Win_allocate on a
// private duplicate, made at the communicator's first collective). A rank that runs a
// program new to it (its signature on this communicator not yet verified: Python's
// lowering hashes the program's collectives on it) reads the other ranks' entries for
// the same collective, one-sidedly, before moving any data: ranks that disagree raise,
// or, when a rank that cannot be told is already inside the collective, the job ends
// with the message. Once every rank is seen starting the same program signature at the
// same collective, the program is verified on this communicator and later runs only
// publish (a few stores). VJPMPI_CHECK=1 verifies every collective of every run, and
// also the position within the program (a rank-dependent trip count or branch).
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include "agree.h"
#include "async.h"
#include "runtime.h"

namespace vjpmpi {

std::string BusyError(int64_t id, int size) {
  return "another thread of this process is inside a collective on the same communicator "
         "(vjpmpi's communicator #" + std::to_string(id) + ", of " + std::to_string(size) +
         " ranks). MPI leaves the order of collectives issued from several threads on one "
         "communicator undefined: they could pair differently on each rank. Give each thread "
         "a communicator of its own (comm.Dup(), made in the same order on every rank).";
}

std::string ThreadError(uint64_t me, uint64_t owner, int64_t id, int size) {
  return "thread " + std::to_string(me) + " runs a collective on a communicator that thread " +
         std::to_string(owner) + " owns (vjpmpi's communicator #" + std::to_string(id) +
         ", of " + std::to_string(size) + " ranks; threads as threading.get_native_id() gives "
         "them; a communicator belongs to the first thread that traces or runs a collective "
         "on it). MPI leaves the order of collectives issued from several threads on one "
         "communicator undefined: they could pair differently on each rank. Give each thread "
         "a communicator of its own (comm.Dup(), made in the same order on every rank).";
}

// FNV-1a, 64 bits: call sites and messages are named by the hash of their text, the
// same in every process (programs hold no per-process numbers for them).
int64_t TextHash(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ULL;
  h &= 0x7fffffffffffffffULL;
  return static_cast<int64_t>(h == 0 ? 1 : h);
}


// The fingerprint fields of `c` in `e` (the rest is filled by the caller).
void Fingerprint(const Call& c, Entry& e) {
  std::strncpy(e.op, c.op, sizeof(e.op) - 1);  // (zero-filled)
  e.op[sizeof(e.op) - 1] = '\0';
  e.kind = static_cast<int32_t>(c.kind);
  e.red = (c.uses & kUsesRed) ? static_cast<int32_t>(c.red) : 0;
  e.root = (c.uses & kUsesRoot) ? c.root : 0;
  e.flags = c.uses | (c.reverse ? kReverse : 0);
  e.layout = static_cast<int32_t>(c.layout ^ (c.layout >> 32));
  PackDims(c.dims, c.ndim, e.dims, &e.ndim);
}

uint64_t FingerprintHash(const Entry& e) {
  uint64_t h = 0;
  uint64_t op[sizeof(e.op) / 8];  // (the name, zero-filled, as words: one Mix each)
  std::memcpy(op, e.op, sizeof(op));
  for (uint64_t w : op) h = Mix(h, w);
  h = Mix(h, e.kind);
  h = Mix(h, e.red);
  h = Mix(h, static_cast<uint32_t>(e.root));
  h = Mix(h, e.flags & (kReverse | kUsesRed | kUsesRoot));
  h = Mix(h, e.ndim);
  h = Mix(h, static_cast<uint32_t>(e.layout));
  const int used = e.ndim < kMaxDims ? e.ndim : kMaxDims;  // (ndim is in the hash)
  for (int i = 0; i < used; ++i) h = Mix(h, static_cast<uint64_t>(e.dims[i]));
  return h;
}

bool SameCollective(const Entry& a, const Entry& b) {
  return std::strncmp(a.op, b.op, sizeof(a.op)) == 0 && a.kind == b.kind && a.red == b.red &&
         a.root == b.root && (a.flags & kReverse) == (b.flags & kReverse) && a.ndim == b.ndim &&
         a.layout == b.layout &&
         std::memcmp(a.dims, b.dims, sizeof(a.dims)) == 0;
}

// "allreduce(SUM) on float32[2, 3]", from a published entry.
std::string Describe(const Entry& e) {
  std::string s = std::string(e.op, strnlen(e.op, sizeof(e.op))) + "(";
  std::vector<std::string> parts;
  if (e.flags & kUsesRed) {
    auto names = ReductionNames();
    parts.push_back(e.red >= 0 && e.red < static_cast<int>(names.size()) ? names[e.red] : "?");
  }
  if (e.flags & kUsesRoot) parts.push_back("root=" + std::to_string(e.root));
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? ", " : "") + parts[i];
  s += ")";
  if (e.flags & kReverse) s += " from the last rank down";
  s += std::string(" on ") + KindName(static_cast<Kind>(e.kind)) + "[";
  for (int i = 0; i < e.ndim && i < kMaxDims; ++i) {
    s += (i ? ", " : "") + std::to_string(e.dims[i]);
  }
  if (e.ndim > kMaxDims) s += ", ...";
  s += "]";
  if (e.layout != 0) {  // (a device call)
    char buf[32];
    std::snprintf(buf, sizeof buf, "%08x", static_cast<uint32_t>(e.layout));
    s += std::string(" on devices laid out #") + buf;
  }
  return s;
}

// Which arguments two collectives differ in, in the public API's words.
std::string Differences(const std::vector<Entry>& all, const std::vector<bool>& have) {
  std::vector<std::string> what;
  auto any = [&](auto differ) {
    for (size_t q = 0; q < all.size(); ++q) {
      for (size_t r = 0; r < all.size(); ++r) {
        if (have[q] && have[r] && differ(all[q], all[r])) return true;
      }
    }
    return false;
  };
  if (any([](const Entry& a, const Entry& b) {
        return std::strncmp(a.op, b.op, sizeof(a.op)) != 0 || (a.flags & kReverse) != (b.flags & kReverse);
      })) {
    what.push_back("the collective");
  }
  if (any([](const Entry& a, const Entry& b) { return a.kind != b.kind; })) what.push_back("dtype");
  if (any([](const Entry& a, const Entry& b) {
        return a.ndim != b.ndim || std::memcmp(a.dims, b.dims, sizeof(a.dims)) != 0;
      })) {
    what.push_back("shape");
  }
  if (any([](const Entry& a, const Entry& b) { return a.red != b.red; })) what.push_back("'op'");
  if (any([](const Entry& a, const Entry& b) { return a.root != b.root; })) what.push_back("'root'");
  if (any([](const Entry& a, const Entry& b) { return a.layout != b.layout; })) {
    what.push_back("the layout of the process's devices (mesh, split of the arrays)");
  }
  std::string s;
  for (size_t i = 0; i < what.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == what.size() ? " and " : ", ") + what[i];
  }
  return s;
}

// ---------------------------------------------------------- agreement --

// Wait for `n` requests; with a deadline (ns since epoch, 0: none) give up when it passes
// (*late; the requests are left to the job's end).
std::string AwaitReads(int n, MPI_Request* r, const char* op, int64_t deadline,
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
std::string Read(Channel& ch, int q, int64_t slot_k, Peek* out, const char* op,
                        int64_t deadline, bool* late) {
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
bool ReadPresence(Runtime& rt, const CommEntry& e, int q, Header* out) {
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
bool Refuses(const Refusal& n, const CommEntry& e, int64_t k, const char* op, int root) {
  return n.serial != 0 && n.serial == n.serial_end && n.k == k && n.group == e.group &&
         std::strncmp(n.op, op, sizeof(n.op)) == 0 && n.root == root;
}


// Whether entry `e` is the call that note `n` refused (its op and root).
bool IsRefusedCall(const Refusal& n, const Entry& e) {
  const int root = (e.flags & kUsesRoot) ? e.root : -1;
  return std::strncmp(n.op, e.op, sizeof(n.op)) == 0 && n.root == root;
}

// Whether two entries are the same op with the same root.
bool SameOpAndRoot(const Entry& a, const Entry& b) {
  return std::strncmp(a.op, b.op, sizeof(a.op)) == 0 && a.root == b.root;
}

std::string RefusalText(const Refusal& n) {
  return std::string(n.message, strnlen(n.message, sizeof(n.message)));
}

// The error of a rank whose peer q refused the collective it waits in.
std::string RefusedError(int q, const Refusal& n, const std::string& where) {
  return RefusalText(n) + "\n(rank " + std::to_string(q) + " refused it when it traced the call, "
         "raising this there, and will not run it; the ranks waiting in it stop here: " + where +
         ")";
}

// The limit a wait that keeps its own time gives up at: VJPMPI_TIMEOUT, else 60 s under
// VJPMPI_CHECK, else none (0).
double TimeLimit(const Runtime& rt) {
  double limit = rt.timeout_seconds.load();
  if (limit <= 0 && rt.check_enabled.load(std::memory_order_relaxed)) limit = 60.0;
  return limit;
}

// The deadline `limit` seconds after `start` (ns on NowNs's clock; 0: none). A limit
// that int64 nanoseconds past `start` cannot hold (about 292 years, inf) is no deadline:
// converting it would overflow into the past and end the job at once.
int64_t DeadlineNs(int64_t start, double limit) {
  if (!(limit > 0)) return 0;
  const double ns = limit * 1e9;
  if (!(ns < static_cast<double>(std::numeric_limits<int64_t>::max() - start))) return 0;
  return start + static_cast<int64_t>(ns);
}

// What a call is, in messages: its call site's description, else its op and arrays.
std::string CallText(Runtime& rt, const Call& c) {
  std::string site = c.site ? SiteText(rt, c.site) : std::string();
  if (!site.empty()) return site;
  Entry e{};
  Fingerprint(c, e);
  return Describe(e);
}

// "rank 0 of 4 has waited 61.0 s in <what>, on a communicator of 2 ranks (rank 0 there)"
std::string Waiting(const std::string& what, int csize, int crank, double waited) {
  int world = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  char head[96];
  std::snprintf(head, sizeof(head), "rank %d of %d has waited %.1f s in ", world, size, waited);
  return head + what + ", on a communicator of " + std::to_string(csize) + " ranks (rank " +
         std::to_string(crank) + " there)";
}

// What a warning says after where the call is.
std::string StillWaiting(const Runtime& rt) {
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

void Warn(const Runtime& rt, const std::string& what) {
  std::fprintf(stderr, "vjpmpi: warning (VJPMPI_WARN_AFTER=%g s): %s\n",
               rt.warn_seconds.load(), what.c_str());
  std::fflush(stderr);
}

// The job ends: a rank that cannot be told is inside the collective (or gone).
// The job ends with `msg` (on stderr) when the ranks that must hear of an error cannot.
[[noreturn]] void AbortWith(const std::string& msg, const char* why) {
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
std::string AwaitOpening(Runtime& rt, CommEntry& e, const Call& c) {
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
      std::string failed = RunFailure(rt, c.run);  // (a device call whose run failed)
      if (!failed.empty()) return std::string("vjpmpi.") + c.op + ": " + failed;
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
          e.told_k = e.count + 1;
          e.told = h.refused;
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
std::string OpenChannel(Runtime& rt, CommEntry& e, const Call* c) {
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
  // no rank reads another's ring before it is zeroed (an allreduce: its rank 0's key
  // for the order windows close in, CommEntry::close_key, comes to every rank with it)
  if (err.empty()) {
    const int64_t seq = rt.channels_opened.fetch_add(1) + 1;
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    int64_t mine[2] = {e.rank == 0 ? seq : 0, e.rank == 0 ? world_rank : 0};
    err = Check(MPI_Allreduce(mine, e.close_key, 2, MPI_INT64_T, MPI_MAX, ch->dup), op,
                "MPI_Allreduce (agreement)");
  }
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
std::string OpenWorld(Runtime& rt, int64_t id) {
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

std::string ReadMessage(Channel& ch, int q) {
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
std::string Rows(Runtime& rt, const std::vector<Entry>& all,
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
std::string Places(Runtime& rt, Channel& ch, const std::vector<Entry>& all,
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
// never publishes it, and the caller takes this rank's entry back. `standing`: this rank's
// own refusal of collective #k here (it runs `mine` in the refused call's place): ranks
// that wait in the refused call are waited for until they stop there and call again.
std::string Verify(Runtime& rt, CommEntry& ce, Call& c, const Entry& mine,
                          const std::string& invalid_message, std::vector<Entry>& all,
                          std::vector<int>& state, bool* refused, const Refusal* standing) {
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
  const int64_t deadline = DeadlineNs(start, limit);
  const int root = (mine.flags & kUsesRoot) ? mine.root : -1;
  int waiting = n - 1;
  int64_t nap_ns = 0, next_look = start + 100000000;
  Peek p{};
  bool late = false, warned = false;
  RefusalSeen seen;
  Refusal note{};
  // (a peer's refusal stopped this rank in collective #k before: this is its next call)
  const Refusal* told = ce.told_k == k ? &ce.told : nullptr;
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
        if (standing != nullptr && IsRefusedCall(*standing, p.entry) &&
            !IsRefusedCall(*standing, mine)) {  // q waits in the call this rank refused
          if (!(p.entry.flags & kVerifying)) {
            AbortWith(RefusedError(me, *standing, "their collective #" + std::to_string(k) +
                                                      " on a communicator of " +
                                                      std::to_string(n) + " ranks"),
                      " (the ranks inside the call cannot be told)");
          }
          continue;  // (until it stops there, told by this rank's note, and calls again)
        }
        if (told != nullptr && IsRefusedCall(*told, p.entry) && !IsRefusedCall(*told, mine)) {
          continue;  // (q still waits in the refused call: it stops there, told as this rank
        }            // was, and calls again; the refusing rank waits for it too)
        if ((p.entry.flags & kAfterRefusal) && !SameOpAndRoot(p.entry, mine)) {
          Header h{};  // q refused collective #k at trace time and goes on with another call
          if (!ReadPresence(rt, ce, q, &h)) continue;  // (its note stands: read it again)
          if (Refuses(h.refused, ce, k, c.op, root)) {  // this rank waits in the refused call
            state[q] = kRefused;
            note = h.refused;
            *refused = true;
            --waiting;
            progress = true;
            continue;
          }
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
    if (now >= next_look && !RunFailure(rt, c.run).empty()) {  // (its run failed elsewhere)
      return std::string("vjpmpi.") + c.op + ": " + RunFailure(rt, c.run);
    }
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
    ce.told_k = k;
    ce.told = note;
    std::string error = RefusedError(q, note, "their collective #" + std::to_string(k) +
                                                        " on a communicator of " +
                                                        std::to_string(n) + " ranks; each rank:" +
                                                        Rows(rt, all, state, me));
    for (int r = 0; r < n; ++r) {  // (a rank that has stopped there already runs another)
      if (r != me && state[r] == kHave && !(all[r].flags & kVerifying) &&
          IsRefusedCall(note, all[r])) {
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
std::string EnsureChannel(Runtime& rt, CommEntry& ce, const Call& c) {
  if (ce.size <= 1 || ce.channel != nullptr) return {};
  return OpenChannel(rt, ce, &c);
}

// Before a collective's data moves: number and publish it; when this rank compares
// this run of its program (a program new to it here, or VJPMPI_CHECK), compare it.
std::string Agree(Runtime& rt, CommEntry& ce, Call& c, uint64_t sig, int64_t run,
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
  // This rank's refusal of the collective it now runs in its place (a trace-time refusal
  // here, then another call): compared, the note standing until the others have left it.
  Refusal standing{};
  const bool after_refusal = rt.refusal_standing.load(std::memory_order_acquire) &&
                             StandingRefusal(rt, ce, ce.count + 1, &standing);
  bool verifying = ce.mode != 0 || !invalid_message.empty() || after_refusal;
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
  if (after_refusal) s->flags |= kAfterRefusal;
  __atomic_store_n(&s->k_end, k, __ATOMIC_RELEASE);
  __atomic_store_n(&ch.header()->count, k, __ATOMIC_RELEASE);
  if (!verifying) return {};
  const Entry mine = *s;
  std::vector<Entry> all;
  std::vector<int> state;
  bool refused = false;
  std::string e = Verify(rt, ce, c, mine, invalid_message, all, state, &refused,
                         after_refusal ? &standing : nullptr);
  if (after_refusal) ClearRefusal(rt, standing.serial);  // (no rank waits in it now)
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

// `root`; -1: an op without one), for the ranks that wait in it (Refusal, in this rank's
// header of the default communicator's window). `op` "": this rank goes on with a call
// on `id`, and the note goes if it is about a communicator of the same ranks (its Dups
// share the group's hash); returns whether a note is left.
bool NoteRefusal(Runtime& rt, int64_t id, const std::string& op, int root,
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
  rt.refusal_comm = e->id;
  n.k = op.empty() ? 0 : __atomic_load_n(&e->count, __ATOMIC_RELAXED) + 1;
  n.root = root;
  std::memset(n.op, 0, sizeof(n.op));
  std::strncpy(n.op, op.c_str(), sizeof(n.op) - 1);
  std::snprintf(n.message, sizeof(n.message), "%s", message.c_str());
  const int64_t serial = ++rt.refusal_serial;
  std::atomic_thread_fence(std::memory_order_release);
  __atomic_store_n(&n.serial, serial, __ATOMIC_RELAXED);
  __atomic_store_n(&n.serial_end, serial, __ATOMIC_RELEASE);
  rt.refusal_standing.store(n.k != 0, std::memory_order_release);
  return n.k != 0;
}

// This rank's refusal note, if it refuses collective #k of `ce` (*out: a copy; a note of
// the refused call's communicator about another collective goes: this rank is past it).
bool StandingRefusal(Runtime& rt, const CommEntry& ce, int64_t k, Refusal* out) {
  CommEntry* world = rt.world.load();
  if (world == nullptr || world->channel == nullptr) return false;
  int64_t other = 0;
  {
    std::lock_guard<std::mutex> lock(rt.site_mutex);
    const Refusal& n = world->channel->header()->refused;
    if (n.serial == 0 || n.serial != n.serial_end || n.k == 0 || ce.id != rt.refusal_comm) {
      return false;
    }
    if (n.k == k) {
      *out = n;
      return true;
    }
    other = n.serial;
  }
  ClearRefusal(rt, other);
  return false;
}

// The note goes (if it is still note `serial`): no rank waits in the refused call now.
void ClearRefusal(Runtime& rt, int64_t serial) {
  CommEntry* world = rt.world.load();
  if (world == nullptr || world->channel == nullptr) return;
  std::lock_guard<std::mutex> lock(rt.site_mutex);
  Refusal& n = world->channel->header()->refused;
  if (n.serial != serial) return;
  __atomic_store_n(&n.serial_end, 0, __ATOMIC_RELAXED);
  std::atomic_thread_fence(std::memory_order_release);
  n.k = 0;
  const int64_t next = ++rt.refusal_serial;
  std::atomic_thread_fence(std::memory_order_release);
  __atomic_store_n(&n.serial, next, __ATOMIC_RELAXED);
  __atomic_store_n(&n.serial_end, next, __ATOMIC_RELEASE);
  rt.refusal_standing.store(false, std::memory_order_release);
}

}  // namespace vjpmpi
