// Asynchronous collectives on the host: a thread per communicator runs the MPI calls of
// the handlers that move at least the threshold (GoesAsync), in the order the
// handlers post them, while XLA's executor runs whatever in the program does not wait
// for the message; the handler returns a future that the job completes, on another
// thread (Completers below).
//
// The ordering chain makes each vjpmpi call of a program wait for the previous one to
// complete, so a program has at most one job queued or running: the thread adds no
// reordering, and MPI sees the program's calls one at a time. The job hands the
// future's completion to a completion thread, which runs XLA's continuation (the
// program's next steps) there, and this thread is free for the program's next call.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "vjpmpi_agree.h"
#include "vjpmpi_mpi.h"

namespace vjpmpi {

// Whether the calling thread is a communicator's (for the tests: XLA's continuations
// never run there).
inline bool& OnCommThread() {
  thread_local bool on = false;
  return on;
}

class CommThread;

// The communicator's thread that the calling thread is (nullptr on any other thread).
inline CommThread*& CurrentCommThread() {
  thread_local CommThread* current = nullptr;
  return current;
}

// One thread running posted jobs in order (a communicator's, or a completion thread).
// A communicator's thread also polls the messages of started calls (vjpmpi.start)
// between its jobs, in the order they were posted, until each is done.
class CommThread {
 public:
  void Post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
  }

  // (on this thread) `poll()` until it returns true (its call has ended).
  void AddPoll(std::function<bool()> poll) { polls_.push_back(std::move(poll)); }

  // The thread ends after the jobs posted so far, and deletes this object.
  void Stop() {
    Post([this] { stop_ = true; });
  }

  explicit CommThread(bool communicator = true) {
    std::thread([this, communicator] { Loop(communicator); }).detach();
  }

 private:
  void Loop(bool communicator) {
    OnCommThread() = communicator;
    if (communicator) CurrentCommThread() = this;
    int misses = 0;  // polling rounds since a started call last ended
    while (!stop_ || !polls_.empty()) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (polls_.empty()) ready_.wait(lock, [this] { return !jobs_.empty(); });
        if (!jobs_.empty()) {
          job = std::move(jobs_.front());
          jobs_.pop_front();
        }
      }
      if (job) {
        job();
        misses = 0;
        continue;
      }
      // nothing queued: MPI's progress for the started calls. The thread spins for the
      // first rounds (a message within a node completes in microseconds), then sleeps
      // between rounds, 1 us doubling up to kMaxNapUs: spinning, it took half of a core
      // that the program computes on (a halo step on the simulated network: 1.21x its
      // update's time spinning, 1.04-1.07x sleeping 0.5-2 ms, 1.14x 50 us).
      size_t before = polls_.size();
      polls_.erase(std::remove_if(polls_.begin(), polls_.end(),
                                  [](std::function<bool()>& poll) { return poll(); }),
                   polls_.end());
      misses = polls_.size() < before ? 0 : misses + 1;
      if (!polls_.empty() && misses > kSpins) {
        int shift = std::min(misses - kSpins, 10);
        std::this_thread::sleep_for(std::chrono::microseconds(std::min(1 << shift, kMaxNapUs)));
      }
    }
    delete this;
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::function<bool()>> polls_;  // (on the thread only)
  static constexpr int kSpins = 200;       // polling rounds before the first sleep
  static constexpr int kMaxNapUs = 1000;  // the longest sleep between rounds
  bool stop_ = false;  // (set and read on the thread only)
};

// One thread per communicator (by vjpmpi's number): programs that run at once on two
// Python threads, each on its own communicator, do not queue behind each other, as
// they would not without this thread. Never destroyed: a thread may outlive exit().
struct CommThreads {
  std::mutex mutex;
  std::unordered_map<int64_t, CommThread*> threads;
};
inline CommThreads& TheCommThreads() {
  static CommThreads* t = new CommThreads();
  return *t;
}

inline void PostOn(int64_t comm, std::function<void()> job) {
  CommThreads& all = TheCommThreads();
  CommThread* t;
  {
    std::lock_guard<std::mutex> lock(all.mutex);
    CommThread*& slot = all.threads[comm];
    if (slot == nullptr) slot = new CommThread();
    t = slot;
  }
  t->Post(std::move(job));
}

// The communicator was freed: its thread ends (after a job it may still run).
inline void StopCommThread(int64_t comm) {
  CommThreads& all = TheCommThreads();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto it = all.threads.find(comm);
  if (it == all.threads.end()) return;
  it->second->Stop();
  all.threads.erase(it);
}

// Threads that complete the futures of asynchronous calls. Completing a future runs
// XLA's continuation on the completing thread: the program's next steps, computation
// included, until the executor runs out of ready work. On the communicator's thread
// that computation held up the program's next call (a halo loop's second exchange
// started 20-60 ms after XLA posted it, behind an interior block). A completion takes
// an idle thread, or a new one when every one is busy: there are never more than the
// program's completions running at once, and they stay for the next program.
class Completers {
 public:
  void Run(std::function<void()> job) {
    CommThread* t = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        t = idle_.back();
        idle_.pop_back();
      }
    }
    if (t == nullptr) t = new CommThread(/*communicator=*/false);
    t->Post([this, t, job = std::move(job)] {
      job();
      std::lock_guard<std::mutex> lock(mutex_);
      idle_.push_back(t);
    });
  }

 private:
  std::mutex mutex_;
  std::vector<CommThread*> idle_;
};

// (never destroyed, as the communicators' threads)
inline void Complete(std::function<void()> job) {
  static Completers* c = new Completers();
  c->Run(std::move(job));
}

// The smallest call, in bytes (its larger side, in or out), whose MPI call runs on the
// communicator's thread; -1: none; kAsyncAuto: kAutoAsyncBytes on a communicator whose
// processes are on more than one node, none on one within a node. Set from Python
// (VJPMPI_ASYNC_BYTES at import, vjpmpi.async_threshold), read by each call when it runs.
inline constexpr int64_t kAsyncAuto = -2;
inline constexpr int64_t kAutoAsyncBytes = 1 << 16;
inline std::atomic<int64_t>& AsyncBytes() {
  static std::atomic<int64_t> bytes{kAsyncAuto};
  return bytes;
}

// The thread support MPI provides (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
inline int ThreadLevel() {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided;
}

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
// While a started call (vjpmpi.start) has not finished on the communicator's thread,
// every later call on that communicator goes there too, behind it: MPI then sees the
// calls in the program's order.
inline bool GoesAsync(size_t moved, const CommEntry& ce) {
  if (ce.started.load(std::memory_order_acquire) > 0) return true;
  int64_t limit = AsyncBytes().load(std::memory_order_relaxed);
  if (limit == kAsyncAuto) limit = ce.spans_nodes ? kAutoAsyncBytes : -1;
  if (limit < 0 || moved == 0 || moved < static_cast<size_t>(limit)) return false;
  return ThreadLevel() >= MPI_THREAD_SERIALIZED;
}

// ------------------------------------------------------------ started calls --
// vjpmpi.start / vjpmpi.wait: a point-to-point call split in two custom calls. The
// start copies the array it sends into a buffer of its own and posts the call to the
// communicator's thread, which receives into another; the wait copies the array
// received into XLA's result. XLA's buffers are never touched after the start has
// returned, so a program that stops between the two (an error) leaves nothing
// reading or writing them. A call is named by (communicator, slot, run): the slot is
// the start's, fixed when the program was traced, and its wait carries the same one;
// the run is XLA's id of the program's execution, so that two runs of one program (two
// threads) never take each other's calls.
struct Started {
  std::tuple<int64_t, int64_t, int64_t> key;  // (comm, slot, run)
  std::vector<unsigned char> send, recv;
  std::mutex mutex;
  bool done = false;
  bool posted = false;  // its messages are posted, and a poll ends it (on the thread)
  std::string error;
  std::function<void()> then;  // the wait's completion, where the wait came first

  // (on the communicator's thread, or in the start where MPI cannot take the call
  // there; the first end counts)
  void Finish(std::string e) {
    std::function<void()> next;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (done) return;
      done = true;
      error = std::move(e);
      next = std::move(then);
    }
    if (next) Complete(std::move(next));
  }
};

struct StartedCalls {
  std::mutex mutex;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::shared_ptr<Started>> calls;
};
inline StartedCalls& TheStartedCalls() {
  static StartedCalls* s = new StartedCalls();
  return *s;
}

// A new started call on (comm, slot, run).
inline std::shared_ptr<Started> NewStarted(int64_t comm, int64_t slot, int64_t run) {
  auto s = std::make_shared<Started>();
  s->key = {comm, slot, run};
  StartedCalls& t = TheStartedCalls();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.calls[s->key] = s;
  return s;
}

// A start that failed: its run stops, and no wait will take its call.
inline void ForgetStarted(const Started& s) {
  StartedCalls& t = TheStartedCalls();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.calls.find(s.key);
  if (it != t.calls.end() && it->second.get() == &s) t.calls.erase(it);
}

// A vjpmpi call of run `run` failed: the run stops, and the waits of its calls started
// so far never come. Their entries go; a call whose messages are still in flight keeps
// its buffers (its poll holds them) until MPI is done with them. (A run stopped by
// something other than a vjpmpi call, such as a host callback that raised, leaves its
// started calls here: they hold their buffers' memory, and nothing else.)
inline void ForgetRun(int64_t run) {
  if (run == 0) return;  // (eager starts: each waited for by a program of its own)
  StartedCalls& t = TheStartedCalls();
  std::lock_guard<std::mutex> lock(t.mutex);
  for (auto it = t.calls.begin(); it != t.calls.end();) {
    it = std::get<2>(it->first) == run ? t.calls.erase(it) : std::next(it);
  }
}

// How many started calls wait for their wait (for the tests).
inline int64_t StartedCount() {
  StartedCalls& t = TheStartedCalls();
  std::lock_guard<std::mutex> lock(t.mutex);
  return static_cast<int64_t>(t.calls.size());
}

inline std::shared_ptr<Started> TakeStarted(int64_t comm, int64_t slot, int64_t run) {
  StartedCalls& t = TheStartedCalls();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.calls.find({comm, slot, run});
  if (it == t.calls.end()) return nullptr;
  auto s = std::move(it->second);
  t.calls.erase(it);
  return s;
}

// Whether a started call can run on the communicator's thread while XLA's thread makes
// other MPI calls (MPI_THREAD_MULTIPLE); where not, the start makes the whole call.
inline bool ThreadMultiple() { return ThreadLevel() >= MPI_THREAD_MULTIPLE; }

}  // namespace vjpmpi
