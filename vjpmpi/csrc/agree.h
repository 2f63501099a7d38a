// The ranks of a communicator agree on each collective before any data moves.
//
// Communicators: a program names a communicator by vjpmpi's own number for it
// (CommEntry, never reused), not by MPI's handle, which MPI hands to the next
// communicator once this one is freed; a freed communicator's programs fail.
// Its collectives belong to the first thread that runs one (MPI leaves collectives
// issued from several threads on one communicator in an undefined order).
//
// (Types here; the communicator table in comm.cc, the protocol in agree.cc.)
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
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "mpi_ops.h"

namespace vjpmpi {

struct Runtime;

inline constexpr int kRing = 256;  // entries each rank keeps per communicator

enum EntryFlags : int32_t {
  kVerifying = 1,  // this rank compares before moving data (it can be told of a mismatch)
  kInvalid = 2,    // this rank's arguments were invalid: its message is in its Header
  kReverse = 4,    // a scan from the last rank down
  kUsesRed = 8,    // the op takes a reduction
  kUsesRoot = 16,  // the op takes a root
  kWaitsForAll = 32,  // each rank's result needs every other rank's input: no rank leaves
                      // the op before every rank has entered it (allreduce; not reduce)
  kAfterRefusal = 64,  // this rank refused collective #k here at trace time and runs this
                       // one in its place: its note stands until the ranks that wait in
                       // the refused call have stopped there (Verify)
};

// One collective as a rank published it (slot k % kRing of its ring).
struct Entry {
  int64_t k;         // the collective's number on this communicator, 1, 2, ... (0: empty)
  uint64_t sig;      // the signature of its program on this communicator (0: unknown)
  uint64_t history;  // hash of this rank's collectives 1..k here
  int64_t site;      // call-site hash (VJPMPI_CHECK / VJPMPI_TIMEOUT), or 0
  int64_t position;  // its number within this run of the program (1: the first)
  char op[16];
  int32_t kind, red, root, ndim, flags;
  int32_t layout;  // a device call's: its devices' layout (mesh, split), hashed; else 0
  int64_t dims[kMaxDims];  // the per-rank block; ndim > kMaxDims: the last hashes the rest
  char site_text[176];     // the call site's text (VJPMPI_CHECK / VJPMPI_TIMEOUT), or ""
  int64_t k_end;           // == k once the entry is complete (written last)
};

// A collective this rank refused at trace time (an argument error only it can see:
// `vjpmpi.scatter`'s root), published in its header of the default communicator's window
// (a refusal at a communicator's first collective has no window of its own yet): the
// communicator (`group`: the hash of its ranks' places in the default communicator),
// the collective's number there (`k`: one past the rank's count at the refusal), what it
// was and why. A rank that waits in the same collective there, while the refusing rank
// stays one short of it (a second), ends it with this message instead of waiting.
// When the refusing rank goes on there with another call (not the refused one again: a
// retry pairs as usual), that call's entry says so (kAfterRefusal) and the note stands
// until every rank waiting in the refused call has stopped: the ranks end up at the same
// call. `serial` changes with each note (0: none) and `serial_end` repeats it last, so
// that a read that overlaps a write is seen as torn.
struct Refusal {
  int64_t serial;
  uint64_t group;
  int64_t k, root;
  char op[16];
  char message[720];
  int64_t serial_end;
};

// What a rank publishes about itself on the communicator (the window's first bytes).
struct Header {
  int64_t finalized;  // 1 once MPI_Finalize started on this rank
  int64_t invalid_k;  // the collective whose arguments this rank found invalid
  int64_t count;      // its latest published collective
  Refusal refused;    // (the default communicator's window only)
  char message[1024 - 24];  // why they were invalid
};

struct Channel {
  MPI_Comm dup = MPI_COMM_NULL;  // the window's communicator (never used for data)
  MPI_Win win = MPI_WIN_NULL;
  char* base = nullptr;  // this rank's window memory
  Header* header() { return reinterpret_cast<Header*>(base); }
  Entry* slot(int64_t k) {
    return reinterpret_cast<Entry*>(base + sizeof(Header)) + (k % kRing);
  }
  static MPI_Aint Offset(int64_t k) {
    return static_cast<MPI_Aint>(sizeof(Header) + (k % kRing) * sizeof(Entry));
  }
  static constexpr size_t kBytes = sizeof(Header) + kRing * sizeof(Entry);
};

// A communicator as programs name it. Fields past `busy` are used under it.
struct CommEntry {
  std::atomic<MPI_Comm> comm{MPI_COMM_NULL};  // MPI_COMM_NULL once freed
  int64_t id = 0;
  int size = 0, rank = 0;
  bool spans_nodes = false;  // its processes are on more than one node (SpansNodes)
  std::atomic<uint64_t> owner{0};  // the Python thread that owns its collectives (0: none yet)
  std::atomic<bool> busy{false};   // set through each collective on it
  std::atomic<int> started{0};     // started calls (vjpmpi.start) not yet finished on its thread
  int64_t count = 0;               // collectives run on it by this process
  uint64_t history = 0;
  int64_t run = 0;  // the XLA run id of the last collective's execution
  bool ran = false;
  int64_t position = 0;  // collectives of that execution so far
  int mode = 0;          // this execution: 0 publish only, 1 verify the first, 2 verify all
  uint64_t last_verified = 0;
  std::unordered_set<uint64_t> verified;  // program signatures verified on it
  // A peer's refusal that stopped this rank in collective #told_k here (RefusedError):
  // this rank's next call there is #told_k again, and waits for ranks still in the
  // refused call to stop there too (Verify) rather than take their entry for a mismatch.
  int64_t told_k = 0;
  Refusal told{};
  Channel* channel = nullptr;
  // Each rank's place in the default communicator (-1: not in it) and a hash of them,
  // the same on every rank of it (refusal notes name the communicator by it).
  std::vector<int> in_world;
  uint64_t group = 0;
  // The window's communicator while its MPI_Comm_idup is pending: a first collective that
  // stopped waiting for the others (a peer's refusal) leaves it for the next one, which the
  // others' idup then completes.
  MPI_Request opening = MPI_REQUEST_NULL;
  MPI_Comm opening_dup = MPI_COMM_NULL;
  // The window's place in the order windows close at finalize, the same on every rank of
  // it: (its rank 0's count of windows opened then, that rank's place in COMM_WORLD).
  int64_t close_key[2] = {0, 0};
};

// Communicator numbers -> entries: two levels, lock-free to read, never moved.
struct CommTable {
  static constexpr int64_t kChunk = 1024, kChunks = 4096;
  std::atomic<CommEntry*> chunks[kChunks] = {};
  std::mutex mutex;  // adding
  int64_t next = 1;

  CommEntry* Get(int64_t id) {
    if (id <= 0 || id >= kChunk * kChunks) return nullptr;
    CommEntry* chunk = chunks[id / kChunk].load(std::memory_order_acquire);
    if (chunk == nullptr) return nullptr;
    CommEntry* e = &chunk[id % kChunk];
    return e->id == id ? e : nullptr;
  }

  // (caller holds `mutex`)
  CommEntry* Add() {
    int64_t id = next;
    if (id >= kChunk * kChunks) return nullptr;
    CommEntry* chunk = chunks[id / kChunk].load(std::memory_order_acquire);
    if (chunk == nullptr) {
      chunk = new CommEntry[kChunk];
      chunks[id / kChunk].store(chunk, std::memory_order_release);
    }
    ++next;
    CommEntry* e = &chunk[id % kChunk];
    e->id = id;
    return e;
  }
};

inline uint64_t ThreadId() {  // (what Python's threading.get_native_id() gives)
  static thread_local uint64_t tid = static_cast<uint64_t>(syscall(SYS_gettid));
  return tid;
}
// The error texts of a second thread in a collective on one communicator.
std::string BusyError(int64_t id, int size);
std::string ThreadError(uint64_t me, uint64_t owner, int64_t id, int size);

// FNV-1a, 64 bits: call sites and messages are named by the hash of their text, the
// same in every process (programs hold no per-process numbers for them).
int64_t TextHash(const std::string& s);

inline uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h * 1099511628211ULL;
}

// The fingerprint fields of `c` in `e`, and what entries say ("allreduce(SUM) on
// float32[2, 3]").
void Fingerprint(const Call& c, Entry& e);
std::string Describe(const Entry& e);

// ------------------------------------------------------- communicators --
// vjpmpi's number for `comm` (given at its first use, kept on it as an attribute, so
// every mpi4py object of one communicator has the same number).
std::string CommNumber(Runtime& rt, MPI_Comm comm, int64_t* id);

// The communicator a program names, if it is alive (and, for a collective on a Python
// thread, that thread's): sets c.comm and *out.
std::string Resolve(Runtime& rt, Call& c, int64_t id, bool collective, CommEntry** out);

// Each rank's place in the default communicator `world` (CommEntry::in_world, group).
void PlaceInWorld(CommEntry& e, MPI_Comm comm, MPI_Comm world);

// The default communicator (vjpmpi's number `id`): its window opened at import (agree.cc).
std::string OpenWorld(Runtime& rt, int64_t id);

// A collective refused at trace time on communicator `id`, for the ranks that wait in
// it (Refusal); `op` "": this rank goes on with a call on `id`. Whether a note is left.
bool NoteRefusal(Runtime& rt, int64_t id, const std::string& op, int root,
                 const std::string& message);
// This rank's note, if it refuses collective #k of `ce` (*out: a copy); and the note's
// end once no rank waits in the refused call (if it is still note `serial`).
bool StandingRefusal(Runtime& rt, const CommEntry& ce, int64_t k, Refusal* out);
void ClearRefusal(Runtime& rt, int64_t serial);

// ---------------------------------------------------------- agreement --
// A communicator's window, opened at its first collective `c` (collectively).
std::string EnsureChannel(Runtime& rt, CommEntry& ce, const Call& c);

// Before a collective's data moves: number and publish it; when this rank compares
// this run of its program (a program new to it here, or VJPMPI_CHECK), compare it.
std::string Agree(Runtime& rt, CommEntry& ce, Call& c, uint64_t sig, int64_t run,
                  const std::string& invalid_message);

// What one read of another rank's window gives: its header's first fields and one slot.
struct Peek {
  int64_t finalized, invalid_k, count;
  Entry entry;
};
// One read of rank q's window (deadline: ns, 0: none; *late when it passed).
std::string Read(Channel& ch, int q, int64_t slot_k, Peek* out, const char* op,
                 int64_t deadline = 0, bool* late = nullptr);
// Rank q (of `e`)'s header in the default communicator's window, up to its message.
bool ReadPresence(Runtime& rt, const CommEntry& e, int q, Header* out);
// Whether rank q's refusal note `n` refuses collective #k of `e`, `op` with `root`.
bool Refuses(const Refusal& n, const CommEntry& e, int64_t k, const char* op, int root);

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

// The error of a rank whose peer q refused the collective it waits in.
std::string RefusedError(int q, const Refusal& n, const std::string& where);

}  // namespace vjpmpi
