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
#include <utility>
#include <thread>
#include <vector>

#include "device_ops.h"

namespace vjpmpi {

// The duplicate of the communicator for messages from partition `from` to partition `to`
// of another process (the set's level 2; MPI_COMM_NULL where it was not made: the
// program's lowering asks for it wherever a device call sends point to point).
inline MPI_Comm PairComm(const DeviceStart& s, int from, int to) {
  size_t i = static_cast<size_t>(from) * static_cast<size_t>(s.set->parts) + to;
  if (i >= s.set->pair.size()) return MPI_COMM_NULL;
  CommEntry* e = runtime.comms.Get(s.set->pair[i]);
  return e == nullptr ? MPI_COMM_NULL : e->comm.load();
}

// One point-to-point call between devices, in two phases: Post (the messages posted,
// nothing waits) and Complete (a receive from this process taken, the others tested until
// done). Called back to back, or by a started
// call's start and its wait (vjpmpi.start).
struct DeviceMessages {
  DeviceStart s;
  Call c{}, cs{}, cr{};
  bool sends = false, receives = false, send_here = false, recv_here = false;
  int to = -1, from = -1;
  const void* send = nullptr;
  void* recv = nullptr;
  Posted out, in;

  std::string Post() {
    Runtime& rt = runtime;
    const Place& pl = s.place;
    const int D = pl.local, size = s.procs * D;
    sends = send != nullptr && c.peer != MPI_PROC_NULL;
    receives = recv != nullptr && c.peer2 != MPI_PROC_NULL;
    std::string e = sends ? GroupRank(c.op, "dest", c.peer, size) : std::string();
    if (e.empty() && receives) e = GroupRank(c.op, "source", c.peer2, size);
    if (!e.empty()) return e;
    c.check_p2p = rt.check_enabled.load(std::memory_order_relaxed);
    to = sends ? pl.Partition(c.peer % D) : -1;
    from = receives ? pl.Partition(c.peer2 % D) : -1;
    send_here = sends && c.peer / D == s.proc;
    recv_here = receives && c.peer2 / D == s.proc;
    cs = cr = c;
    if (((sends && !send_here) || (receives && !recv_here)) && s.set->pair.empty()) {
      return std::string("vjpmpi.") + c.op + ": no duplicates of the communicator for "
             "messages between devices of different processes (a vjpmpi bug: the "
             "program's lowering did not ask for them)";
    }
    if (sends && !send_here) {
      cs.comm = PairComm(s, pl.pid, to);
      cs.peer = c.peer / D;
      e = vjpmpi::Post(cs, send, nullptr, &out);
    }
    if (e.empty() && receives && !recv_here) {
      cr.comm = PairComm(s, from, pl.pid);
      cr.peer2 = c.peer2 / D;
      e = vjpmpi::Post(cr, nullptr, recv, &in);
    }
    if (e.empty() && send_here) {
      PostLetter(*s.set, to, pl.pid, c.tag, c.kind, c.count, send, c.count * ByteSize(c.kind),
                 c.site);
    }
    return e;
  }

  std::string Complete() {
    Runtime& rt = runtime;
    std::string e;
    if (recv_here) {
      e = TakeLetter(rt, *s.set, s.place.pid, from, c.tag2, c.kind, c.count2, recv, c.op,
                     s.attrs.run);
    }
    const bool mpi_out = sends && !send_here, mpi_in = receives && !recv_here;
    if (e.empty() && (mpi_out || mpi_in)) {
      uint64_t watch = WatchCall(rt, c.op, c.site, mpi_out ? cs.comm : cr.comm);
      bool done_out = !mpi_out, done_in = !mpi_in;
      while (e.empty() && !(done_out && done_in)) {
        if (!done_out) e = TestPosted(cs, &out, &done_out);
        if (e.empty() && !done_in) e = TestPosted(cr, &in, &done_in);
        if (e.empty() && !(done_out && done_in)) std::this_thread::yield();
      }
      Unwatch(rt, watch);
    }
    return e;
  }
};

// A point-to-point call between devices of a group: `send` (count elements, or null) to
// the group's rank c.peer, `recv` (count2, or null) from c.peer2; either may be
// MPI_PROC_NULL.
inline std::string DevP2P(const DeviceStart& s, const Call& c, const void* send, void* recv) {
  DeviceMessages m;
  m.s = s;
  m.c = c;
  m.send = send;
  m.recv = recv;
  std::string e = m.Post();
  std::string d = m.Complete();
  return e.empty() ? d : e;
}

// A device call's point-to-point call as a Call (null `x`: a recv, null `tmpl`: a send):
// the error text of an unsupported dtype (an argument error ends the job: its peers wait in
// point-to-point calls with it and cannot be told).
inline std::string MessageCall(const char* name, const DeviceStart& s, const ffi::AnyBuffer* x,
                               const ffi::AnyBuffer* tmpl, const Attrs& a, Call* out) {
  if (a.invalid) {
    std::string why = SiteText(runtime, a.invalid);
    AbortWith(why.empty() ? std::string("vjpmpi.") + name + ": an argument error" : why,
              " (the devices it exchanges messages with cannot be told)");
  }
  Call& c = *out;
  c = MakeCall(name, s.attrs, 0);
  const ffi::AnyBuffer& first = x != nullptr ? *x : *tmpl;
  c.kind = KindOf(first.element_type());
  if (c.kind == Kind::kUnsupported || (tmpl != nullptr && KindOf(tmpl->element_type()) != c.kind)) {
    return Unsupported(name);
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
  return {};
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
    if (x != nullptr && tmpl != nullptr) {
      return Noted<Async>(*s.set, a.run, SendrecvH<Async>(std::move(mem), *x, *tmpl, yp, one));
    }
    if (x != nullptr) return Noted<Async>(*s.set, a.run, SendH<Async>(std::move(mem), *x, one));
    return Noted<Async>(*s.set, a.run, RecvH<Async>(std::move(mem), *tmpl, yp, one));
  }
  Call c;
  e = MessageCall(name, s, x, tmpl, a, &c);
  if (!e.empty()) return Finish<Async>(e);
  const void* in = x != nullptr ? mem.In(x->untyped_data(), x->size_bytes()) : nullptr;
  void* out = nullptr;
  if (tmpl != nullptr) {
    mem.In(tmpl->untyped_data(), tmpl->size_bytes());  // (what stays where nothing arrives)
    out = mem.Out(yp, tmpl->size_bytes());
  }
  e = mem.Begin();
  if (e.empty()) e = DevP2P(s, c, in, out);
  std::string end = mem.End();
  if (e.empty()) e = end;
  Fail(*s.set, a.run, e);
  return Finish<Async>(e);
}

// A started device call, between its start and its wait (DeviceSet::started).
struct DeviceStartedCall {
  std::shared_ptr<DeviceMessages> messages;
  std::shared_ptr<std::pair<std::vector<unsigned char>, std::vector<unsigned char>>> held;
  std::shared_ptr<std::vector<int64_t>> dims, dims2;
};

// vjpmpi.start of a device call's send / recv / sendrecv: (where, [x,] [template,] token)
// -> token. Each device its own group: the one-device start on its duplicate; a group's
// device: its messages posted (between buffers of its own: XLA may reuse its arrays once
// the start has returned), kept in the set's started calls for the wait. Host memory.
template <typename Span>
Outcome DevStartH(const char* name, ffi::Buffer<ffi::S32> where, const ffi::AnyBuffer* x,
                  const ffi::AnyBuffer* tmpl, const Attrs& a, Span dev, int64_t slot) {
  DeviceStart s;
  std::string e = StartDevice(name, where, a, dev, &s);
  if (!e.empty()) return Finish<true>(e);
  const int64_t run = StartedRun(slot, a.run);
  if (s.place.Alone()) {
    Attrs one = s.attrs;
    one.comm = s.set->dev[static_cast<size_t>(s.place.pid)];
    auto started = NewStarted(one.comm, slot, run);
    if (x != nullptr && tmpl != nullptr) {
      return SendrecvH<true>(StagedMem(), *x, *tmpl, nullptr, one, started);
    }
    if (x != nullptr) return SendH<true>(StagedMem(), *x, one, started);
    return RecvH<true>(StagedMem(), *tmpl, nullptr, one, started);
  }
  auto m = std::make_shared<DeviceMessages>();
  m->s = s;
  e = MessageCall(name, s, x, tmpl, a, &m->c);
  if (!e.empty()) return Finish<true>(e);
  auto held = std::make_shared<std::pair<std::vector<unsigned char>, std::vector<unsigned char>>>();
  if (x != nullptr) m->send = Keep(held->first, *x);
  if (tmpl != nullptr) m->recv = Receive(held->second, *tmpl, true);
  // (the call's dims point into XLA's call frame: the started call keeps its own)
  auto dims = std::make_shared<std::vector<int64_t>>(m->c.dims, m->c.dims + m->c.ndim);
  auto dims2 = std::make_shared<std::vector<int64_t>>(m->c.dims2, m->c.dims2 + m->c.ndim2);
  m->c.dims = dims->data();
  m->c.dims2 = dims2->data();
  e = m->Post();
  if (!e.empty()) {
    Fail(*s.set, a.run, e);
    return Finish<true>(e);
  }
  std::lock_guard<std::mutex> lock(s.set->started_mutex);
  s.set->started[{s.place.pid, slot, run}] = std::make_shared<DeviceStartedCall>(
      DeviceStartedCall{m, held, dims, dims2});
  return Finish<true>(std::string());
}

// vjpmpi.wait of a device call's started send / recv / sendrecv: (where, token) ->
// ([y,] token), the array received.
template <typename Span>
Outcome DevWaitH(ffi::Buffer<ffi::S32> where, void* y, size_t yb, int64_t comm, int64_t slot,
                 int64_t run, Span dev) {
  Place pl;
  std::string e = MakePlace(comm, where.typed_data()[0], dev.begin(), dev.size(), &pl);
  if (!e.empty()) return Finish<true>(e);
  DeviceSet& set = Devices(runtime, comm, pl.devices);
  run = StartedRun(slot, run);
  if (pl.Alone()) {  // (the one-device wait, on the device's duplicate)
    if (set.dev.empty()) return Finish<true>("vjpmpi.wait: no started call (a vjpmpi bug)");
    return Outcome{{}, WaitFor(set.dev[static_cast<size_t>(pl.pid)], slot, run, y, yb)};
  }
  std::shared_ptr<DeviceStartedCall> call;
  {
    std::lock_guard<std::mutex> lock(set.started_mutex);
    auto it = set.started.find({pl.pid, slot, run});
    if (it != set.started.end()) {
      call = std::static_pointer_cast<DeviceStartedCall>(it->second);
      set.started.erase(it);
    }
  }
  if (call == nullptr) {
    return Finish<true>("vjpmpi.wait: no started call to wait for (an earlier vjpmpi call of "
                        "this run failed, or its start did not run)");
  }
  e = call->messages->Complete();
  Fail(set, run, e);
  if (e.empty() && yb) {
    if (call->held->second.size() != yb) {
      e = "vjpmpi.wait: the started call's result does not have the size of the wait's (a vjpmpi bug)";
    } else {
      HostCopy(y, call->held->second.data(), yb);
    }
  }
  return Finish<true>(e);
}

// The ragged exchange between the devices of a group (ragged.h's RaggedPeers): the
// parts gathered by the group's first device (its process call: the ranks' agreement),
// slices through memory to devices of this process, through the pairs' duplicates to
// those of others.
struct DevicePeers : RaggedPeers {
  const DeviceStart& s;
  const Call& c;
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
    d.run = s.attrs.run;
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
      PostLetter(*s.set, to, s.place.pid, tag, Kind::kU8, bytes, buf, bytes, c.site);
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
                                 p.bytes, p.buf, c.op, s.attrs.run);
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
    return Noted<Async>(*s.set, at.run,
                        RaggedH<Async>(std::move(mem), a0, a1, io, ss, oo, rs, r0, r1, one, form, groups));
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
  e = args.Exchange(c, &peers);
  Fail(*s.set, at.run, e);
  return Finish<Async>(e);
}

}  // namespace vjpmpi
