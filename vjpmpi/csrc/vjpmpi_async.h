// Asynchronous collectives on the host: a thread per communicator runs the MPI calls of
// the handlers that move at least AsyncBytes() (VJPMPI_ASYNC_BYTES), in the order the
// handlers post them, while XLA's executor runs whatever in the program does not wait
// for the message; the handler returns a future that the job completes.
//
// The ordering chain makes each vjpmpi call of a program wait for the previous one to
// complete, so a program has at most one job queued or running: the thread adds no
// reordering, and MPI sees the program's calls one at a time. The job completes the
// handler's future itself, which runs XLA's continuation (the program's next steps) on
// this thread; the program's next vjpmpi call cannot have been posted before, so
// nothing waits behind it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "vjpmpi_mpi.h"

namespace vjpmpi {

// One thread running posted jobs in order.
class CommThread {
 public:
  void Post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
  }

  // The thread ends after the jobs posted so far, and deletes this object.
  void Stop() {
    Post([this] { stop_ = true; });
  }

  CommThread() {
    std::thread([this] { Loop(); }).detach();
  }

 private:
  void Loop() {
    while (!stop_) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
    delete this;
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
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

// The smallest call, in bytes (its larger side, in or out), whose MPI call runs on the
// communicator's thread; -1: none. Set from Python (VJPMPI_ASYNC_BYTES at import,
// vjpmpi.async_threshold), read by each call when it runs.
inline std::atomic<int64_t>& AsyncBytes() {
  static std::atomic<int64_t> bytes{-1};
  return bytes;
}

// Whether a call moving `moved` bytes runs on the communicator's thread: it moves data,
// at least AsyncBytes(), and MPI lets another thread make the calls
// (MPI_THREAD_SERIALIZED or more; where it does not, every call runs on XLA's thread).
// The MPI call is the same blocking call wherever it runs: which thread runs a call
// that stays on XLA's side depends on timing (the thread that completes its last input
// runs it), and MPI never matches a blocking collective with a nonblocking one (an
// earlier version used nonblocking calls on this thread only, and a 4-rank FFT hung
// with one rank in MPI_Allreduce and another in MPI_Iallreduce); their algorithms
// differ too (MPICH's MPI_Ireduce_scatter_block sums in another order at 4 ranks).
inline bool GoesAsync(size_t moved) {
  int64_t limit = AsyncBytes().load(std::memory_order_relaxed);
  if (limit < 0 || moved == 0 || moved < static_cast<size_t>(limit)) return false;
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided >= MPI_THREAD_SERIALIZED;
}

}  // namespace vjpmpi
