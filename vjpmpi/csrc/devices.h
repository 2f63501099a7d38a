// Many devices per process (core library, devices.cc). A program compiled for several
// devices of this process runs each device's part on a thread of its own, and each
// device's call of a collective is a call of its own (a "device call"). Where it runs:
//  - each device is one rank of its own group of ranks: `local` (D) devices of each
//    process of the communicator the program names (its "base"), ranks p * D + a (p the
//    process's rank there, a the device's place among the group's D devices), one group
//    per combination of the mesh's other axes (vjpmpi.device_comm); D = 1 makes each
//    device a group of its own across the processes (a sharded array: the process is
//    the rank, each device moves its own shard);
//  - every device of the program has a duplicate of the base communicator (DeviceSet::
//    dev): a group's collectives cross processes on its first device's duplicate, run by
//    that device's thread once the group's devices have met (Meet) in this process; the
//    group's other devices wait for it and never call MPI for it;
//  - messages between two devices of one process go through memory (Mailbox); between
//    devices of different processes, MPI, on the duplicate of the pair (DeviceSet::pair:
//    one per sending and receiving device, so that a receive matches its one sender
//    whatever the tags).
// The duplicates are made at a program's first device call (collectively over the base
// communicator, its ranks agreeing first), the pairs' at the first one that needs them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "agree.h"
#include "mpi_ops.h"

namespace vjpmpi {
struct Runtime;

// Where one device call runs: the `dev` attribute (the program's layout) and the
// device's partition (the `where` operand's first value).
struct Place {
  int64_t base = 0;     // vjpmpi's number of the communicator the program names
  int parts = 1;        // N: the program's devices (partitions) in this process
  int devices = 1;      // this process's devices (N of them or more): its DeviceSet's size
  int local = 1;        // D: this process's devices in one group
  int64_t stride = 1;   // the group axis's stride in the partition order (row-major mesh)
  int pid = 0;          // this device's partition
  int a = 0;            // its place in its group, 0..D-1
  int g = 0;            // its group, 0..N/D-1
  int64_t layout = 0;   // a hash of the mesh and the axis (what the processes agree on)
  bool group = false;   // a device communicator's call (else a process communicator's, D = 1)
  // Whether the call is the one-device call on this device's duplicate (D = 1 and a
  // process communicator: each device a group of its own, with the process's semantics).
  bool Alone() const { return local == 1 && !group; }
  // The partition of the device at place `b` of this device's group.
  int Partition(int b) const { return static_cast<int>(pid + (b - a) * stride); }
};

// The `dev` attribute is [N, D, stride, layout, level, group, devices]; an error text for
// a bad one.
std::string MakePlace(int64_t base, int64_t pid, const int64_t* dev, size_t n, Place* out);

// A message between two devices of this process (send / recv / sendrecv, the ragged
// exchange): a copy of what was sent, so that a send returns at once, as MPI's small
// (eager) messages do: a ring of sends between devices never waits for itself.
struct Letter {
  int from = 0;  // the sending partition
  int tag = 0;
  Kind kind = Kind::kUnsupported;
  size_t count = 0;
  std::vector<unsigned char> data;
  int64_t site = 0;
};

// One device's part of a group's collective, as it brings it to the meeting.
struct DeviceCall {
  Call c{};                    // op, kind, count, dims, red, root (a rank of the group)
  const void* in = nullptr;    // its operand(s), host memory
  const void* in2 = nullptr;
  void* out = nullptr;         // its result
  size_t in_bytes = 0, out_bytes = 0;
  int64_t site = 0;
  uint64_t sig = 0;
  std::string invalid;         // an argument error found by this device (its root)
  int64_t run = 0;             // the XLA run id of its program's execution
};

struct Meeting {  // one group's
  std::mutex m;
  std::condition_variable cv;
  uint64_t generation = 0;
  int arrived = 0;
  std::vector<DeviceCall*> calls;  // this generation's, by place
  std::string result;              // the last generation's outcome
};

struct Mailbox {  // one receiving device's
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Letter>> letters;  // posted, not yet taken, in order
};

struct DeviceSet {
  int64_t base = 0;
  int parts = 0;
  std::mutex setup;              // held while the duplicates are made
  std::atomic<int> level{0};     // 1: `dev` made; 2: `pair` made too
  int64_t setup_run = 0;         // the run whose making of them failed, and why
  std::string setup_error;
  std::vector<int64_t> dev;      // per partition
  std::vector<int64_t> pair;     // per (sending, receiving) partition: s * parts + r
  std::vector<std::unique_ptr<Mailbox>> boxes;  // per receiving partition
  std::mutex meetings_mutex;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Meeting>> meetings;  // (layout, g)
  // Started point-to-point calls of a group's devices (vjpmpi.start; device_p2p.h's
  // DeviceStartedCall), by (partition, slot, run), until their wait.
  std::mutex started_mutex;
  std::map<std::tuple<int, int64_t, int64_t>, std::shared_ptr<void>> started;
};

// The devices of communicator `base` in a process of `parts` devices (made on first use;
// its duplicates not yet: Ensure). One set whatever the programs' meshes: processes whose
// programs differ in their devices then meet in the same duplicates, where their layouts
// differ (an error), rather than each waiting for the others to make duplicates of its own.
DeviceSet& Devices(Runtime& rt, int64_t base, int parts);
// Make the set's duplicates up to `level` (1 or 2) once: `make(level)` makes and numbers
// them, collectively over the base communicator (run by the first device to need them;
// the others wait for it here; where it failed, the others of its run `run` get its error).
std::string Ensure(DeviceSet& set, int level, const std::function<std::string(int)>& make,
                   int64_t run);
// `count` duplicates of `comm`, numbered (vjpmpi's numbers, in order), named `name`#i.
std::string DuplicateComms(Runtime& rt, MPI_Comm comm, int count, const char* name,
                           std::vector<int64_t>* ids);

// The group's devices meet: each brings `mine`; the group's first device (place 0)
// waits for all, compares them (a device that disagrees: `work` gets the text) and runs
// `work(calls, invalid)`, the others wait for it; every device returns its outcome.
// Waits past VJPMPI_WARN_AFTER warn, naming the devices missing; past VJPMPI_TIMEOUT
// the job ends.
using GroupWork = std::function<std::string(std::vector<DeviceCall*>&, const std::string&)>;
std::string Meet(Runtime& rt, DeviceSet& set, const Place& pl, DeviceCall* mine,
                 const GroupWork& work);

// Messages between devices of this process: Post leaves a letter for partition `to` (a
// copy of `bytes` bytes at `data`, returning at once); Take waits for the first letter
// from partition `from` with `tag` (any tag: ANY_TAG) and copies it into `out` (its kind
// and element count must be `kind` and `count`).
void PostLetter(DeviceSet& set, int to, int from, int tag, Kind kind, size_t count,
                const void* data, size_t bytes, int64_t site);
std::string TakeLetter(Runtime& rt, DeviceSet& set, int me, int from, int tag, Kind kind,
                       size_t count, void* out, const char* op, int64_t run);

// A device call of run `run` failed with `error`: the run's other devices stop waiting
// (Meet, TakeLetter, the ranks' agreement: runtime.h's RunFailure) with it; Failure: why
// run `run` failed ("": it did not).
void Fail(DeviceSet& set, int64_t run, const std::string& error);
std::string Failure(DeviceSet& set, int64_t run);

// ------------------------------------------------- a group's collectives --
// Run by the group's first device on its duplicate (`pc.comm`), with every device's
// call in `calls` (by place): the process's part of the collective over the group's
// P * D ranks, from the devices' buffers to the devices' results. `pc` is the process's
// call: its count is one device's block (its element count, or per rank for the
// gather/scatter family), its root the group's root rank.
using GroupImpl = std::string (*)(const Call&, std::vector<DeviceCall*>&);
std::string DevAllreduce(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevReduce(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevBcast(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevAllgather(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevGather(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevScatter(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevAlltoall(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevReduceScatter(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevScan(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevExscan(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevOthersProduct(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevRecurrence(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevBarrier(const Call& pc, std::vector<DeviceCall*>& calls);
std::string DevAgreeOnly(const Call& pc, std::vector<DeviceCall*>& calls);

// `inout = in (op) inout`, element-wise, any count (MPI_Reduce_local).
std::string ReduceLocal(const void* in, void* inout, size_t n, Kind k, Red r, const char* op);

}  // namespace vjpmpi
