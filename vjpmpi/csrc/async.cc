// Communicator threads, completion threads and started calls (async.h).
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <thread>
#include <unordered_map>

#include "async.h"
#include "runtime.h"

namespace vjpmpi {

// Whether the calling thread is a communicator's (for the tests: XLA's continuations
// never run there).
bool& OnCommThread() {
  thread_local bool on = false;
  return on;
}

// The communicator's thread that the calling thread is (nullptr on any other thread).
CommThread*& CurrentCommThread() {
  thread_local CommThread* current = nullptr;
  return current;
}

namespace {
// The threads that run the loops (CommThread): each runs one loop at a time, and waits
// here for another when its loop ends or went on without it. Never destroyed: a thread
// may outlive exit().
struct Servers {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<CommThread*> pending;  // loops without a thread, in the order they asked
  size_t idle = 0;                  // threads waiting here
};
Servers& TheServers() {
  static Servers* s = new Servers();
  return *s;
}

void Serve() {
  Servers& s = TheServers();
  for (;;) {
    CommThread* loop;
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      ++s.idle;
      s.ready.wait(lock, [&s] { return !s.pending.empty(); });
      --s.idle;
      loop = s.pending.front();
      s.pending.pop_front();
    }
    loop->Loop();
    OnCommThread() = false;
    CurrentCommThread() = nullptr;
  }
}

// A thread of the pool runs `loop`: an idle one, else a new one (every loop waiting has
// a thread of its own to come: a loop never waits for another one's thread).
void Assign(CommThread* loop) {
  Servers& s = TheServers();
  bool spawn;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.pending.push_back(loop);
    spawn = s.idle < s.pending.size();
  }
  if (spawn) {
    std::thread(Serve).detach();
  } else {
    s.ready.notify_one();
  }
}

// Whether `loop` still waits for a thread of the pool; it does not any more.
bool Unassign(CommThread* loop) {
  Servers& s = TheServers();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = std::find(s.pending.begin(), s.pending.end(), loop);
  if (it == s.pending.end()) return false;
  s.pending.erase(it);
  return true;
}

// Whether the calling thread handed its loop over in the job it runs (CommThread::Handoff).
bool& HandedOff() {
  thread_local bool handed = false;
  return handed;
}
}  // namespace

void CommThread::Post(std::function<void()> job) {
  bool assign = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
    assign = !has_thread_;
    has_thread_ = true;
  }
  if (assign) {
    Assign(this);
  } else {
    ready_.notify_one();
  }
}

void CommThread::Stop() {
  Post([this] { stop_ = true; });
}

CommThread::CommThread(bool communicator) : communicator_(communicator) { Assign(this); }

void CommThread::Handoff() {
  runtime.loop_handoffs.fetch_add(1, std::memory_order_relaxed);
  HandedOff() = true;
  OnCommThread() = false;
  CurrentCommThread() = nullptr;
  bool assign;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++out_;
    // (started calls to poll while the program computes: a thread now; else the next job
    // asks for one)
    assign = !jobs_.empty() || !polls_.empty();
    has_thread_ = assign;
  }
  if (assign) Assign(this);
}

bool CommThread::Reclaim() {
  bool resume = false, remove = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --out_;
    if (finished_) {
      remove = out_ == 0;
    } else if (!has_thread_) {
      has_thread_ = resume = true;
    } else {
      // A job came while this thread was away, and the thread asked for has not taken
      // the loop yet: this one takes it back (the job runs now, not once the woken
      // thread gets a core; that one finds nothing to do and waits again).
      resume = Unassign(this);
    }
  }
  if (remove) delete this;
  if (resume) runtime.loops_taken_back.fetch_add(1, std::memory_order_relaxed);
  return resume;
}

void CommThread::Loop() {
  OnCommThread() = communicator_;
  CurrentCommThread() = communicator_ ? this : nullptr;
  int misses = 0;  // polling rounds since a started call last ended
  bool parked = false;  // every poll of the last round was parked (its wait tests it)
  while (!stop_ || !polls_.empty()) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // (stopped, no job may come: a parked poll is polled until its wait has ended it)
      if (polls_.empty() || (parked && !stop_)) {
        ready_.wait(lock, [this] { return !jobs_.empty(); });
      }
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
    }
    if (job) {
      job();
      job = nullptr;  // (its captures go here, on the thread that ran it)
      if (HandedOff()) {  // (the job went on with other work after handing the loop over)
        HandedOff() = false;
        if (!Reclaim()) return;  // (another thread runs the loop now, or it has ended)
        OnCommThread() = communicator_;
        CurrentCommThread() = communicator_ ? this : nullptr;
      }
      misses = 0;
      parked = false;
      continue;
    }
    // nothing queued: MPI's progress for the started calls. The thread spins for the
    // first rounds (a message within a node completes in microseconds), then sleeps
    // between rounds, 1 us doubling up to kMaxNapUs: spinning, it took half of a core
    // that the program computes on (a halo step on the simulated network: 1.21x its
    // update's time spinning, 1.04-1.07x sleeping 0.5-2 ms, 1.14x 50 us). Where every
    // poll is parked (its wait tests it), it sleeps until a job comes instead: the naps'
    // wake-ups took a core from the ranks while the wait ran (a started 1 MiB exchange
    // over loopback TCP waited for at once: 1.04-1.06x mpi4py's Sendrecv with them).
    size_t before = polls_.size();
    bool pending = false;
    polls_.erase(std::remove_if(polls_.begin(), polls_.end(),
                                [&pending](std::function<Poll()>& poll) {
                                  Poll p = poll();
                                  pending |= p == Poll::kPending;
                                  return p == Poll::kDone;
                                }),
                 polls_.end());
    misses = polls_.size() < before ? 0 : misses + 1;
    parked = !pending && !polls_.empty();
    if ((!parked || stop_) && !polls_.empty() && misses > kSpins &&
        AwaitedStarted().load(std::memory_order_relaxed) == 0) {
      int shift = std::min(misses - kSpins, 10);
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(1 << shift, kMaxNapUs)));
    }
  }
  bool remove;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
    remove = out_ == 0;  // (else the last thread to come back deletes it)
  }
  if (remove) delete this;
}


// One thread per communicator (by vjpmpi's number): programs that run at once on two
// Python threads, each on its own communicator, do not queue behind each other, as
// they would not without this thread. Never destroyed: a thread may outlive exit().
struct CommThreads {
  std::mutex mutex;
  std::unordered_map<int64_t, CommThread*> threads;
};
CommThreads& TheCommThreads() {
  static CommThreads* t = new CommThreads();
  return *t;
}

void PostOn(int64_t comm, std::function<void()> job) {
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

namespace {
// Call sites' records under "auto" (SiteRecord), by (communicator, site); a freed
// communicator's go (a job still running keeps its own). Never destroyed, as the threads.
struct SiteRecords {
  std::mutex mutex;
  // (communicator, site, place among the site's calls in a run)
  std::map<std::tuple<int64_t, int64_t, int>, std::shared_ptr<SiteRecord>> live;
  // each communicator's last run, and how many calls of each site it made
  std::unordered_map<int64_t, std::pair<int64_t, std::unordered_map<int64_t, int>>> runs;
};
SiteRecords& TheSiteRecords() {
  static SiteRecords* r = new SiteRecords();
  return *r;
}
int64_t Ns(const timespec& t) { return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec; }
}  // namespace

std::shared_ptr<SiteRecord> SiteRecordOf(int64_t comm, int64_t site, int64_t run) {
  SiteRecords& r = TheSiteRecords();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& [last, made] = r.runs[comm];
  if (last != run) {
    last = run;
    made.clear();
  }
  int& n = made[site];
  const int place = std::min(n, kSitePlaces - 1);
  if (n < kSitePlaces) ++n;
  auto& record = r.live[{comm, site, place}];
  if (!record) record = std::make_shared<SiteRecord>();
  return record;
}

ThreadCpu::ThreadCpu() {
  timespec t;
  if (pthread_getcpuclockid(pthread_self(), &clock_) == 0 && clock_gettime(clock_, &t) == 0) {
    start_ = Ns(t);
  }
}

void ThreadCpu::Restart() {
  timespec t;
  start_ = start_ >= 0 && clock_gettime(clock_, &t) == 0 ? Ns(t) : -1;
  process_ = clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t) == 0 ? Ns(t) : -1;
  self_ = clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) == 0 ? Ns(t) : -1;
}

int64_t ThreadCpu::ProcessSince() const {
  timespec p;
  if (process_ < 0 || clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &p) != 0) return -1;
  return Ns(p) - process_;
}

int64_t ThreadCpu::Beside() const {
  const int64_t xla = pthread_equal(owner_, pthread_self()) ? 0 : Since();
  if (xla < 0 || process_ < 0 || self_ < 0) return -1;
  timespec p, t;
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &p) != 0 ||
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) != 0) {
    return -1;
  }
  return std::max(xla, (Ns(p) - process_) - (Ns(t) - self_));
}

int64_t ThreadCpu::Since() const {
  timespec t;
  if (start_ < 0 || clock_gettime(clock_, &t) != 0) return -1;  // (the thread has ended)
  return std::max<int64_t>(Ns(t) - start_, 0);
}

// The communicator was freed: its thread ends (after a job it may still run).
void StopCommThread(int64_t comm) {
  {
    SiteRecords& r = TheSiteRecords();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.live.lower_bound({comm, INT64_MIN, 0});
    while (it != r.live.end() && std::get<0>(it->first) == comm) it = r.live.erase(it);
    r.runs.erase(comm);
  }
  CommThreads& all = TheCommThreads();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto it = all.threads.find(comm);
  if (it == all.threads.end()) return;
  it->second->Stop();
  all.threads.erase(it);
}

// Threads that complete the futures of started calls' waits (an asynchronous call's
// job completes its own, after CommThread::Handoff). Completing a future runs XLA's
// continuation on the completing thread: the program's next steps, computation
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
void Complete(std::function<void()> job) {
  static Completers* c = new Completers();
  c->Run(std::move(job));
}

// The smallest call, in bytes (its larger side, in or out), whose MPI call runs on the
// communicator's thread; -1: none; kAsyncAuto: kAutoAsyncBytes on a communicator whose
// processes are on more than one node, none on one within a node. Set from Python
// (VJPMPI_ASYNC_BYTES at import, vjpmpi.async_threshold), read by each call when it runs.
std::atomic<int64_t> async_bytes{kAsyncAuto};

// The thread support MPI provides (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
int ThreadLevel() {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided;
}

void Started::Finish(std::string e) {
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

namespace {
struct BufferPool {
  std::mutex mutex;
  std::vector<std::vector<unsigned char>> kept;
  size_t bytes = 0;
};
BufferPool& ThePool() {
  static BufferPool* p = new BufferPool();
  return *p;
}
constexpr size_t kPoolBuffers = 8, kPoolBytes = size_t{1} << 30;
}  // namespace

std::vector<unsigned char> TakeBuffer(size_t bytes, bool zero) {
  std::vector<unsigned char> out;
  {
    BufferPool& p = ThePool();
    std::lock_guard<std::mutex> lock(p.mutex);
    size_t best = p.kept.size();  // (the smallest that holds `bytes`)
    for (size_t i = 0; i < p.kept.size(); ++i) {
      const size_t c = p.kept[i].capacity();
      if (c >= bytes && (best == p.kept.size() || c < p.kept[best].capacity())) best = i;
    }
    if (best < p.kept.size()) {
      out = std::move(p.kept[best]);
      p.kept.erase(p.kept.begin() + static_cast<std::ptrdiff_t>(best));
      p.bytes -= out.capacity();
    }
  }
  if (out.capacity() < bytes) out.reserve(bytes);  // (none holds it: a new one)
  const size_t kept = std::min(out.size(), bytes);
  out.resize(bytes);  // (zeroes what grows past its last size)
  if (zero && kept > 0) std::memset(out.data(), 0, kept);
  return out;
}

void GiveBuffer(std::vector<unsigned char>&& buffer) {
  if (buffer.capacity() == 0 || buffer.capacity() > kPoolBytes) return;
  BufferPool& p = ThePool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.kept.push_back(std::move(buffer));
  p.bytes += p.kept.back().capacity();
  while (p.kept.size() > kPoolBuffers || p.bytes > kPoolBytes) {  // (the oldest go)
    p.bytes -= p.kept.front().capacity();
    p.kept.erase(p.kept.begin());
  }
}

struct StartedCalls {
  std::mutex mutex;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::shared_ptr<Started>> calls;
};
StartedCalls& TheStartedCalls() {
  static StartedCalls* s = new StartedCalls();
  return *s;
}

// A new started call on (comm, slot, run).
std::shared_ptr<Started> NewStarted(int64_t comm, int64_t slot, int64_t run) {
  auto s = std::make_shared<Started>();
  s->key = {comm, slot, run};
  StartedCalls& t = TheStartedCalls();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.calls[s->key] = s;
  return s;
}

// A start that failed: its run stops, and no wait will take its call.
void ForgetStarted(const Started& s) {
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
//
// A direct call (XLA's buffers) is settled first: XLA frees the run's buffers once the
// failure has returned, and MPI must be done with them by then. Its messages are tested
// here until they are done (the ranks' other started calls of the run were posted too, in
// the same order, so they pair); where they are not within kSettleSeconds, the job ends
// rather than let MPI write into freed memory.
std::atomic<int>& AwaitedStarted() {
  static std::atomic<int> n{0};
  return n;
}

void ForgetRun(int64_t run) {
  if (run == 0) return;  // (eager starts: each waited for by a program of its own)
  std::vector<std::shared_ptr<Started>> direct;
  {
    StartedCalls& t = TheStartedCalls();
    std::lock_guard<std::mutex> lock(t.mutex);
    for (auto it = t.calls.begin(); it != t.calls.end();) {
      if (std::get<2>(it->first) != run) {
        ++it;
        continue;
      }
      if (it->second->direct) direct.push_back(it->second);
      it = t.calls.erase(it);
    }
  }
  constexpr double kSettleSeconds = 30;
  for (const auto& s : direct) {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration<double>(kSettleSeconds);
    for (;;) {
      bool end = false, posted = false;
      {
        std::lock_guard<std::mutex> lock(s->test_mutex);
        posted = static_cast<bool>(s->test);
        end = s->settled || (posted && s->test());
      }
      if (!end && !posted) {  // (not posted: ended already, or its post still to come)
        std::lock_guard<std::mutex> lock(s->mutex);
        end = s->done;
      }
      if (end) break;
      if (std::chrono::steady_clock::now() > until) {
        AbortWith("vjpmpi.start: a started call's messages were still in flight " +
                      std::to_string(static_cast<int>(kSettleSeconds)) +
                      " s after a later vjpmpi call of the same program failed",
                  " (MPI would write into the program's buffers after XLA frees them)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

// How many started calls wait for their wait (for the tests).
int64_t StartedCount() {
  StartedCalls& t = TheStartedCalls();
  std::lock_guard<std::mutex> lock(t.mutex);
  return static_cast<int64_t>(t.calls.size());
}

std::shared_ptr<Started> TakeStarted(int64_t comm, int64_t slot, int64_t run) {
  StartedCalls& t = TheStartedCalls();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.calls.find({comm, slot, run});
  if (it == t.calls.end()) return nullptr;
  auto s = std::move(it->second);
  t.calls.erase(it);
  return s;
}

// Whether a started call can run on the communicator's thread while XLA's thread makes

}  // namespace vjpmpi
