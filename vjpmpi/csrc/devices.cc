// Many devices per process (devices.h): the devices' duplicates of a communicator, the
// groups' meetings, the letters between devices of this process, and each collective's
// process part over a group of P x D ranks (rank p * D + a: process p, place a).
#include "devices.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "runtime.h"

namespace vjpmpi {

std::string MakePlace(int64_t base, int64_t pid, const int64_t* dev, size_t n, Place* out) {
  if (n < 4 || dev[0] < 1 || dev[1] < 1 || dev[0] % dev[1] != 0 || dev[2] < 1 ||
      pid < 0 || pid >= dev[0]) {
    return "vjpmpi: this program's device attributes are not the ones these kernels take "
           "(a program lowered by another vjpmpi release, or a vjpmpi bug); trace it again";
  }
  Place& p = *out;
  p.base = base;
  p.parts = static_cast<int>(dev[0]);
  p.local = static_cast<int>(dev[1]);
  p.stride = dev[2];
  p.layout = dev[3];
  p.group = n > 5 && dev[5] != 0;
  p.devices = n > 6 ? static_cast<int>(dev[6]) : p.parts;
  if (p.devices < p.parts) {
    return "vjpmpi: this program's device attributes are not the ones these kernels take "
           "(more partitions than devices: a vjpmpi bug)";
  }
  p.pid = static_cast<int>(pid);
  p.a = static_cast<int>((pid / p.stride) % p.local);
  p.g = static_cast<int>((pid / (p.stride * p.local)) * p.stride + pid % p.stride);
  return {};
}

DeviceSet& Devices(Runtime& rt, int64_t base, int parts) {
  std::lock_guard<std::mutex> lock(rt.devices_mutex);
  auto& slot = rt.devices[{base, parts}];
  if (!slot) {
    slot = std::make_unique<DeviceSet>();
    slot->base = base;
    slot->parts = parts;
    for (int i = 0; i < parts; ++i) slot->boxes.push_back(std::make_unique<Mailbox>());
  }
  return *slot;
}

std::string Ensure(DeviceSet& set, int level, const std::function<std::string(int)>& make,
                   int64_t run) {
  if (set.level.load(std::memory_order_acquire) >= level) return {};
  std::lock_guard<std::mutex> lock(set.setup);
  // (the run's other devices do not try again: the processes would count one more
  // collective there than the others)
  if (set.setup_run == run && !set.setup_error.empty()) return set.setup_error;
  for (int l = set.level.load() + 1; l <= level; ++l) {
    std::string e = make(l);
    if (!e.empty()) {
      set.setup_run = run;
      set.setup_error = e;
      return e;
    }
    set.level.store(l, std::memory_order_release);
  }
  return {};
}

std::string DuplicateComms(Runtime& rt, MPI_Comm comm, int count, const char* name,
                           std::vector<int64_t>* ids) {
  ids->clear();
  for (int i = 0; i < count; ++i) {
    MPI_Comm dup = MPI_COMM_NULL;
    std::string e = Check(MPI_Comm_dup(comm, &dup), "device_comm", "MPI_Comm_dup");
    if (!e.empty()) return e;
    MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    std::string label = std::string(name) + "#" + std::to_string(i);
    MPI_Comm_set_name(dup, label.c_str());
    int64_t id = 0;
    e = CommNumber(rt, dup, &id);
    if (!e.empty()) return e;
    ids->push_back(id);
  }
  return {};
}

namespace {

// Wait on `cv` (holding `lk`) until `done()`; past VJPMPI_WARN_AFTER warn once with
// `what(waited)`, past the time limit end the job with it. `counting()`: whether the
// wait counts now (not while the group's first device runs the collective: the
// watchdog watches that call).
template <typename Done, typename Counting, typename What>
void WaitWatched(Runtime& rt, std::unique_lock<std::mutex>& lk, std::condition_variable& cv,
                 Done done, Counting counting, What what) {
  int64_t since = NowNs();
  bool warned = false;
  while (!done()) {
    cv.wait_for(lk, std::chrono::milliseconds(250));
    if (done()) return;
    if (!counting()) {
      since = NowNs();
      continue;
    }
    const double waited = static_cast<double>(NowNs() - since) * 1e-9;
    const double warn = rt.warn_seconds.load(std::memory_order_relaxed);
    const double limit = TimeLimit(rt);
    if (!warned && warn > 0 && waited >= warn) {
      warned = true;
      std::string text = what(waited) + StillWaiting(rt);
      lk.unlock();
      Warn(rt, text);
      lk.lock();
    }
    if (limit > 0 && waited >= limit) {
      std::string text = what(waited);
      lk.unlock();
      AbortWith(text, " (VJPMPI_TIMEOUT: the devices that wait cannot be told)");
    }
  }
}

std::string DeviceText(const DeviceCall& d) {
  std::string s = std::string(d.c.op);
  if (d.c.uses & kUsesRed) s += "(" + ReductionNames()[static_cast<int>(d.c.red)] + ")";
  if (d.c.uses & kUsesRoot) s += "(root=" + std::to_string(d.c.root) + ")";
  s += std::string(" ") + KindName(d.c.kind) + "[";
  for (int i = 0; i < d.c.ndim; ++i) s += (i ? ", " : "") + std::to_string(d.c.dims[i]);
  s += "]";
  std::string site = d.site ? SiteText(runtime, d.site) : std::string();
  if (!site.empty()) s += " (" + site + ")";
  return s;
}

bool SameCall(const DeviceCall& x, const DeviceCall& y) {
  if (std::strcmp(x.c.op, y.c.op) != 0 || x.c.kind != y.c.kind || x.c.count != y.c.count ||
      x.c.ndim != y.c.ndim || x.in_bytes != y.in_bytes || x.out_bytes != y.out_bytes ||
      x.site != y.site || x.sig != y.sig) {
    return false;
  }
  if ((x.c.uses & kUsesRed) && x.c.red != y.c.red) return false;
  if ((x.c.uses & kUsesRoot) && x.c.root != y.c.root) return false;
  for (int i = 0; i < x.c.ndim; ++i) {
    if (x.c.dims[i] != y.c.dims[i]) return false;
  }
  return true;
}

// What the group's first device finds wrong with the calls it met (or "").
std::string Disagreement(const Place& pl, const std::vector<DeviceCall*>& calls) {
  for (DeviceCall* d : calls) {
    if (!d->invalid.empty()) return d->invalid;
  }
  bool same = true;
  for (size_t a = 1; a < calls.size(); ++a) same = same && SameCall(*calls[0], *calls[a]);
  if (same) return {};
  std::string s = std::string("vjpmpi.") + calls[0]->c.op + ": the devices of one group of "
                  "this process called different collectives (a shard_map body whose devices "
                  "take different branches or trip counts around a collective):";
  for (size_t a = 0; a < calls.size(); ++a) {
    s += "\n  device " + std::to_string(a) + " of the group (partition " +
         std::to_string(pl.Partition(static_cast<int>(a))) + "): " + DeviceText(*calls[a]);
  }
  return s;
}

}  // namespace

std::string Meet(Runtime& rt, DeviceSet& set, const Place& pl, DeviceCall* mine,
                 const GroupWork& work) {
  Meeting* mt = nullptr;
  {
    std::lock_guard<std::mutex> lock(set.meetings_mutex);
    auto& slot = set.meetings[{pl.layout, pl.g}];
    if (!slot) {
      slot = std::make_unique<Meeting>();
      slot->calls.assign(static_cast<size_t>(pl.local), nullptr);
    }
    mt = slot.get();
  }
  std::unique_lock<std::mutex> lk(mt->m);
  if (mt->calls[static_cast<size_t>(pl.a)] != nullptr) {
    return std::string("vjpmpi.") + mine->c.op + ": two calls of device " +
           std::to_string(pl.a) + " of one group meet at once (a vjpmpi bug)";
  }
  const uint64_t gen = mt->generation;
  mt->calls[static_cast<size_t>(pl.a)] = mine;
  ++mt->arrived;
  auto missing = [&](double waited) {
    std::string who;
    for (size_t b = 0; b < mt->calls.size(); ++b) {
      if (mt->calls[b] == nullptr) {
        who += (who.empty() ? "" : ", ") + std::to_string(b) + " (partition " +
               std::to_string(pl.Partition(static_cast<int>(b))) + ")";
      }
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f", waited);
    return std::string("vjpmpi.") + mine->c.op + ": device(s) " + who + " of a group of " +
           std::to_string(pl.local) + " devices of this process have not come to the "
           "collective the others have waited in for " + buf + " s (a shard_map body that "
           "makes it on some devices only?): " + DeviceText(*mine);
  };
  // (a device of this program that failed elsewhere: the others stop waiting for it)
  std::string failed;
  auto stopped = [&] {
    failed = Failure(set, mine->run);
    return !failed.empty();
  };
  if (pl.a != 0) {
    mt->cv.notify_all();
    WaitWatched(rt, lk, mt->cv, [&] { return mt->generation != gen || stopped(); },
                [&] { return mt->arrived < pl.local; }, missing);
    if (mt->generation != gen) return mt->result;
    mt->calls[static_cast<size_t>(pl.a)] = nullptr;  // (it leaves the meeting)
    --mt->arrived;
    return failed;
  }
  WaitWatched(rt, lk, mt->cv, [&] { return mt->arrived == pl.local || stopped(); },
              [] { return true; }, missing);
  std::vector<DeviceCall*> calls = mt->calls;
  const bool complete = mt->arrived == pl.local;
  lk.unlock();
  // (a device that failed: the other processes' calls fail with its error in the ranks'
  // agreement, the process call itself does not run)
  std::string invalid = complete ? Disagreement(pl, calls) : failed;
  std::string e = work(calls, invalid);
  if (!complete && e.empty()) e = failed;
  lk.lock();
  mt->result = e;
  if (complete) {
    mt->arrived = 0;
    std::fill(mt->calls.begin(), mt->calls.end(), nullptr);
    ++mt->generation;
  } else {
    mt->calls[0] = nullptr;  // (the others that came leave on their own)
    --mt->arrived;
  }
  mt->cv.notify_all();
  return e;
}

void NoteRunFailure(Runtime& rt, int64_t run, const std::string& error) {
  if (error.empty() || run == 0) return;
  std::lock_guard<std::mutex> lock(rt.failed_mutex);
  if (rt.failed_runs.size() > 64) rt.failed_runs.clear();  // (runs long over)
  rt.failed_runs.emplace(run, error);
}

std::string RunFailure(Runtime& rt, int64_t run) {
  if (run == 0) return {};
  std::lock_guard<std::mutex> lock(rt.failed_mutex);
  auto it = rt.failed_runs.find(run);
  if (it == rt.failed_runs.end()) return {};
  return "another device of this process failed in this run of the program: " + it->second;
}

void Fail(DeviceSet& set, int64_t run, const std::string& error) {
  if (error.empty()) return;
  NoteRunFailure(runtime, run, error);
  for (auto& box : set.boxes) {  // (wake the devices that wait for a letter)
    std::lock_guard<std::mutex> b(box->m);
    box->cv.notify_all();
  }
  std::lock_guard<std::mutex> m(set.meetings_mutex);
  for (auto& kv : set.meetings) {
    std::lock_guard<std::mutex> g(kv.second->m);
    kv.second->cv.notify_all();
  }
}

std::string Failure(DeviceSet&, int64_t run) { return RunFailure(runtime, run); }

// ------------------------------------------------------------- letters --
void PostLetter(DeviceSet& set, int to, int from, int tag, Kind kind, size_t count,
                const void* data, size_t bytes, int64_t site) {
  auto letter = std::make_unique<Letter>();
  letter->from = from;
  letter->tag = tag;
  letter->kind = kind;
  letter->count = count;
  letter->site = site;
  const unsigned char* p = static_cast<const unsigned char*>(data);
  if (bytes) letter->data.assign(p, p + bytes);
  Mailbox& box = *set.boxes[static_cast<size_t>(to)];
  std::lock_guard<std::mutex> lock(box.m);
  box.letters.push_back(std::move(letter));
  box.cv.notify_all();
}

std::string TakeLetter(Runtime& rt, DeviceSet& set, int me, int from, int tag, Kind kind,
                       size_t count, void* out, const char* op, int64_t run) {
  Mailbox& box = *set.boxes[static_cast<size_t>(me)];
  std::unique_lock<std::mutex> lk(box.m);
  std::unique_ptr<Letter> got;
  auto find = [&] {
    for (auto it = box.letters.begin(); it != box.letters.end(); ++it) {
      if ((*it)->from == from && (tag == MPI_ANY_TAG || (*it)->tag == tag)) {
        got = std::move(*it);
        box.letters.erase(it);
        return true;
      }
    }
    return false;
  };
  std::string failed;
  auto stopped = [&] {
    if (find()) return true;
    lk.unlock();  // (Failure locks the set)
    failed = Failure(set, run);
    lk.lock();
    return !failed.empty() || find();
  };
  WaitWatched(rt, lk, box.cv, stopped, [] { return true; }, [&](double waited) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f", waited);
    return std::string("vjpmpi.") + op + ": partition " + std::to_string(me) +
           " has waited " + buf + " s for a message from partition " + std::to_string(from) +
           " of this process";
  });
  lk.unlock();
  if (got == nullptr) return std::string("vjpmpi.") + op + ": " + failed;
  if (got->kind != kind || got->count != count) {
    return std::string("vjpmpi.") + op + ": partition " + std::to_string(me) + " receives " +
           std::to_string(count) + " " + KindName(kind) + " elements from partition " +
           std::to_string(from) + " of this process, which sends " + std::to_string(got->count) +
           " " + KindName(got->kind) + " elements";
  }
  if (!got->data.empty()) std::memcpy(out, got->data.data(), got->data.size());
  return {};
}

// ------------------------------------------------- a group's collectives --
std::string ReduceLocal(const void* in, void* inout, size_t n, Kind k, Red r, const char* op) {
  MPI_Datatype t = Datatype(k);
  MPI_Op o = Operation(r, k);
  if (o == MPI_OP_NULL) return std::string("vjpmpi.") + op + ": unsupported reduction";
  const size_t w = ByteSize(k), step = static_cast<size_t>(INT_MAX / 2);
  const unsigned char* src = static_cast<const unsigned char*>(in);
  unsigned char* dst = static_cast<unsigned char*>(inout);
  for (size_t at = 0; at < n; at += step) {
    int m = static_cast<int>(std::min(step, n - at));
    std::string e = Check(MPI_Reduce_local(src + at * w, dst + at * w, m, t, o), op,
                          "MPI_Reduce_local");
    if (!e.empty()) return e;
  }
  return {};
}

namespace {

using Bytes = std::vector<unsigned char>;

Bytes& Scratch(int k) {  // (each worker thread's, reused)
  static thread_local Bytes s[3];
  return s[k];
}

void Copy(void* dst, const void* src, size_t n) {
  if (n && dst != src) std::memcpy(dst, src, n);
}

size_t Block(const Call& pc) { return pc.count * ByteSize(pc.kind); }

// The group's sum (`pc.red`) of every device's `in` into `acc` (count elements).
std::string LocalTotal(const Call& pc, std::vector<DeviceCall*>& calls, void* acc, size_t count) {
  Copy(acc, calls[0]->in, count * ByteSize(pc.kind));
  for (size_t a = 1; a < calls.size(); ++a) {
    std::string e = ReduceLocal(calls[a]->in, acc, count, pc.kind, pc.red, pc.op);
    if (!e.empty()) return e;
  }
  return {};
}

// MPI's collective calls with a block of `count` elements (large counts: MPI-4's).
std::string AllgatherInPlace(const Call& pc, void* buf, size_t count) {
  MPI_Datatype t = Datatype(pc.kind);
  return Check(VJPMPI_BY_COUNT(count, MPI_Allgather, MPI_IN_PLACE, n, t, buf, n, t, pc.comm),
               pc.op, "MPI_Allgather");
}

}  // namespace

std::string DevAllreduce(const Call& pc, std::vector<DeviceCall*>& calls) {
  void* acc = calls[0]->out;
  std::string e = LocalTotal(pc, calls, acc, pc.count);
  if (e.empty()) e = Allreduce(pc, acc, acc);
  if (!e.empty()) return e;
  for (size_t a = 1; a < calls.size(); ++a) Copy(calls[a]->out, acc, Block(pc));
  return {};
}

std::string DevReduce(const Call& pc, std::vector<DeviceCall*>& calls) {
  const int D = static_cast<int>(calls.size());
  const int proc = pc.root / D, place = pc.root % D;
  Bytes& acc = Scratch(0);
  acc.resize(Block(pc));
  std::string e = LocalTotal(pc, calls, acc.data(), pc.count);
  Call c = pc;
  c.root = proc;
  if (e.empty()) e = Reduce(c, acc.data(), acc.data());
  if (!e.empty()) return e;
  const bool here = Rank(pc.comm) == proc;
  for (int a = 0; a < D; ++a) {  // (the others keep their x: reduce's result off the root)
    Copy(calls[a]->out, here && a == place ? acc.data() : calls[a]->in, Block(pc));
  }
  return {};
}

std::string DevBcast(const Call& pc, std::vector<DeviceCall*>& calls) {
  const int D = static_cast<int>(calls.size());
  const int proc = pc.root / D, place = pc.root % D;
  const bool here = Rank(pc.comm) == proc;
  void* buf = calls[0]->out;
  if (here) Copy(buf, calls[place]->in, Block(pc));
  Call c = pc;
  c.root = proc;
  std::string e = Bcast(c, buf, buf);
  if (!e.empty()) return e;
  for (int a = 1; a < D; ++a) Copy(calls[a]->out, buf, Block(pc));
  return {};
}

std::string DevAllgather(const Call& pc, std::vector<DeviceCall*>& calls) {
  const size_t D = calls.size(), blk = Block(pc);
  const int p = Rank(pc.comm);
  unsigned char* all = static_cast<unsigned char*>(calls[0]->out);
  // (into place p * D + a of the leader's result: its own input may alias none of it)
  for (size_t a = D; a-- > 0;) Copy(all + (p * D + a) * blk, calls[a]->in, blk);
  std::string e = AllgatherInPlace(pc, all, pc.count * D);
  if (!e.empty()) return e;
  int P = 1;
  MPI_Comm_size(pc.comm, &P);
  for (size_t a = 1; a < D; ++a) Copy(calls[a]->out, all, blk * D * P);
  return {};
}

// gather on a device communicator: every device's result has the stacked shape; the
// root's holds every rank's block, the others' zeros.
std::string DevGather(const Call& pc, std::vector<DeviceCall*>& calls) {
  const int D = static_cast<int>(calls.size());
  const int proc = pc.root / D, place = pc.root % D;
  const size_t blk = Block(pc);
  int P = 1;
  MPI_Comm_size(pc.comm, &P);
  const int p = Rank(pc.comm);
  MPI_Datatype t = Datatype(pc.kind);
  std::string e;
  if (p == proc) {
    unsigned char* all = static_cast<unsigned char*>(calls[place]->out);
    for (int a = 0; a < D; ++a) Copy(all + (p * D + a) * blk, calls[a]->in, blk);
    e = Check(VJPMPI_BY_COUNT(pc.count * D, MPI_Gather, MPI_IN_PLACE, n, t, all, n, t, proc,
                              pc.comm),
              pc.op, "MPI_Gather");
  } else {
    Bytes& mine = Scratch(0);
    mine.resize(blk * D);
    for (int a = 0; a < D; ++a) Copy(mine.data() + a * blk, calls[a]->in, blk);
    e = Check(VJPMPI_BY_COUNT(pc.count * D, MPI_Gather, mine.data(), n, t, nullptr, n, t, proc,
                              pc.comm),
              pc.op, "MPI_Gather");
  }
  if (!e.empty()) return e;
  for (int a = 0; a < D; ++a) {
    if (!(p == proc && a == place)) std::memset(calls[a]->out, 0, blk * D * P);
  }
  return {};
}

// scatter on a device communicator: every device passes the stacked shape (the root's
// values are sent, the others' are not used).
std::string DevScatter(const Call& pc, std::vector<DeviceCall*>& calls) {
  const int D = static_cast<int>(calls.size());
  const int proc = pc.root / D, place = pc.root % D;
  const size_t blk = Block(pc);
  const bool here = Rank(pc.comm) == proc;
  Bytes& mine = Scratch(0);
  mine.resize(blk * D);
  MPI_Datatype t = Datatype(pc.kind);
  std::string e = Check(VJPMPI_BY_COUNT(pc.count * D, MPI_Scatter,
                                        here ? calls[place]->in : nullptr, n, t, mine.data(), n,
                                        t, proc, pc.comm),
                        pc.op, "MPI_Scatter");
  if (!e.empty()) return e;
  for (int a = 0; a < D; ++a) Copy(calls[a]->out, mine.data() + a * blk, blk);
  return {};
}

std::string DevAlltoall(const Call& pc, std::vector<DeviceCall*>& calls) {
  const size_t D = calls.size(), blk = Block(pc);
  int P = 1;
  MPI_Comm_size(pc.comm, &P);
  Bytes& out = Scratch(0);
  Bytes& in = Scratch(1);
  out.resize(blk * D * D * P);
  in.resize(out.size());
  // to process q: [a][b] = device a's block for rank q * D + b
  for (int q = 0; q < P; ++q) {
    for (size_t a = 0; a < D; ++a) {
      for (size_t b = 0; b < D; ++b) {
        Copy(out.data() + ((q * D + a) * D + b) * blk,
             static_cast<const unsigned char*>(calls[a]->in) + (q * D + b) * blk, blk);
      }
    }
  }
  MPI_Datatype t = Datatype(pc.kind);
  std::string e = Check(VJPMPI_BY_COUNT(pc.count * D * D, MPI_Alltoall, out.data(), n, t,
                                        in.data(), n, t, pc.comm),
                        pc.op, "MPI_Alltoall");
  if (!e.empty()) return e;
  // from process q: [a][b] = its device a's block for this process's device b
  for (int q = 0; q < P; ++q) {
    for (size_t a = 0; a < D; ++a) {
      for (size_t b = 0; b < D; ++b) {
        Copy(static_cast<unsigned char*>(calls[b]->out) + (q * D + a) * blk,
             in.data() + ((q * D + a) * D + b) * blk, blk);
      }
    }
  }
  return {};
}

std::string DevReduceScatter(const Call& pc, std::vector<DeviceCall*>& calls) {
  const size_t D = calls.size(), blk = Block(pc);
  int P = 1;
  MPI_Comm_size(pc.comm, &P);
  Bytes& acc = Scratch(0);
  acc.resize(blk * D * P);
  std::string e = LocalTotal(pc, calls, acc.data(), pc.count * D * P);
  Bytes& mine = Scratch(1);
  mine.resize(blk * D);
  Call c = pc;
  c.count = pc.count * D;
  if (e.empty()) e = ReduceScatter(c, acc.data(), mine.data());
  if (!e.empty()) return e;
  for (size_t a = 0; a < D; ++a) Copy(calls[a]->out, mine.data() + a * blk, blk);
  return {};
}

namespace {

// The scans' process part. Places in the scan's order (c.reverse: from the last down);
// `outs[i]` the i-th device's result in that order. Each gets the inclusive local prefix
// (its own `in` combined with those before it), then `before` (what the processes before
// this one give, the identity on the first) combined in front; `exclusive`: the prefix
// of the devices before it instead (the identity for the first of the first process).
std::string ScanParts(const Call& pc, std::vector<DeviceCall*>& calls, bool exclusive) {
  const size_t D = calls.size(), blk = Block(pc);
  std::vector<DeviceCall*> order = calls;
  if (pc.reverse) std::reverse(order.begin(), order.end());
  // inclusive prefixes in the results
  Copy(order[0]->out, order[0]->in, blk);
  for (size_t i = 1; i < D; ++i) {
    Copy(order[i]->out, order[i]->in, blk);
    std::string e = ReduceLocal(order[i - 1]->out, order[i]->out, pc.count, pc.kind, pc.red, pc.op);
    if (!e.empty()) return e;
  }
  Bytes& before = Scratch(0);
  before.resize(blk);
  std::string e = Exscan(pc, order[D - 1]->out, before.data());  // (the identity on the first)
  if (!e.empty()) return e;
  if (exclusive) {
    for (size_t i = D; i-- > 1;) Copy(order[i]->out, order[i - 1]->out, blk);
    Copy(order[0]->out, before.data(), blk);
  }
  for (size_t i = exclusive ? 1 : 0; i < D; ++i) {
    e = ReduceLocal(before.data(), order[i]->out, pc.count, pc.kind, pc.red, pc.op);
    if (!e.empty()) return e;
  }
  return {};
}

}  // namespace

std::string DevScan(const Call& pc, std::vector<DeviceCall*>& calls) {
  return ScanParts(pc, calls, false);
}

std::string DevExscan(const Call& pc, std::vector<DeviceCall*>& calls) {
  return ScanParts(pc, calls, true);
}

// prod over the other ranks: the exclusive product in rank order times the one from the
// last rank down (two exclusive scans; no division, exact with zeros).
std::string DevOthersProduct(const Call& pc, std::vector<DeviceCall*>& calls) {
  const size_t D = calls.size(), blk = Block(pc);
  Call c = pc;
  c.red = Red::kProd;
  // (the results are the forward scan's; the reverse one goes to scratch of its own)
  std::vector<Bytes> after(D);
  std::vector<DeviceCall> shadow(D);
  std::vector<DeviceCall*> back(D);
  for (size_t a = 0; a < D; ++a) {
    after[a].resize(blk);
    shadow[a] = *calls[a];
    shadow[a].out = after[a].data();
    back[a] = &shadow[a];
  }
  std::string e = ScanParts(c, calls, true);
  c.reverse = true;
  if (e.empty()) e = ScanParts(c, back, true);
  for (size_t a = 0; a < D && e.empty(); ++a) {
    e = ReduceLocal(after[a].data(), calls[a]->out, pc.count, pc.kind, Red::kProd, pc.op);
  }
  return e;
}

// The linear recurrence e_s = sum_{q before s} b_q prod_{q < r < s} a_r over the group's
// ranks: pairs (a, b) composed in rank order (AffinePair), the exclusive composition of
// the devices before each in this process, and of the processes before (MPI_Exscan).
std::string DevRecurrence(const Call& pc, std::vector<DeviceCall*>& calls) {
  PairOp pair = AffinePair(pc.kind);
  if (pair.op == MPI_OP_NULL) return std::string("vjpmpi.") + pc.op + ": unsupported dtype";
  const size_t D = calls.size(), n = pc.count, w = ByteSize(pc.kind);
  std::vector<DeviceCall*> order = calls;
  if (pc.reverse) std::reverse(order.begin(), order.end());
  // pre[i]: the composition of the devices before order[i] (the identity (1, 0) first)
  Bytes& pre = Scratch(0);
  pre.resize((D + 1) * 2 * n * w);
  auto at = [&](size_t i) { return pre.data() + i * 2 * n * w; };
  {
    Bytes one(n * w);
    FillIdentity(one.data(), n, pc.kind, Red::kProd);
    for (size_t k = 0; k < n; ++k) {
      std::memcpy(at(0) + 2 * k * w, one.data() + k * w, w);
      std::memset(at(0) + (2 * k + 1) * w, 0, w);
    }
  }
  for (size_t i = 0; i < D; ++i) {
    unsigned char* next = at(i + 1);
    const unsigned char* pa = static_cast<const unsigned char*>(order[i]->in);
    const unsigned char* pb = static_cast<const unsigned char*>(order[i]->in2);
    for (size_t k = 0; k < n; ++k) {
      std::memcpy(next + 2 * k * w, pa + k * w, w);
      std::memcpy(next + (2 * k + 1) * w, pb + k * w, w);
    }
    // next = pre[i] then x_i
    std::string e = Check(MPI_Reduce_local(at(i), next, static_cast<int>(n), pair.type, pair.op),
                          pc.op, "MPI_Reduce_local");
    if (!e.empty()) return e;
  }
  MPI_Comm comm;
  std::string e = OrderedComm(pc, &comm);
  if (!e.empty()) return e;
  Bytes& before = Scratch(1);
  before.assign(at(D), at(D) + 2 * n * w);
  e = Check(MPI_Exscan(MPI_IN_PLACE, before.data(), static_cast<int>(n), pair.type, pair.op, comm),
            pc.op, "MPI_Exscan");
  if (!e.empty()) return e;
  const bool first = Rank(comm) == 0;
  for (size_t i = 0; i < D; ++i) {
    unsigned char* mine = at(i);
    if (!first) {  // the processes before, then the devices before
      e = Check(MPI_Reduce_local(before.data(), mine, static_cast<int>(n), pair.type, pair.op),
                pc.op, "MPI_Reduce_local");
      if (!e.empty()) return e;
    }
    unsigned char* out = static_cast<unsigned char*>(order[i]->out);
    for (size_t k = 0; k < n; ++k) std::memcpy(out + k * w, mine + (2 * k + 1) * w, w);
  }
  return {};
}

std::string DevBarrier(const Call& pc, std::vector<DeviceCall*>&) {
  return Barrier(pc, nullptr, nullptr);
}

std::string DevAgreeOnly(const Call&, std::vector<DeviceCall*>&) { return {}; }

}  // namespace vjpmpi
