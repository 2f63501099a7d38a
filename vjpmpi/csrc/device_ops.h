// The handlers of device calls (devices.h: a program compiled for several devices of this
// process), generic over the backend's memory policy. Each takes one more operand than
// its one-device handler, `where` (int32[4]: the device's partition, then the call's root,
// destination and source, ranks of the call's group), and one more attribute, `dev`
// (int64[7]: the program's devices N, the group's devices per process D, the group axis's
// stride in the partition order, a hash of the layout, the duplicates it needs: 1, or 2
// where point-to-point calls cross processes between devices of a group; 1 for a device
// communicator's call, 0 for a process communicator's; the process's devices, N or more).
//  - a process communicator (each device its own group: a sharded array's shard, or a
//    process communicator inside shard_map): the one-device handler, on the device's
//    duplicate of the communicator.
//  - a device communicator: the group's devices meet (Meet); its first device runs the
//    process's part on its duplicate (devices.cc), inside `Run` (the ranks' agreement, the
//    watchdog, the busy flag), the others wait. A point-to-point call goes through memory to a device
//    of this process, through MPI (the pair's duplicate) to one of another process.
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "devices.h"
#include "handler_ops.h"

namespace vjpmpi {

// The memory policy of the group's first device inside its process call: the devices
// have staged their buffers already (host memory).
struct StagedMem {
  void Prepare(Call&) {}
  const void* In(const void* buf, size_t) { return buf; }
  void* Out(void* buf, size_t) { return buf; }
  std::string Begin() { return {}; }
  std::string End() { return {}; }
  std::string Copy(void* dst, const void* src, size_t n) {
    HostCopy(dst, src, n);
    return {};
  }
};

// What a device call starts from: its place, its call's ranks from `where`, and the
// communicator's devices with the duplicates it needs (made at the program's first
// device call, collectively over the communicator, its ranks agreeing first).
struct DeviceStart {
  Place place;
  Attrs attrs{};           // the call's attributes, ranks from `where`
  DeviceSet* set = nullptr;
  int procs = 1, proc = 0;  // the communicator's size and this process's rank there
};

template <typename Span>
std::string StartDevice(const char* op, ffi::Buffer<ffi::S32> where, const Attrs& a,
                        Span dev, DeviceStart* s) {
  if (where.element_count() != 4) {
    return std::string("vjpmpi.") + op + ": a device call's `where` is not int32[4] (a vjpmpi bug)";
  }
  const int32_t* w = where.typed_data();
  std::string e = CheckAlive(op);
  if (e.empty()) e = MakePlace(a.comm, w[0], dev.begin(), dev.size(), &s->place);
  if (!e.empty()) return e;
  CommEntry* base = runtime.comms.Get(a.comm);
  if (base == nullptr || base->comm.load() == MPI_COMM_NULL) {
    return std::string("vjpmpi.") + op + ": this program names communicator #" +
           std::to_string(a.comm) + ", which is not alive in this process (freed, or a "
           "program made by another process); trace it again";
  }
  s->procs = base->size;
  s->proc = base->rank;
  s->attrs = a;
  s->attrs.root = w[1];
  s->attrs.peer = w[2];
  s->attrs.peer2 = w[3];
  s->attrs.layout = s->place.layout;
  s->set = &Devices(runtime, a.comm, s->place.devices);
  const int level = dev.size() > 4 ? static_cast<int>(dev[4]) : 1;
  return Ensure(*s->set, level, [&](int l) {
    // (collective over the communicator, its ranks agreeing first: a process whose program
    // has another layout, or that calls something else there, fails with the others)
    Call c = MakeCall("device_comm", a, 0);
    c.kind = Kind::kI64;
    int64_t shape[2] = {s->place.devices, l};
    c.dims = shape;
    c.ndim = 2;
    c.count = c.count2 = 0;
    Attrs sa = a;
    sa.site = RegisterSite(runtime, "vjpmpi's duplicates of a communicator for " +
                                        std::to_string(s->place.devices) + " devices per process" +
                                        (l == 2 ? " (point to point)" : ""));
    sa.sig = 0;
    sa.invalid = 0;
    StagedMem m;
    std::vector<int64_t> ids;
    ffi::Error r = Run<false>(m, c, sa, true, 0, Ok, [&](StagedMem&, const Call& cc) {
      int count = l == 1 ? s->place.devices : s->place.devices * s->place.devices;
      return DuplicateComms(runtime, cc.comm, count, l == 1 ? "vjpmpi.device" : "vjpmpi.pair",
                            &ids);
    });
    if (r.failure()) return r.message();
    (l == 1 ? s->set->dev : s->set->pair) = std::move(ids);
    return std::string();
  }, a.run);
}

// A device call's result, where it failed here noted for its run (Fail: the run's other
// devices stop waiting for it).
template <bool Async>
Result<Async> Noted(DeviceSet& set, int64_t run, Result<Async> r) {
  if constexpr (Async) {
    if (!r.future && !r.error.empty()) Fail(set, run, r.error);
  } else {
    if (r.failure()) Fail(set, run, r.message());
  }
  return r;
}

// A group's root (or peer) as this process names it, checked: an error text for a rank
// outside the group.
inline std::string GroupRank(const char* op, const char* what, int r, int size) {
  if (r >= 0 && r < size) return {};
  return std::string("vjpmpi.") + op + ": argument '" + what + "'=" + std::to_string(r) +
         " is outside the device communicator (size " + std::to_string(size) + ": expected 0.." +
         std::to_string(size - 1) + ")";
}

// The group's process call, run by its first device: Run (agreement, watchdog, busy flag)
// on that device's duplicate with `body` (devices.cc's DevX) over every device's call.
template <typename Body>
std::string GroupCall(const DeviceStart& s, std::vector<DeviceCall*>& calls,
                      const std::string& invalid, size_t bytes, Body body) {
  Call pc = calls[0]->c;
  Attrs pa = s.attrs;
  pa.comm = s.set->dev[static_cast<size_t>(s.place.pid)];
  pa.invalid = invalid.empty() ? 0 : RegisterSite(runtime, invalid);
  StagedMem m;
  ffi::Error r = Run<false>(m, pc, pa, true, bytes, Ok, [&](StagedMem&, const Call& c) {
    return body(c, calls);
  });
  return r.failure() ? r.message() : std::string();
}

// (where, x, token) -> (y, token): the collectives with one array in and one out.
template <bool Async, Impl F, GroupImpl G, Count N, int Uses, typename Mem, typename Span>
Result<Async> DevUnary(Mem mem, const char* name, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> y, const Attrs& a, Span dev) {
  DeviceStart s;
  std::string e = StartDevice(name, where, a, dev, &s);
  if (!e.empty()) return Finish<Async>(e);
  if (s.place.Alone()) {  // each device its own group: the call on its duplicate
    Attrs one = s.attrs;
    one.comm = s.set->dev[static_cast<size_t>(s.place.pid)];
    return Noted<Async>(*s.set, a.run, Unary<Async, F, N, Uses>(std::move(mem), name, x, y, one));
  }
  const int size = s.procs * s.place.local;
  DeviceCall d;
  d.c = MakeCall(name, s.attrs, Uses);
  d.c.kind = KindOf(x.element_type());
  if (d.c.kind == Kind::kUnsupported) return Finish<Async>(Unsupported(name));
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (N == Count::kOut) {
    SetDims(yd, 0, &d.c.dims, &d.c.ndim);
    d.c.count = y->element_count();
  } else {
    SetDims(xd, N == Count::kInPerRank ? 1 : 0, &d.c.dims, &d.c.ndim);
    d.c.count = N == Count::kInPerRank ? x.element_count() / static_cast<size_t>(size)
                                       : x.element_count();
  }
  d.c.count2 = d.c.count;
  d.c.host_op = F == OthersProduct;
  d.in_bytes = x.size_bytes();
  d.out_bytes = y->size_bytes();
  d.in = mem.In(x.untyped_data(), d.in_bytes);
  d.out = mem.Out(y->untyped_data(), d.out_bytes);
  d.site = a.site;
  d.sig = static_cast<uint64_t>(a.sig);
  d.run = a.run;
  if (Uses & kUsesRoot) d.invalid = GroupRank(name, "root", d.c.root, size);
  e = mem.Begin();
  if (e.empty()) {
    e = Meet(runtime, *s.set, s.place, &d, [&](std::vector<DeviceCall*>& calls,
                                               const std::string& invalid) {
      return GroupCall(s, calls, invalid, std::max(d.in_bytes, d.out_bytes), G);
    });
  }
  std::string end = mem.End();
  if (e.empty()) e = end;
  Fail(*s.set, a.run, e);
  return Finish<Async>(e);
}

// (where, a, b, token) -> (y, token): the linear recurrence.
template <bool Async, typename Mem, typename Span>
Result<Async> DevRecurrenceH(Mem mem, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer a,
                             ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> y, const Attrs& at,
                             Span dev) {
  DeviceStart s;
  std::string e = StartDevice("recurrence", where, at, dev, &s);
  if (!e.empty()) return Finish<Async>(e);
  if (s.place.Alone()) {
    Attrs one = s.attrs;
    one.comm = s.set->dev[static_cast<size_t>(s.place.pid)];
    return Noted<Async>(*s.set, at.run, RecurrenceH<Async>(std::move(mem), a, b, y, one));
  }
  DeviceCall d;
  d.c = MakeCall("recurrence", s.attrs, 0);
  d.c.kind = KindOf(b.element_type());
  if (AffinePair(d.c.kind).op == MPI_OP_NULL || KindOf(a.element_type()) != d.c.kind ||
      a.element_count() != b.element_count()) {
    return Finish<Async>(Unsupported("recurrence"));
  }
  d.c.count = d.c.count2 = b.element_count();
  d.c.host_op = true;
  d.c.reverse = at.reverse != 0;
  SetDims(b.dimensions(), 0, &d.c.dims, &d.c.ndim);
  d.in_bytes = b.size_bytes();
  d.out_bytes = y->size_bytes();
  d.in = mem.In(a.untyped_data(), a.size_bytes());
  d.in2 = mem.In(b.untyped_data(), b.size_bytes());
  d.out = mem.Out(y->untyped_data(), d.out_bytes);
  d.site = at.site;
  d.sig = static_cast<uint64_t>(at.sig);
  d.run = at.run;
  e = mem.Begin();
  if (e.empty()) {
    e = Meet(runtime, *s.set, s.place, &d, [&](std::vector<DeviceCall*>& calls,
                                               const std::string& invalid) {
      return GroupCall(s, calls, invalid, d.in_bytes, DevRecurrence);
    });
  }
  std::string end = mem.End();
  if (e.empty()) e = end;
  Fail(*s.set, at.run, e);
  return Finish<Async>(e);
}

// (where, token) -> token
template <bool Async, typename Mem, typename Span>
Result<Async> DevBarrierH(Mem mem, ffi::Buffer<ffi::S32> where, const Attrs& at, Span dev) {
  DeviceStart s;
  std::string e = StartDevice("barrier", where, at, dev, &s);
  if (!e.empty()) return Finish<Async>(e);
  if (s.place.Alone()) {
    Attrs one = s.attrs;
    one.comm = s.set->dev[static_cast<size_t>(s.place.pid)];
    return Noted<Async>(*s.set, at.run, BarrierH<Async>(std::move(mem), one));
  }
  DeviceCall d;
  d.c = MakeCall("barrier", s.attrs, kWaitsForAll);
  d.c.kind = Kind::kU8;
  d.site = at.site;
  d.sig = static_cast<uint64_t>(at.sig);
  d.run = at.run;
  e = Meet(runtime, *s.set, s.place, &d, [&](std::vector<DeviceCall*>& calls,
                                             const std::string& invalid) {
    return GroupCall(s, calls, invalid, 0, DevBarrier);
  });
  Fail(*s.set, at.run, e);
  return Finish<Async>(e);
}

}  // namespace vjpmpi
