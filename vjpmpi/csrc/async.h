// Asynchronous collectives on the host: a thread per communicator runs the MPI calls of
// the handlers that move at least the threshold (GoesAsync; under "auto", call sites
// whose program computes beside them: SiteRecord), in the order the
// handlers post them, while XLA's executor runs whatever in the program does not wait
// for the message; the handler returns a future that the job completes, on another
// thread (Completers below).
//
// The ordering chain makes each vjpmpi call of a program wait for the previous one to
// complete, so a program has at most one job queued or running: the thread adds no
// reordering, and MPI sees the program's calls one at a time. The thread that ran the
// job hands the communicator's loop over (CommThread::Handoff) and completes the future
// itself, which runs XLA's continuation (the program's next steps) there: the program's
// next call finds the loop free, and takes that thread back where it has returned (no
// wake-up of another thread on the way: a completion thread woken for each call cost a
// 1 MiB send + recv over loopback TCP 1.08-1.11x mpi4jax's time).
#pragma once

#include <pthread.h>
#include <time.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "agree.h"
#include "mpi_ops.h"

namespace vjpmpi {

// Whether the calling thread is a communicator's (for the tests: XLA's continuations
// never run there).
bool& OnCommThread();

class CommThread;

// The communicator's thread that the calling thread is (nullptr on any other thread).
CommThread*& CurrentCommThread();

// One thread running posted jobs in order (a communicator's, or a completion thread).
// A communicator's thread also polls the messages of started calls (vjpmpi.start)
// between its jobs, in the order they were posted, until each is done.
//
// The thread is not always the same one: a job may hand the loop over (Handoff) and go
// on with other work on its thread (an asynchronous call's completion: XLA's
// continuation, the program's next steps), and the next job that comes finds the loop
// without a thread and has an idle one (of a pool shared by every loop, grown where none
// is idle) take it on; the thread that handed it over takes it back when it returns, if
// no other thread did meanwhile.
class CommThread {
 public:
  void Post(std::function<void()> job);

  // (in a job, on this loop's thread) The loop goes on without the calling thread, which
  // is no longer the communicator's when this returns (OnCommThread, CurrentCommThread):
  // the loop's next job, or its started calls' polls, get another thread.
  void Handoff();

  // What a poll of a started call found: its call has ended (the poll goes), it has not,
  // or another thread tests it now (its wait): the thread then has nothing to do for it,
  // and where every poll it has is parked it sleeps until a job comes, rather than nap
  // and wake while the wait runs (a wait that stops testing a call not yet ended posts
  // the thread a job: see WaitFor).
  enum class Poll { kDone, kPending, kParked };

  // (on this thread) `poll()` until it returns kDone (its call has ended).
  void AddPoll(std::function<Poll()> poll) { polls_.push_back(std::move(poll)); }

  // The thread ends after the jobs posted so far, and deletes this object.
  void Stop();

  explicit CommThread(bool communicator = true);

  // (on a thread of the pool) Runs the loop until it ends (the object is deleted then) or
  // a job hands it over and another thread has taken it on by the time that job returns.
  void Loop();

 private:
  // (after a job that handed the loop over) Whether this thread takes it back.
  bool Reclaim();

  const bool communicator_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::function<Poll()>> polls_;  // (on the loop's thread only)
  static constexpr int kSpins = 200;       // polling rounds before the first sleep
  static constexpr int kMaxNapUs = 1000;  // the longest sleep between rounds
  bool stop_ = false;  // (set and read on the loop's thread only)
  // (under mutex_) a thread runs the loop, or has been asked to; threads that handed
  // the loop over and have not come back; the loop has ended (deleted when none is out)
  bool has_thread_ = true;
  int out_ = 0;
  bool finished_ = false;
};

// `job` on communicator `comm`'s thread (one per communicator, made at its first job).
void PostOn(int64_t comm, std::function<void()> job);
// The communicator was freed: its thread ends (after a job it may still run).
void StopCommThread(int64_t comm);
// `job` on a completion thread (an idle one, else a new one): a started call's wait
// completed there (Started::Finish) runs XLA's continuation off the communicator's thread.
void Complete(std::function<void()> job);

// The smallest call, in bytes (its larger side, in or out), whose MPI call runs on the
// communicator's thread; -1: none; kAsyncAuto: kAutoAsyncBytes on a communicator whose
// processes are on more than one node, none on one within a node. Set from Python
// (VJPMPI_ASYNC_BYTES at import, vjpmpi.async_threshold), read by each call when it runs.
inline constexpr int64_t kAsyncAuto = -2;
// 1 MiB: a hand-off to the thread and back costs about 8 us (a 64 KiB sendrecv over
// loopback TCP took 1.13x mpi4py's with it), the transfer time of 100 KB at 100 Gb/s:
// below 1 MiB the overlap a call can win is not worth what every call pays.
inline constexpr int64_t kAutoAsyncBytes = 1 << 20;
extern std::atomic<int64_t> async_bytes;  // (async.cc)
inline std::atomic<int64_t>& AsyncBytes() { return async_bytes; }

// The thread support MPI provides (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
int ThreadLevel();


// Whether a call moving `moved` bytes on `ce` runs on the communicator's thread: it
// moves data, at least the threshold, and MPI lets another thread make the calls
// (MPI_THREAD_SERIALIZED or more; where it does not, every call runs on XLA's thread).
// Within one node nothing overlaps (shared-memory transfers are the CPU's work) and the
// hand-offs only cost: by default calls go there only on a communicator across nodes.
// The MPI call is the same blocking call wherever it runs: which thread runs a call
// that stays on XLA's side depends on timing (the thread that completes its last input
// runs it), and MPI never matches a blocking collective with a nonblocking one (an
// earlier version used nonblocking calls on this thread only, and a 4-rank FFT hung
// with one rank in MPI_Allreduce and another in MPI_Iallreduce); their algorithms
// differ too (MPICH's MPI_Ireduce_scatter_block sums in another order at 4 ranks).
//
// While a started call (vjpmpi.start) posted on the communicator's thread (not a direct
// one: XLA's thread posts those) has not finished there, every later call on that
// communicator goes there too, behind it: MPI then sees the calls in the program's order.
inline bool GoesAsync(size_t moved, const CommEntry& ce) {
  if (ce.started.load(std::memory_order_acquire) > 0) return true;
  int64_t limit = AsyncBytes().load(std::memory_order_relaxed);
  if (limit == kAsyncAuto) limit = ce.spans_nodes ? kAutoAsyncBytes : -1;
  if (limit < 0 || moved == 0 || moved < static_cast<size_t>(limit)) return false;
  return ThreadLevel() >= MPI_THREAD_SERIALIZED;
}

// ------------------------------------------------- "auto", call site by call site --
// Under "auto", a call that the threshold sends to the communicator's thread (not one
// that a started call sends there) goes there only while that pays, call site by call
// site: the hand-offs cost every call (a 1 MiB sendrecv over loopback TCP in a loop with
// nothing beside it took 1.07-1.12x mpi4jax's time asynchronously, 0.92-1.02x not),
// and what they buy is the computation XLA's threads run while the message travels (a
// halo step's interior: 1.33x its compute time against 1.41x synchronously). What ran
// beside the call is the CPU time, while the MPI call runs, of the thread that posted it
// (its own clock, pthread_getcpuclockid, read from the thread that runs the call), or of
// the process's other threads, whichever is more (ThreadCpu::Beside): in a loop of
// 1 MiB exchanges over TCP mostly 0 (the posting thread came back and took the call on
// itself), at most 0.19 ms of 0.6-8 ms at 4 ranks on 2 cores; beside a halo step's
// interior 0.2-44 ms of 40 ms; beside a backward pass 46 ms of 48 ms, on another thread
// than the one that posted the gradients' allreduce. Where that stayed under
// kOverlapFloorNs (0.2 ms: a loop's own work beside its calls, on a busy node, reached
// 0.11 ms) and a quarter of the call's time in kIdleRuns asynchronous runs in a row,
// the site's next kSyncRuns runs stay on XLA's thread; then one runs asynchronously
// again, to see (and where nothing ran beside it either, the next kSyncRuns stay
// again). A large started call (vjpmpi.start) that XLA's thread posts is polled from
// its start the same way: while the program computes at least kOverlapFloorNs between
// its start and its wait. The MPI calls are the same on either thread, so ranks may
// choose differently.
class SiteRecord {
 public:
  static constexpr int kIdleRuns = 3;
  static constexpr int kSyncRuns = 64;
  static constexpr int64_t kOverlapFloorNs = 200'000;

  // (XLA's thread, for a call "auto" sends to the communicator's thread) Whether this
  // run stays on XLA's thread instead.
  bool StaysSynchronous() {
    int left = sync_left_.load(std::memory_order_relaxed);
    while (left > 0) {
      if (sync_left_.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
        return true;
      }
    }
    return false;
  }
  // (after an asynchronous run) Whether what XLA's thread computed meanwhile
  // (`beside_ns`, ns; negative: not known) paid for the hand-offs (`call_ns`: how long
  // the MPI call took; 0 for a started call: only kOverlapFloorNs counts).
  void Measured(int64_t beside_ns, int64_t call_ns) {
    if (beside_ns < 0 || beside_ns >= kOverlapFloorNs ||
        (call_ns > 0 && 4 * beside_ns >= call_ns)) {
      idle_.store(0, std::memory_order_relaxed);
    } else if (idle_.fetch_add(1, std::memory_order_relaxed) + 1 >= kIdleRuns) {
      idle_.store(kIdleRuns - 1, std::memory_order_relaxed);  // (the probe decides alone)
      sync_left_.store(kSyncRuns, std::memory_order_relaxed);
    }
  }

 private:
  std::atomic<int> idle_{0}, sync_left_{0};
};

// The record of call site `site` on communicator `comm` for its call in XLA's run `run`
// (made at its first call; it goes when the communicator is freed, StopCommThread). A
// site's first kSitePlaces - 1 calls in a run have a record each, its later calls one
// between them: the buckets of a gradient sync are one site, and the first ones travel
// while the backward pass computes, the last after it (one record for all made the last
// buckets' idle runs keep the first ones synchronous: a data-parallel step took 2.00x its
// compute against 1.62x); a loop's calls of one site share a record.
inline constexpr int kSitePlaces = 16;
std::shared_ptr<SiteRecord> SiteRecordOf(int64_t comm, int64_t site, int64_t run);

// Whether "auto" decides where a call that GoesAsync sends to the communicator's thread
// runs (not where an explicit threshold does, or a started call sends every call there).
inline bool AutoDecides(const CommEntry& ce) {
  return AsyncBytes().load(std::memory_order_relaxed) == kAsyncAuto &&
         ce.started.load(std::memory_order_acquire) == 0;
}

// The CPU time of the thread that made it (XLA's, which posted a call) since then, in ns;
// -1 where that thread's clock cannot be read any more.
class ThreadCpu {
 public:
  ThreadCpu();
  int64_t Since() const;
  // (on the thread that runs the call) From now: Since() counts what that thread computes
  // from here, and Beside() what the process's other threads compute.
  void Restart();
  // What XLA computed beside the calling thread since Restart: the most of that thread's
  // time (0 where the calling thread is that one: XLA's thread that posted the call came
  // back to the loop, having nothing else to run, and took the call on itself) and the
  // process's time less the calling thread's (XLA's other threads: a backward pass that
  // computes on one while another posted the gradients' allreduce). The process's clock
  // counts another thread's time as the scheduler ticks (every 4 ms here) while that
  // thread runs: never more than it computed.
  int64_t Beside() const;
  // The process's CPU time since Restart (every thread's; another running thread's as
  // the scheduler ticks), in ns; -1 where not read.
  int64_t ProcessSince() const;

 private:
  pthread_t owner_ = pthread_self();
  clockid_t clock_{};
  int64_t start_ = -1;
  int64_t process_ = -1, self_ = -1;  // (at Restart)
};

// Whether a large started call that XLA's thread posts (a direct one) is polled by the
// communicator's thread from its start, so that its messages move while the program
// computes: where calls may run on that thread (by the threshold: by default, on a
// communicator across nodes). Within a node the polling thread took a core from the
// ranks' own copies: a started 1 MiB exchange waited for at once took 1.2-1.3x mpi4py's
// Sendrecv polled from its start, 0.9-1.0x not (its wait tests it, as MPI_Wait would).
inline bool PollsFromStart(const CommEntry& ce) {
  int64_t limit = AsyncBytes().load(std::memory_order_relaxed);
  return limit == kAsyncAuto ? ce.spans_nodes : limit >= 0;
}

// ------------------------------------------------------------ started calls --
// vjpmpi.start / vjpmpi.wait: a point-to-point call split in two custom calls. A direct
// call (a compiled program in which only vjpmpi calls can stop the run) posts its
// messages on XLA's thread, straight from XLA's buffers: the array sent is an operand of
// the wait and the buffer received into a result of the start that the wait's result
// aliases, so XLA keeps both until the wait, and a failing vjpmpi call between the two
// lets the messages end before its run stops (ForgetRun). Any other started call copies
// the array it sends into a buffer of its own and posts the call to the communicator's
// thread, which receives into another; the wait copies the array received into XLA's
// result: XLA's buffers are never touched after the start has returned, so a program that
// something else stops between the two (a host callback that raised) leaves nothing
// reading or writing them. A call is named by (communicator, slot, run): the slot is
// the start's, fixed when the program was traced, and its wait carries the same one;
// the run is XLA's id of the program's execution, so that two runs of one program (two
// threads) never take each other's calls.
// The buffer of a started call's copy of what it sends or receives: one that a finished
// started call left (a fresh one of some MiB costs the kernel's zeroed pages, and growing
// a vector zeroes it again: a started 64 MiB exchange took 18x mpi4py's time), resized to
// `bytes`: zeroed where `zero` (what a receive leaves unwritten reads as zeros), else
// holding the last call's bytes (to be overwritten).
std::vector<unsigned char> TakeBuffer(size_t bytes, bool zero);
// A finished started call's buffer, kept for the next (a few, up to 1 GiB in all).
void GiveBuffer(std::vector<unsigned char>&& buffer);

struct Posted;  // (p2p.h)

struct Started {
  std::tuple<int64_t, int64_t, int64_t> key;  // (comm, slot, run)
  // `direct`: MPI reads and writes XLA's own buffers, which the program keeps for the wait
  // (the array sent is the wait's operand, the one received the start's result that the
  // wait's aliases); else the buffers below, copied from and into XLA's (an eager start, a
  // device call, or a program with a host callback or another library's custom call:
  // something that can stop the run with XLA's buffers freed while MPI still uses them).
  bool direct = false;
  bool poll_from_start = false;  // (PollsFromStart, where it was started)
  // (polled from its start by "auto"'s choice: its site's record, and the CPU time of the
  // thread that started it and of the process, read when its wait comes; SiteRecord)
  std::shared_ptr<SiteRecord> record;
  std::optional<ThreadCpu> started_by;
  bool wait_to_end = false;      // its wait tests it until it is done (a direct call
                                 // XLA's thread posts, not polled from its start)
  std::vector<unsigned char> send, recv;
  ~Started() {
    GiveBuffer(std::move(send));
    GiveBuffer(std::move(recv));
  }
  std::mutex mutex;
  bool done = false;
  bool posted = false;  // its messages are posted, and a poll ends it (on the thread)
  std::string error;
  std::function<void()> then;  // the wait's completion, where the wait came first

  // Its posted messages, tested by one thread at a time (the communicator's thread's
  // poll, the wait, or a failed run's settling; under `test_mutex`).
  std::mutex test_mutex;
  std::shared_ptr<Posted> req;   // (null until posted)
  Call test_call{};              // the call, its dimensions kept here
  std::vector<int64_t> test_dims, test_dims2;
  bool settled = false;          // its messages are done (and Finish has run)
  bool polled = false;           // the communicator's thread polls it
  bool awaited = false;          // its wait has come and handed it to that thread
  // (set while its wait tests it: the communicator's thread leaves it alone then, rather
  // than contend for MPI's lock and a core with the thread that waits)
  std::atomic<bool> waiting{false};
  // (under test_mutex, once posted) test its messages once; true once they are done
  std::function<bool()> test;

  // (on the communicator's thread, or in the start where MPI cannot take the call
  // there; the first end counts)
  void Finish(std::string e);
};

// A new started call on (comm, slot, run).
std::shared_ptr<Started> NewStarted(int64_t comm, int64_t slot, int64_t run);
// A start that failed: its run stops, and no wait will take its call.
void ForgetStarted(const Started& s);
// A vjpmpi call of run `run` failed: the run stops, and its started calls go (a direct
// one once its messages are done: XLA frees the run's buffers when the failure returns).
void ForgetRun(int64_t run);
// Started calls whose wait has come and found them not done (Started::awaited): while
// there are any, the communicators' threads poll without sleeping between rounds (a
// program waits for them, as MPI_Wait would spin).
std::atomic<int>& AwaitedStarted();
// How many started calls wait for their wait (for the tests).
int64_t StartedCount();
// The started call (comm, slot, run), taken out (nullptr: none).
std::shared_ptr<Started> TakeStarted(int64_t comm, int64_t slot, int64_t run);

// Whether a started call can run on the communicator's thread while XLA's thread makes
// other MPI calls (MPI_THREAD_MULTIPLE); where not, the start makes the whole call.
inline bool ThreadMultiple() { return ThreadLevel() >= MPI_THREAD_MULTIPLE; }

}  // namespace vjpmpi
