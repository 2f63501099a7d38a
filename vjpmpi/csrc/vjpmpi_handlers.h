// XLA FFI handlers of every collective, written once for all backends.
//
// A backend file defines, before including this header:
//   VJPMPI_CTX_BIND          extra FFI bindings before the arguments (e.g. the stream)
//   VJPMPI_CTX_PARAMS_FIRST  the matching handler parameters, each followed by a comma
//   VJPMPI_MEM               an expression making the memory policy from those parameters
//   VJPMPI_RUNTIME_OWNER     (the CPU backend only) this module owns the runtime and
//                            exports it; every other module gets attach_runtime()
// and a memory policy type with:
//   void Prepare(Call&)                       before anything (may switch c.copy)
//   const void* In(const void* buf, size_t)   a pointer MPI may read
//   void* Out(void* buf, size_t)              a pointer MPI may write (aliases kept)
//   std::string Begin()                       inputs ready (e.g. stream synchronised)
//   std::string End()                         outputs in place (e.g. copied back)
// Every handler takes the ordering token last and returns it last; the token
// carries no data, it only orders the custom calls inside one XLA program.
#pragma once

#include <stdexcept>
#include <string>
#include <unordered_set>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "vjpmpi_mpi.h"
#include "vjpmpi_runtime.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace vjpmpi {
namespace {

Kind KindOf(ffi::DataType t) {
  switch (t) {
#define VJPMPI_X(e, name, xla, mpi, bytes) \
  case ffi::DataType::xla:                 \
    return Kind::e;
    VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
    default: return Kind::kUnsupported;
  }
}

using Impl = std::string (*)(const Call&, const void*, void*);

// How the element count of one MPI block follows from the buffers.
enum class Count { kIn, kOut, kInPerRank };

struct Attrs {
  int64_t comm, red, root, peer, peer2, tag, tag2, status, reverse, site, sig, invalid;
  int64_t run;  // the XLA run id of this execution (not an attribute)
};

Call MakeCall(const char* name, const Attrs& a, int uses) {
  Call c{};
  c.op = name;
  c.comm = MPI_COMM_NULL;  // (resolved from the program's communicator number by Run)
  c.red = static_cast<Red>(a.red);
  c.root = static_cast<int>(a.root);
  c.peer = static_cast<int>(a.peer);
  c.peer2 = static_cast<int>(a.peer2);
  c.tag = static_cast<int>(a.tag);
  c.tag2 = static_cast<int>(a.tag2);
  c.status = nullptr;  // (a slot's status: Run)
  c.reverse = a.reverse != 0;
  c.uses = uses;
  return c;
}

void SetDims(const ffi::AnyBuffer::Dimensions& d, size_t skip, const int64_t** dims, int* ndim) {
  *dims = d.size() > skip ? d.begin() + skip : nullptr;
  *ndim = d.size() > skip ? static_cast<int>(d.size() - skip) : 0;
}

ffi::Error Unsupported(const char* name) {
  return ffi::Error::InvalidArgument(std::string("vjpmpi.") + name + ": unsupported dtype");
}

std::string SiteOf(int64_t site) {
  Runtime* rt = CurrentRuntime();
  return rt ? SiteText(*rt, site) : std::string();
}

void FillStatus(Runtime& rt, int64_t slot, const MPI_Status& st) {
  std::lock_guard<std::mutex> lock(rt.status_mutex);
  auto it = rt.statuses.find(slot);
  if (it != rt.statuses.end()) *it->second = st;  // (a dead MPI.Status has no slot)
}

// Everything a handler does around its MPI call: the communicator the program names
// (alive, and for a collective this thread's), `prepare` (what needs the communicator,
// such as its size), the guard (trace, counters, watchdog slot), the ranks' agreement on
// a collective (vjpmpi_agree.h) or the opt-in point-to-point check, the memory policy's
// staging before and after, and the receive status of a status slot.
template <typename Mem, typename Prepare, typename Body>
ffi::Error Run(Mem& mem, Call& c, const Attrs& a, bool collective, Prepare prepare, Body body) {
  Runtime* rt = CurrentRuntime();
  if (rt == nullptr) {  // only a module imported around vjpmpi/_kernels.py
    return ffi::Error::Internal(std::string("vjpmpi.") + c.op +
                                ": this backend's module is not attached to vjpmpi's runtime "
                                "(import vjpmpi, which attaches it)");
  }
  CommEntry* ce = nullptr;
  std::string e = CheckAlive(c.op);
  if (e.empty()) e = Resolve(*rt, c, a.comm, collective, &ce);
  struct Busy {  // (one collective at a time on a communicator, in this process)
    std::atomic<bool>* flag = nullptr;
    ~Busy() {
      if (flag) flag->store(false, std::memory_order_release);
    }
  } busy;
  if (e.empty() && collective) {
    if (ce->busy.exchange(true, std::memory_order_acquire)) {
      e = std::string("vjpmpi.") + c.op + ": " + BusyError(ce->id, ce->size);
    } else {
      busy.flag = &ce->busy;
    }
  }
  if (e.empty()) e = prepare();
  if (!e.empty()) return ffi::Error::Internal(e);
  mem.Prepare(c);
  Guard guard(*rt, c.op, a.site, c.comm);
  c.site = a.site;
  c.site_text = &SiteOf;
  MPI_Status status{};
  if (a.status) c.status = &status;
  if (collective && rt->agreement.load(std::memory_order_relaxed)) {
    std::string invalid = a.invalid ? SiteText(*rt, a.invalid) : std::string();
    if (a.invalid && invalid.empty()) invalid = "an argument error (its text is not known here)";
    e = EnsureChannel(*rt, *ce, c.op);
    if (e.empty()) {
      guard.Pause();
      e = Agree(*rt, *ce, c, static_cast<uint64_t>(a.sig), a.run, invalid);
      guard.Resume();
    }
  } else {
    c.check_p2p = rt->check_enabled.load(std::memory_order_relaxed);
    if (a.invalid) {  // (its peers wait in point-to-point calls with it: they cannot be told)
      std::string why = SiteText(*rt, a.invalid);
      if (why.empty()) why = std::string("vjpmpi.") + c.op + ": an argument error (its text is not known here)";
      if (!collective && ce->size > 1) {
        guard.Pause();
        AbortWith(why, " (the ranks it exchanges messages with cannot be told)");
      }
      e = why;
    }
  }
  if (e.empty()) e = body();
  std::string end = mem.End();
  if (e.empty()) e = end;
  if (a.status) FillStatus(*rt, a.status, status);
  return e.empty() ? ffi::Error::Success() : ffi::Error::Internal(e);
}

inline std::string Ok() { return {}; }

// (x, token) -> (y, token): every collective with one array in and one out.
template <Impl F, Count N, int Uses, typename Mem>
ffi::Error Unary(Mem mem, const char* name, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                 const Attrs& a) {
  Call c = MakeCall(name, a, Uses);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported) return Unsupported(name);
  c.host_op = F == OthersProduct;  // multiplies on the host
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (N == Count::kOut) {
    SetDims(yd, 0, &c.dims, &c.ndim);
  } else {
    SetDims(xd, N == Count::kInPerRank ? 1 : 0, &c.dims, &c.ndim);
  }
  SetDims(yd, 0, &c.dims2, &c.ndim2);  // (a receive's template)
  return Run(mem, c, a, F != Recv, [&] {
    if (N == Count::kIn) {
      c.count = x.element_count();
    } else if (N == Count::kOut) {
      c.count = y->element_count();
    } else {
      int size = 1;
      MPI_Comm_size(c.comm, &size);
      c.count = x.element_count() / static_cast<size_t>(size);
    }
    c.count2 = c.count;
    return Ok();
  }, [&] {
    const void* in = mem.In(x.untyped_data(), x.size_bytes());
    void* out = mem.Out(y->untyped_data(), y->size_bytes());
    std::string e = mem.Begin();
    return e.empty() ? F(c, in, out) : e;
  });
}

// (x, token) -> token
template <typename Mem>
ffi::Error SendH(Mem mem, ffi::AnyBuffer x, const Attrs& a) {
  Call c = MakeCall("send", a, 0);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported) return Unsupported("send");
  c.count = c.count2 = x.element_count();
  SetDims(x.dimensions(), 0, &c.dims, &c.ndim);
  return Run(mem, c, a, false, Ok, [&] {
    const void* in = mem.In(x.untyped_data(), x.size_bytes());
    std::string e = mem.Begin();
    return e.empty() ? Send(c, in, nullptr) : e;
  });
}

// (x, recv template, token) -> (y, token); y aliases the template.
template <typename Mem>
ffi::Error SendrecvH(Mem mem, ffi::AnyBuffer x, ffi::AnyBuffer tmpl,
                     ffi::Result<ffi::AnyBuffer> y, const Attrs& a) {
  Call c = MakeCall("sendrecv", a, 0);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported || KindOf(y->element_type()) != c.kind) {
    return Unsupported("sendrecv");
  }
  c.count = x.element_count();
  c.count2 = y->element_count();
  SetDims(x.dimensions(), 0, &c.dims, &c.ndim);
  SetDims(y->dimensions(), 0, &c.dims2, &c.ndim2);
  return Run(mem, c, a, false, Ok, [&] {
    const void* in = mem.In(x.untyped_data(), x.size_bytes());
    mem.In(tmpl.untyped_data(), tmpl.size_bytes());  // unreceived elements keep it
    void* out = mem.Out(y->untyped_data(), y->size_bytes());
    std::string e = mem.Begin();
    return e.empty() ? Sendrecv(c, in, out) : e;
  });
}

// (a, b, token) -> (e, token): the linear recurrence scan; e may alias b.
template <typename Mem>
ffi::Error RecurrenceH(Mem mem, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> y,
                       const Attrs& attrs) {
  Call c = MakeCall("recurrence", attrs, 0);
  c.kind = KindOf(b.element_type());
  if (AffinePair(c.kind).op == MPI_OP_NULL || KindOf(a.element_type()) != c.kind ||
      a.element_count() != b.element_count()) {
    return Unsupported("recurrence");
  }
  c.count = c.count2 = b.element_count();
  c.host_op = true;
  SetDims(b.dimensions(), 0, &c.dims, &c.ndim);
  return Run(mem, c, attrs, true, Ok, [&] {
    const void* pa = mem.In(a.untyped_data(), a.size_bytes());
    const void* pb = mem.In(b.untyped_data(), b.size_bytes());
    void* out = mem.Out(y->untyped_data(), y->size_bytes());
    std::string e = mem.Begin();
    return e.empty() ? Recurrence(c, pa, pb, out) : e;
  });
}

// token -> token
template <typename Mem>
ffi::Error BarrierH(Mem mem, const Attrs& a) {
  Call c = MakeCall("barrier", a, 0);
  c.kind = Kind::kU8;
  return Run(mem, c, a, true, Ok, [&] {
    std::string e = mem.Begin();
    return e.empty() ? Barrier(c, nullptr, nullptr) : e;
  });
}

#define VJPMPI_ATTR_PARAMS                                                                   \
  int64_t comm, int64_t red, int64_t root, int64_t peer, int64_t peer2, int64_t tag,        \
      int64_t tag2, int64_t status, int64_t reverse, int64_t site, int64_t sig,             \
      int64_t invalid
#define VJPMPI_ATTRS_OF                                                                       \
  Attrs{comm, red, root, peer, peer2, tag, tag2, status, reverse, site, sig, invalid, run.run_id}
#define VJPMPI_ATTRS                                                                \
  .Attr<int64_t>("comm")       /* vjpmpi's number of the communicator */           \
      .Attr<int64_t>("red")    /* reduction code, see Red */                       \
      .Attr<int64_t>("root")   /* root rank */                                     \
      .Attr<int64_t>("peer")   /* destination rank */                              \
      .Attr<int64_t>("peer2")  /* source rank */                                   \
      .Attr<int64_t>("tag")    /* send tag */                                      \
      .Attr<int64_t>("tag2")   /* receive tag */                                   \
      .Attr<int64_t>("status") /* status slot to fill (a live MPI.Status), or 0 */ \
      .Attr<int64_t>("reverse") /* scans: 1 = from the last rank down */            \
      .Attr<int64_t>("site")   /* call-site hash (check/timeout), or 0 */          \
      .Attr<int64_t>("sig")    /* the program's signature on the communicator */   \
      .Attr<int64_t>("invalid") /* hash of an argument error found at trace time */

// Every handler binds the backend's context, then the execution's run id.
#define VJPMPI_BIND ffi::Ffi::Bind() VJPMPI_CTX_BIND.Ctx<ffi::RunId>()
#define VJPMPI_PARAMS_FIRST VJPMPI_CTX_PARAMS_FIRST ffi::RunId run,

#define VJPMPI_UNARY(Symbol, name, F, N, Uses)                                            \
  ffi::Error Symbol##Impl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::Token,               \
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,          \
                          VJPMPI_ATTR_PARAMS) {                                            \
    return Unary<F, N, Uses>(VJPMPI_MEM, name, x, y, VJPMPI_ATTRS_OF);                     \
  }                                                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Symbol, Symbol##Impl,                                      \
                                VJPMPI_BIND                                                \
                                    .Arg<ffi::AnyBuffer>() /* x */                         \
                                    .Arg<ffi::Token>()     /* ordering token */            \
                                    .Ret<ffi::AnyBuffer>() /* y */                         \
                                    .Ret<ffi::Token>()     /* ordering token */            \
                                        VJPMPI_ATTRS);

constexpr int kRed = kUsesRed, kRoot = kUsesRoot;
VJPMPI_UNARY(kAllreduce, "allreduce", Allreduce, Count::kIn, kRed)
VJPMPI_UNARY(kReduce, "reduce", Reduce, Count::kIn, kRed | kRoot)
VJPMPI_UNARY(kBcast, "bcast", Bcast, Count::kIn, kRoot)
VJPMPI_UNARY(kAllgather, "allgather", Allgather, Count::kIn, 0)
VJPMPI_UNARY(kGather, "gather", Gather, Count::kIn, kRoot)
VJPMPI_UNARY(kScatter, "scatter", Scatter, Count::kOut, kRoot)
VJPMPI_UNARY(kAlltoall, "alltoall", Alltoall, Count::kInPerRank, 0)
VJPMPI_UNARY(kReduceScatter, "reduce_scatter", ReduceScatter, Count::kOut, kRed)
VJPMPI_UNARY(kScan, "scan", Scan, Count::kIn, kRed)
VJPMPI_UNARY(kExscan, "exscan", Exscan, Count::kIn, kRed)
VJPMPI_UNARY(kOthersProduct, "others_product", OthersProduct, Count::kIn, 0)
VJPMPI_UNARY(kRecv, "recv", Recv, Count::kOut, 0)
VJPMPI_UNARY(kAgree, "agree", AgreeOnly, Count::kIn, 0)

ffi::Error SendImpl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::Token>,
                    VJPMPI_ATTR_PARAMS) {
  return SendH(VJPMPI_MEM, x, VJPMPI_ATTRS_OF);
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSend, SendImpl,
                              VJPMPI_BIND
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::Token>()      // ordering token
                                  .Ret<ffi::Token>()      // ordering token
                                      VJPMPI_ATTRS);

// Two arrays in, one out (which may alias the second): sendrecv, the recurrence.
#define VJPMPI_BINARY(Symbol, Handler)                                                       \
  ffi::Error Symbol##Impl(VJPMPI_PARAMS_FIRST ffi::AnyBuffer a, ffi::AnyBuffer b,           \
                          ffi::Token, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, \
                          VJPMPI_ATTR_PARAMS) {                                              \
    return Handler(VJPMPI_MEM, a, b, y, VJPMPI_ATTRS_OF);                                    \
  }                                                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Symbol, Symbol##Impl,                                        \
                                VJPMPI_BIND                                                  \
                                    .Arg<ffi::AnyBuffer>() /* a */                           \
                                    .Arg<ffi::AnyBuffer>() /* b */                           \
                                    .Arg<ffi::Token>()     /* ordering token */              \
                                    .Ret<ffi::AnyBuffer>() /* y */                           \
                                    .Ret<ffi::Token>()     /* ordering token */              \
                                        VJPMPI_ATTRS);

// sendrecv: a is sent to peer; y, received from peer2, aliases b (the receive template)
VJPMPI_BINARY(kSendrecv, SendrecvH)
// recurrence: a, the coefficients, and b, the inputs; y may alias b
VJPMPI_BINARY(kRecurrence, RecurrenceH)

ffi::Error BarrierImpl(VJPMPI_PARAMS_FIRST ffi::Token, ffi::Result<ffi::Token>,
                       VJPMPI_ATTR_PARAMS) {
  return BarrierH(VJPMPI_MEM, VJPMPI_ATTRS_OF);
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrier, BarrierImpl,
                              VJPMPI_BIND
                                  .Arg<ffi::Token>()  // ordering token
                                  .Ret<ffi::Token>()  // ordering token
                                      VJPMPI_ATTRS);

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::string LibraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING + 1];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  buf[len] = '\0';
  return std::string(buf, len);
}

Runtime& AttachedRuntime() {
  Runtime* rt = CurrentRuntime();
  if (rt == nullptr) {
    throw std::runtime_error(
        "vjpmpi: this module is not attached to vjpmpi's runtime (import vjpmpi, which "
        "attaches it)");
  }
  return *rt;
}

// Names passed to _guard_for_test, kept for the life of the process (the
// watchdog may read the name of the last call after it ended).
const char* Intern(const std::string& name) {
  static std::mutex mutex;
  static std::unordered_set<std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  return names.insert(name).first->c_str();
}

// What every backend module exports: its handlers, the tables Python builds its
// codes from, and test views of the runtime it uses.
void DefineCommon(nb::module_& m) {
  m.def("registrations", []() {
    nb::dict d;
    d["allreduce"] = Capsule(kAllreduce);
    d["reduce"] = Capsule(kReduce);
    d["bcast"] = Capsule(kBcast);
    d["allgather"] = Capsule(kAllgather);
    d["gather"] = Capsule(kGather);
    d["scatter"] = Capsule(kScatter);
    d["alltoall"] = Capsule(kAlltoall);
    d["reduce_scatter"] = Capsule(kReduceScatter);
    d["scan"] = Capsule(kScan);
    d["exscan"] = Capsule(kExscan);
    d["send"] = Capsule(kSend);
    d["recv"] = Capsule(kRecv);
    d["sendrecv"] = Capsule(kSendrecv);
    d["barrier"] = Capsule(kBarrier);
    d["agree"] = Capsule(kAgree);
    d["recurrence"] = Capsule(kRecurrence);
    d["others_product"] = Capsule(kOthersProduct);
    return d;
  });
  // The MPI library these kernels resolved at load time (checked at import
  // against the one mpi4py loaded).
  m.def("library_version", &LibraryVersion);
  // The reduction names in code order (the `red` attribute is the position) and
  // the NumPy names of the supported dtypes: vjpmpi/_mpi.py builds its codes from them.
  m.def("reductions", &ReductionNames);
  m.def("dtypes", &KindNames);
  // Test views of the runtime this module's handlers use: its address, a call
  // site's text, and one guarded "call" entered exactly as a handler enters one
  // (trace, call counter, overlap counter, watchdog slot), without MPI.
  m.def("_runtime_address", []() {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(CurrentRuntime()));
  });
  m.def("_site_for_test", [](int64_t id) { return Site(AttachedRuntime(), id, ""); });
  m.def("_guard_for_test", [](const std::string& name, int64_t site) {
    Guard guard(AttachedRuntime(), Intern(name), site, MPI_COMM_NULL);
  });
  m.attr("abi") = nb::str(VJPMPI_MPI_ABI);
  m.attr("mpi_version") =
      nb::str((std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION)).c_str());
  m.attr("status_size") = nb::int_(static_cast<int64_t>(sizeof(MPI_Status)));
  // The jaxlib whose XLA FFI headers this module was compiled against.
  m.attr("jaxlib_headers") = nb::str(VJPMPI_JAXLIB_HEADERS);
}

#ifdef VJPMPI_RUNTIME_OWNER
// The module that owns the runtime exports it (runtime_capsule(), for the other
// backends' attach_runtime) and its Python interface.
inline RuntimeHandle owned_handle = MakeRuntimeHandle(&owned_runtime);

void DefineRuntime(nb::module_& m) {
  m.def("runtime_capsule", []() {
    return nb::capsule(static_cast<const void*>(&owned_handle), kRuntimeCapsule);
  });
  // configure(check, timeout_seconds): the opt-in mismatch check and watchdog.
  m.def("configure", [](bool check, double timeout) { Configure(owned_runtime, check, timeout); });
  // register_site(text) -> its hash (the `site` attribute; also argument errors' texts)
  m.def("register_site", [](const std::string& text) { return RegisterSite(owned_runtime, text); });
  // comm_number(handle) -> vjpmpi's number for the communicator (the `comm` attribute)
  m.def("comm_number", [](int64_t handle) {
    int64_t id = 0;
    std::string e = CommNumber(owned_runtime, FromHandle<MPI_Comm>(handle), &id);
    if (!e.empty()) throw std::runtime_error(e);
    return id;
  });
  // A status slot (the `status` attribute) filled at the address of a live MPI.Status;
  // release_status when the object dies (calls then fill nothing).
  m.def("register_status", [](int64_t slot, int64_t address) {
    std::lock_guard<std::mutex> lock(owned_runtime.status_mutex);
    owned_runtime.statuses[slot] = reinterpret_cast<MPI_Status*>(static_cast<uintptr_t>(address));
  });
  m.def("release_status", [](int64_t slot) {
    std::lock_guard<std::mutex> lock(owned_runtime.status_mutex);
    owned_runtime.statuses.erase(slot);
  });
  m.def("_status_slots", []() {  // (live ones, for the tests)
    std::lock_guard<std::mutex> lock(owned_runtime.status_mutex);
    return static_cast<int64_t>(owned_runtime.statuses.size());
  });
  // (collectives this process ran on a communicator, program signatures verified on it,
  // freed) for the tests; the number of collectives compared across ranks so far.
  m.def("_comm_info", [](int64_t id) {
    CommEntry* e = owned_runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    return nb::make_tuple(e->count, static_cast<int64_t>(e->verified.size()),
                          e->comm.load() == MPI_COMM_NULL);
  });
  m.def("verified_count", []() { return owned_runtime.verified.load(); });
  // The benchmark of the agreement's cost turns it off and on (benchmarks/suite.py);
  // _forget_verified makes the next run of every program on a communicator a first one.
  m.def("_set_agreement", [](bool on) { owned_runtime.agreement.store(on); });
  m.def("_forget_verified", [](int64_t id) {
    CommEntry* e = owned_runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    e->verified.clear();
    e->last_verified = 0;
    e->ran = false;
  });
  m.def("comm_alive", [](int64_t id) {
    CommEntry* e = owned_runtime.comms.Get(id);
    return e != nullptr && e->comm.load() != MPI_COMM_NULL;
  });
  m.def("open_channels", []() {
    std::lock_guard<std::mutex> lock(owned_runtime.comms.mutex);
    return static_cast<int64_t>(owned_runtime.open_channels.size());
  });
  // claim_thread(number, thread) -> the thread that owns the communicator (the first
  // to claim it), the error text for Python when that is another thread
  m.def("claim_thread", [](int64_t id, uint64_t thread) {
    CommEntry* e = owned_runtime.comms.Get(id);
    if (e == nullptr) throw std::runtime_error("no such communicator number");
    uint64_t owner = 0;
    e->owner.compare_exchange_strong(owner, thread);
    owner = e->owner.load();
    return nb::make_tuple(owner, owner == thread ? std::string()
                                                 : ThreadError(thread, owner, id, e->size));
  });
  m.def("trace_enabled", []() { return owned_runtime.tracing; });
  // Returns and clears the recorded sequence of collectives.
  m.def("take_trace", []() {
    std::lock_guard<std::mutex> lock(owned_runtime.trace_mutex);
    std::vector<std::string> out;
    out.swap(owned_runtime.trace_log);
    return out;
  });
  // (kernel calls, calls that overlapped another running vjpmpi kernel), every backend's
  m.def("call_counts", []() {
    return nb::make_tuple(owned_runtime.calls.load(), owned_runtime.overlaps.load());
  });
}
#else
// A backend module that does not own the runtime is attached to the owner's.
void DefineAttach(nb::module_& m, const char* module) {
  // attach_runtime(_vjpmpi_cpu.runtime_capsule()): every handler of this module
  // then uses that runtime. Refuses (RuntimeError) a module from another build.
  m.def("attach_runtime", [module](nb::handle capsule) {
    if (!PyCapsule_IsValid(capsule.ptr(), kRuntimeCapsule)) {
      throw nb::type_error(
          (std::string("vjpmpi: ") + module + ".attach_runtime expects the capsule of "
           "_vjpmpi_cpu.runtime_capsule()").c_str());
    }
    auto* h = static_cast<const RuntimeHandle*>(
        PyCapsule_GetPointer(capsule.ptr(), kRuntimeCapsule));
    std::string e = AttachRuntime(h, module);
    if (!e.empty()) throw std::runtime_error(e);
  });
}
#endif

}  // namespace
}  // namespace vjpmpi
