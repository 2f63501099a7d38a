// Messages between the devices of a group (devices.h: a device communicator): send,
// recv and sendrecv (DevP2P, DevP2PH), and the ragged exchange (DevicePeers, DevRaggedH),
// through memory between devices of this process (letters), through MPI between
// processes, on the duplicate of the communicator of each (sending, receiving) device
// pair (a receive then matches its one sender, whatever the tags).
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "device_ops.h"

namespace vjpmpi {

// The duplicate of the communicator for messages from partition `from` to partition `to`
// of another process (the set's level 2; MPI_COMM_NULL where it was not made: the
// program's lowering asks for it wherever a device call sends point to point).
inline MPI_Comm PairComm(const DeviceStart& s, int from, int to) {
  size_t i = static_cast<size_t>(from) * static_cast<size_t>(s.place.parts) + to;
  if (i >= s.set->pair.size()) return MPI_COMM_NULL;
  CommEntry* e = runtime.comms.Get(s.set->pair[i]);
  return e == nullptr ? MPI_COMM_NULL : e->comm.load();
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
  (void)N;
  if (((sends && !send_here) || (receives && !recv_here)) && s.set->pair.empty()) {
    return std::string("vjpmpi.") + c.op + ": no duplicates of the communicator for messages "
           "between devices of different processes (a vjpmpi bug: the program's lowering "
           "did not ask for them)";
  }
  std::string e;
  uint64_t watch = 0;
  if (sends && !send_here) {
    cs.comm = PairComm(s, pl.pid, to);
    cs.peer = c.peer / D;
    e = Post(cs, send, nullptr, &out);
  }
  if (e.empty() && receives && !recv_here) {
    cr.comm = PairComm(s, from, pl.pid);
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

  MPI_Comm Pair(int from, int to) const { return PairComm(s, from, to); }

  std::string Send(const void* buf, size_t bytes, int peer, int tag) override {
    const int to = s.place.Partition(peer % D);
    if (peer / D != s.proc && s.set->pair.empty()) return NoPairs();
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
    if (peer / D != s.proc && s.set->pair.empty()) return NoPairs();
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

  std::string NoPairs() const {
    return std::string("vjpmpi.") + c.op + ": no duplicates of the communicator for messages "
           "between devices of different processes (a vjpmpi bug)";
  }
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
