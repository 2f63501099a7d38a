// The handlers of device calls (devices.h: a program compiled for several devices of this
// process), generic over the backend's memory policy. Each takes one more operand than
// its one-device handler, `where` (int32[4]: the device's partition, then the call's root,
// destination and source, ranks of the call's group), and one more attribute, `dev`
// (int64[6]: the program's devices N, the group's devices per process D, the group axis's
// stride in the partition order, a hash of the layout, the duplicates it needs: 1, or 2
// where point-to-point calls cross processes between devices of a group; 1 for a device
// communicator's call, 0 for a process communicator's).
//  - a process communicator (each device its own group: a sharded array's shard, or a
//    process communicator inside shard_map): the one-device handler, on the device's
//    duplicate of the communicator.
//  - a device communicator: the group's devices meet (Meet); its first device runs the process's part on
//    its duplicate (devices.cc), inside `Run` (the ranks' agreement, the watchdog, the
//    busy flag), the others wait. A point-to-point call goes through memory to a device
//    of this process, through MPI (the pair's duplicate) to one of another process.
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
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
  s->set = &Devices(runtime, a.comm, s->place.parts);
  const int level = dev.size() > 4 ? static_cast<int>(dev[4]) : 1;
  return Ensure(*s->set, level, [&](int l) {
    // (collective over the communicator, its ranks agreeing first: a process whose program
    // has another layout, or that calls something else there, fails with the others)
    Call c = MakeCall("device_comm", a, 0);
    c.kind = Kind::kI64;
    int64_t shape[2] = {s->place.parts, l};
    c.dims = shape;
    c.ndim = 2;
    c.count = c.count2 = 0;
    Attrs sa = a;
    sa.site = RegisterSite(runtime, "vjpmpi's duplicates of a communicator for " +
                                        std::to_string(s->place.parts) + " devices per process" +
                                        (l == 2 ? " (point to point)" : ""));
    sa.sig = 0;
    sa.invalid = 0;
    StagedMem m;
    std::vector<int64_t> ids;
    ffi::Error r = Run<false>(m, c, sa, true, 0, Ok, [&](StagedMem&, const Call& cc) {
      int count = l == 1 ? s->place.parts : s->place.parts * s->place.parts;
      return DuplicateComms(runtime, cc.comm, count, l == 1 ? "vjpmpi.device" : "vjpmpi.pair",
                            &ids);
    });
    if (r.failure()) return r.message();
    (l == 1 ? s->set->dev : s->set->pair) = std::move(ids);
    return std::string();
  });
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
    return Unary<Async, F, N, Uses>(mem, name, x, y, one);
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
  if (Uses & kUsesRoot) d.invalid = GroupRank(name, "root", d.c.root, size);
  e = mem.Begin();
  if (e.empty()) {
    e = Meet(runtime, *s.set, s.place, &d, [&](std::vector<DeviceCall*>& calls,
                                               const std::string& invalid) {
      return GroupCall(s, calls, invalid, std::max(d.in_bytes, d.out_bytes), G);
    });
  }
  std::string end = mem.End();
  return Finish<Async>(e.empty() ? end : e);
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
    return RecurrenceH<Async>(mem, a, b, y, one);
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
  e = mem.Begin();
  if (e.empty()) {
    e = Meet(runtime, *s.set, s.place, &d, [&](std::vector<DeviceCall*>& calls,
                                               const std::string& invalid) {
      return GroupCall(s, calls, invalid, d.in_bytes, DevRecurrence);
    });
  }
  std::string end = mem.End();
  return Finish<Async>(e.empty() ? end : e);
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
    return BarrierH<Async>(mem, one);
  }
  DeviceCall d;
  d.c = MakeCall("barrier", s.attrs, kWaitsForAll);
  d.c.kind = Kind::kU8;
  d.site = at.site;
  d.sig = static_cast<uint64_t>(at.sig);
  e = Meet(runtime, *s.set, s.place, &d, [&](std::vector<DeviceCall*>& calls,
                                             const std::string& invalid) {
    return GroupCall(s, calls, invalid, 0, DevBarrier);
  });
  return Finish<Async>(e);
}

// A point-to-point call between devices of a group (D > 1): `send` (count elements, or
// null) to the group's rank s.attrs.peer, `recv` (count2, or null) from s.attrs.peer2;
// either may be MPI_PROC_NULL. Through memory to a device of this process, through the
// pair's duplicate of the communicator to a device of another.
inline std::string DevP2P(const DeviceStart& s, Call c, const void* send, void* recv) {
  Runtime& rt = runtime;
  const Place& pl = s.place;
  const int D = pl.local, size = s.procs * D;
  const bool sends = send != nullptr && c.peer != MPI_PROC_NULL;
  const bool receives = recv != nullptr && c.peer2 != MPI_PROC_NULL;
  if (sends) {
    std::string e = GroupRank(c.op, "dest", c.peer, size);
    if (!e.empty()) return e;
  }
  if (receives) {
    std::string e = GroupRank(c.op, "source", c.peer2, size);
    if (!e.empty()) return e;
  }
  c.check_p2p = rt.check_enabled.load(std::memory_order_relaxed);
  const int to = sends ? pl.Partition(c.peer % D) : -1;
  const int from = receives ? pl.Partition(c.peer2 % D) : -1;
  const bool send_here = sends && c.peer / D == s.proc;
  const bool recv_here = receives && c.peer2 / D == s.proc;
  const size_t N = static_cast<size_t>(pl.parts);
  Posted out, in;
  Call cs = c, cr = c;
  std::string e;
  uint64_t watch = 0;
  if (sends && !send_here) {
    cs.comm = rt.comms.Get(s.set->pair[static_cast<size_t>(pl.pid) * N + to])->comm.load();
    cs.peer = c.peer / D;
    e = Post(cs, send, nullptr, &out);
  }
  if (e.empty() && receives && !recv_here) {
    cr.comm = rt.comms.Get(s.set->pair[static_cast<size_t>(from) * N + pl.pid])->comm.load();
    cr.peer2 = c.peer2 / D;
    e = Post(cr, nullptr, recv, &in);
  }
  Letter letter;
  if (e.empty() && send_here) {
    letter.from = pl.pid;
    letter.tag = c.tag;
    letter.kind = c.kind;
    letter.count = c.count;
    letter.data = send;
    letter.site = c.site;
    PostLetter(rt, *s.set, to, &letter);
  }
  if (e.empty() && recv_here) {
    e = TakeLetter(rt, *s.set, pl.pid, from, c.tag2, c.kind, c.count2, recv, c.op);
  }
  if (e.empty() && ((sends && !send_here) || (receives && !recv_here))) {
    watch = WatchCall(rt, c.op, c.site, (sends && !send_here) ? cs.comm : cr.comm);
    bool done_out = !(sends && !send_here), done_in = !(receives && !recv_here);
    while (e.empty() && !(done_out && done_in)) {
      if (!done_out) e = TestPosted(cs, &out, &done_out);
      if (e.empty() && !done_in) e = TestPosted(cr, &in, &done_in);
      if (e.empty() && !(done_out && done_in)) std::this_thread::yield();
    }
    Unwatch(rt, watch);
  }
  if (send_here) {  // (taken, or failed: the letter must outlive the receiver's look)
    std::string d = Delivered(rt, *s.set, to, &letter, c.op);
    if (e.empty()) e = d;
  }
  return e;
}

// send / recv / sendrecv on devices: (where, [x,] [template,] token) -> ([y,] token).
// `x` null: a recv; `tmpl` null: a send.
template <bool Async, typename Mem, typename Span>
Result<Async> DevP2PH(Mem mem, const char* name, ffi::Buffer<ffi::S32> where,
                      const ffi::AnyBuffer* x, const ffi::AnyBuffer* tmpl, void* yp,
                      const Attrs& a, Span dev) {
  DeviceStart s;
  std::string e = StartDevice(name, where, a, dev, &s);
  if (!e.empty()) return Finish<Async>(e);
  if (s.place.Alone()) {
    Attrs one = s.attrs;
    one.comm = s.set->dev[static_cast<size_t>(s.place.pid)];
    if (x != nullptr && tmpl != nullptr) return SendrecvH<Async>(mem, *x, *tmpl, yp, one);
    if (x != nullptr) return SendH<Async>(mem, *x, one);
    return RecvH<Async>(mem, *tmpl, yp, one);
  }
  if (a.invalid) {  // (its peers wait in point-to-point calls with it: they cannot be told)
    std::string why = SiteText(runtime, a.invalid);
    AbortWith(why.empty() ? std::string("vjpmpi.") + name + ": an argument error" : why,
              " (the devices it exchanges messages with cannot be told)");
  }
  Call c = MakeCall(name, s.attrs, 0);
  const ffi::AnyBuffer& first = x != nullptr ? *x : *tmpl;
  c.kind = KindOf(first.element_type());
  if (c.kind == Kind::kUnsupported || (tmpl != nullptr && KindOf(tmpl->element_type()) != c.kind)) {
    return Finish<Async>(Unsupported(name));
  }
  c.site = a.site;
  c.site_text = &SiteOf;
  if (x != nullptr) {
    c.count = x->element_count();
    SetDims(x->dimensions(), 0, &c.dims, &c.ndim);
  }
  if (tmpl != nullptr) {
    c.count2 = tmpl->element_count();
    SetDims(tmpl->dimensions(), 0, &c.dims2, &c.ndim2);
  }
  if (x == nullptr) c.peer = MPI_PROC_NULL;
  if (tmpl == nullptr) c.peer2 = MPI_PROC_NULL;
  const void* in = x != nullptr ? mem.In(x->untyped_data(), x->size_bytes()) : nullptr;
  void* out = nullptr;
  if (tmpl != nullptr) {
    mem.In(tmpl->untyped_data(), tmpl->size_bytes());  // (what stays where nothing arrives)
    out = mem.Out(yp, tmpl->size_bytes());
  }
  e = mem.Begin();
  if (e.empty()) e = DevP2P(s, c, in, out);
  std::string end = mem.End();
  return Finish<Async>(e.empty() ? end : e);
}

// The ragged exchange between the devices of a group (ragged.h's RaggedPeers): the
// parts gathered by the group's first device (its process call: the ranks' agreement),
// slices through memory to devices of this process, through the pairs' duplicates to
// those of others.
struct DevicePeers : RaggedPeers {
  const DeviceStart& s;
  const Call& c;
  struct Sent {
    Letter letter;
    int to;  // the receiving partition
  };
  std::deque<Sent> letters;  // (stable addresses)
  struct Pending {
    void* buf;
    size_t bytes;
    int from, tag;
  };
  std::vector<Pending> pending;  // receives from devices of this process
  std::vector<MPI_Request> reqs;
  int D = 1;

  DevicePeers(const DeviceStart& start, const Call& call) : s(start), c(call) {
    D = s.place.local;
    size = s.procs * D;
    rank = s.proc * D + s.place.a;
    room = 0;
  }

  std::string Gather(const int64_t* part, size_t stride, int64_t* all) override {
    DeviceCall d;
    d.c = c;
    d.in = part;
    d.out = all;
    d.in_bytes = stride * sizeof(int64_t);
    d.out_bytes = static_cast<size_t>(size) * d.in_bytes;
    d.site = c.site;
    d.sig = sig;
    return Meet(runtime, *s.set, s.place, &d, [&](std::vector<DeviceCall*>& calls,
                                                  const std::string& invalid) {
      return GroupCall(s, calls, invalid, d.out_bytes, [stride](const Call& pc,
                                                                std::vector<DeviceCall*>& cs) {
        const size_t local = cs.size() * stride;
        std::vector<int64_t> mine(local);
        for (size_t a = 0; a < cs.size(); ++a) {
          std::memcpy(mine.data() + a * stride, cs[a]->in, stride * sizeof(int64_t));
        }
        int64_t* all = static_cast<int64_t*>(cs[0]->out);
        std::string e = Check(MPI_Allgather(mine.data(), static_cast<int>(local), MPI_INT64_T, all,
                                            static_cast<int>(local), MPI_INT64_T, pc.comm),
                              pc.op, "MPI_Allgather");
        for (size_t a = 1; a < cs.size() && e.empty(); ++a) {
          std::memcpy(cs[a]->out, all, cs[0]->out_bytes);
        }
        return e;
      });
    });
  }

  MPI_Comm Pair(int from, int to) const {
    return runtime.comms.Get(s.set->pair[static_cast<size_t>(from) * s.place.parts + to])
        ->comm.load();
  }

  std::string Send(const void* buf, size_t bytes, int peer, int tag) override {
    const int to = s.place.Partition(peer % D);
    if (peer / D == s.proc) {
      letters.emplace_back();
      letters.back().to = to;
      Letter& l = letters.back().letter;
      l.from = s.place.pid;
      l.tag = tag;
      l.kind = Kind::kU8;
      l.count = bytes;
      l.data = buf;
      PostLetter(runtime, *s.set, to, &l);
      return {};
    }
    MPI_Request r;
    int rc = VJPMPI_BY_COUNT(bytes, MPI_Isend, buf, n, MPI_BYTE, peer / D, 0,
                             Pair(s.place.pid, to), &r);
    if (rc == MPI_SUCCESS) reqs.push_back(r);
    return Check(rc, c.op, "MPI_Isend");
  }

  std::string Recv(void* buf, size_t bytes, int peer, int tag) override {
    const int from = s.place.Partition(peer % D);
    if (peer / D == s.proc) {
      pending.push_back({buf, bytes, from, tag});
      return {};
    }
    MPI_Request r;
    int rc = VJPMPI_BY_COUNT(bytes, MPI_Irecv, buf, n, MPI_BYTE, peer / D, 0,
                             Pair(from, s.place.pid), &r);
    if (rc == MPI_SUCCESS) reqs.push_back(r);
    return Check(rc, c.op, "MPI_Irecv");
  }

  std::string Finish() override {
    std::string e;
    for (const Pending& p : pending) {
      std::string t = TakeLetter(runtime, *s.set, s.place.pid, p.from, p.tag, Kind::kU8,
                                 p.bytes, p.buf, c.op);
      if (e.empty()) e = t;
    }
    pending.clear();
    if (!reqs.empty()) {
      uint64_t watch = WatchCall(runtime, c.op, c.site, c.comm);
      std::string w = Check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(),
                                        MPI_STATUSES_IGNORE),
                            c.op, "MPI_Waitall");
      Unwatch(runtime, watch);
      reqs.clear();
      if (e.empty()) e = w;
    }
    for (Sent& l : letters) {
      std::string d = Delivered(runtime, *s.set, l.to, &l.letter, c.op);
      if (e.empty()) e = d;
    }
    letters.clear();
    return e;
  }

  uint64_t sig = 0;
};

// (where, a0, a1, input_offsets, send_sizes, output_offsets, recv_sizes, token) ->
// (r0, r1, token): the ragged exchange (handler_ops.h's RaggedH) of a device call.
template <bool Async, typename Mem, typename Span>
Result<Async> DevRaggedH(Mem mem, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer a0,
                         ffi::AnyBuffer a1, ffi::AnyBuffer io, ffi::AnyBuffer ss,
                         ffi::AnyBuffer oo, ffi::AnyBuffer rs, ffi::Result<ffi::AnyBuffer> r0,
                         ffi::Result<ffi::AnyBuffer> r1, const Attrs& at, int64_t form,
                         int64_t groups, Span dev) {
  DeviceStart s;
  std::string e = StartDevice(RaggedName(static_cast<int>(form)), where, at, dev, &s);
  if (!e.empty()) return Finish<Async>(e);
  if (s.place.Alone()) {
    Attrs one = s.attrs;
    one.comm = s.set->dev[static_cast<size_t>(s.place.pid)];
    return RaggedH<Async>(mem, a0, a1, io, ss, oo, rs, r0, r1, one, form, groups);
  }
  RaggedArgs args(a0, a1, io, ss, oo, rs, r0, r1, s.attrs, form, groups);
  e = args.error;
  const int size = s.procs * s.place.local;
  if (e.empty()) e = args.SizeCheck(size);
  if (e.empty() && (args.c.uses & kUsesRoot)) e = GroupRank(args.name, "root", args.c.root, size);
  if (!e.empty()) return Finish<Async>(e);
  Call c = args.c;
  c.site = at.site;
  c.site_text = &SiteOf;
  DevicePeers peers(s, c);
  peers.sig = static_cast<uint64_t>(at.sig);
  return Finish<Async>(args.Exchange(c, &peers));
}

}  // namespace vjpmpi
