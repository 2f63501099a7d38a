// CPU backend: binds XLA FFI buffers (host memory) to the shared MPI layer.
// Every handler takes the ordering token last and returns it last; the token
// carries no data, it only orders the custom calls inside one XLA program.
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <vector>
#include <string>

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
    case ffi::DataType::PRED: return Kind::kBool;
    case ffi::DataType::S8: return Kind::kI8;
    case ffi::DataType::S16: return Kind::kI16;
    case ffi::DataType::S32: return Kind::kI32;
    case ffi::DataType::S64: return Kind::kI64;
    case ffi::DataType::U8: return Kind::kU8;
    case ffi::DataType::U16: return Kind::kU16;
    case ffi::DataType::U32: return Kind::kU32;
    case ffi::DataType::U64: return Kind::kU64;
    case ffi::DataType::F16: return Kind::kF16;
    case ffi::DataType::BF16: return Kind::kBF16;
    case ffi::DataType::F32: return Kind::kF32;
    case ffi::DataType::F64: return Kind::kF64;
    case ffi::DataType::C64: return Kind::kC64;
    case ffi::DataType::C128: return Kind::kC128;
    default: return Kind::kUnsupported;
  }
}

using Impl = std::string (*)(const Call&, const void*, void*);

// How the element count of one MPI block follows from the buffers.
enum class Count { kIn, kOut, kInPerRank };

ffi::Error Unsupported(const char* name) {
  return ffi::Error::InvalidArgument(std::string("vjpmpi.") + name + ": unsupported dtype");
}

Call MakeCall(const char* name, int64_t comm, int64_t red, int64_t root, int64_t peer,
              int64_t peer2, int64_t tag, int64_t tag2, int64_t status) {
  Call c{};
  c.op = name;
  c.comm = FromHandle<MPI_Comm>(comm);
  c.red = static_cast<Red>(red);
  c.root = static_cast<int>(root);
  c.peer = static_cast<int>(peer);
  c.peer2 = static_cast<int>(peer2);
  c.tag = static_cast<int>(tag);
  c.tag2 = static_cast<int>(tag2);
  c.status = reinterpret_cast<MPI_Status*>(static_cast<uintptr_t>(status));
  return c;
}

// Everything a handler does around its MPI call: guard (trace, overlap
// counter, watchdog slot), finalized check, opt-in mismatch check.
template <typename Body>
ffi::Error Run(const Call& c, int64_t site, bool collective, Body body) {
  Guard guard(c.op, site, c.comm);
  std::string e = CheckAlive(c.op);
  if (e.empty() && collective && check_enabled.load(std::memory_order_relaxed)) {
    e = CheckCollective(c, site);
  }
  if (e.empty()) e = body();
  return e.empty() ? ffi::Error::Success() : ffi::Error::Internal(e);
}

// (x, token) -> (y, token): every collective with one array in and one out.
template <Impl F, Count N>
ffi::Error Unary(const char* name, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                 int64_t comm, int64_t red, int64_t root, int64_t peer, int64_t peer2,
                 int64_t tag, int64_t tag2, int64_t status, int64_t site) {
  Call c = MakeCall(name, comm, red, root, peer, peer2, tag, tag2, status);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported) return Unsupported(name);
  if (N == Count::kIn) {
    c.count = x.element_count();
  } else if (N == Count::kOut) {
    c.count = y->element_count();
  } else {
    std::string e = CheckAlive(name);
    if (!e.empty()) return ffi::Error::Internal(e);
    int size = 1;
    MPI_Comm_size(c.comm, &size);
    c.count = x.element_count() / static_cast<size_t>(size);
  }
  c.count2 = c.count;
  return Run(c, site, F != Recv, [&] { return F(c, x.untyped_data(), y->untyped_data()); });
}

#define VJPMPI_ATTRS                                                         \
  .Attr<int64_t>("comm")       /* communicator handle (mpi4py .handle) */   \
      .Attr<int64_t>("red")    /* reduction code, see Red */                \
      .Attr<int64_t>("root")   /* root rank */                              \
      .Attr<int64_t>("peer")   /* destination rank */                       \
      .Attr<int64_t>("peer2")  /* source rank */                            \
      .Attr<int64_t>("tag")    /* send tag */                               \
      .Attr<int64_t>("tag2")   /* receive tag */                            \
      .Attr<int64_t>("status") /* address of an MPI_Status to fill, or 0 */ \
      .Attr<int64_t>("site")   /* call-site id (check/timeout), or 0 */

#define VJPMPI_UNARY(Symbol, name, F, N)                                              \
  ffi::Error Symbol##Impl(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y, \
                          ffi::Result<ffi::Token>, int64_t comm, int64_t red,           \
                          int64_t root, int64_t peer, int64_t peer2, int64_t tag,       \
                          int64_t tag2, int64_t status, int64_t site) {                 \
    return Unary<F, N>(name, x, y, comm, red, root, peer, peer2, tag, tag2, status, site); \
  }                                                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Symbol, Symbol##Impl,                                   \
                                ffi::Ffi::Bind()                                        \
                                    .Arg<ffi::AnyBuffer>() /* x */                      \
                                    .Arg<ffi::Token>()     /* ordering token */         \
                                    .Ret<ffi::AnyBuffer>() /* y */                      \
                                    .Ret<ffi::Token>()     /* ordering token */         \
                                        VJPMPI_ATTRS);

VJPMPI_UNARY(kAllreduce, "allreduce", Allreduce, Count::kIn)
VJPMPI_UNARY(kReduce, "reduce", Reduce, Count::kIn)
VJPMPI_UNARY(kBcast, "bcast", Bcast, Count::kIn)
VJPMPI_UNARY(kAllgather, "allgather", Allgather, Count::kIn)
VJPMPI_UNARY(kGather, "gather", Gather, Count::kIn)
VJPMPI_UNARY(kScatter, "scatter", Scatter, Count::kOut)
VJPMPI_UNARY(kAlltoall, "alltoall", Alltoall, Count::kInPerRank)
VJPMPI_UNARY(kReduceScatter, "reduce_scatter", ReduceScatter, Count::kOut)
VJPMPI_UNARY(kScan, "scan", Scan, Count::kIn)
VJPMPI_UNARY(kExscan, "exscan", Exscan, Count::kIn)
VJPMPI_UNARY(kRecv, "recv", Recv, Count::kOut)

// (x, token) -> token
ffi::Error SendImpl(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::Token>, int64_t comm,
                    int64_t red, int64_t root, int64_t peer, int64_t peer2, int64_t tag,
                    int64_t tag2, int64_t status, int64_t site) {
  Call c = MakeCall("send", comm, red, root, peer, peer2, tag, tag2, status);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported) return Unsupported("send");
  c.count = c.count2 = x.element_count();
  return Run(c, site, false, [&] { return Send(c, x.untyped_data(), nullptr); });
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSend, SendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::Token>()      // ordering token
                                  .Ret<ffi::Token>()      // ordering token
                                      VJPMPI_ATTRS);

// (x, recv template, token) -> (y, token); y aliases the template.
ffi::Error SendrecvImpl(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Token,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, int64_t comm,
                        int64_t red, int64_t root, int64_t peer, int64_t peer2, int64_t tag,
                        int64_t tag2, int64_t status, int64_t site) {
  Call c = MakeCall("sendrecv", comm, red, root, peer, peer2, tag, tag2, status);
  c.kind = KindOf(x.element_type());
  if (c.kind == Kind::kUnsupported || KindOf(y->element_type()) != c.kind) {
    return Unsupported("sendrecv");
  }
  c.count = x.element_count();
  c.count2 = y->element_count();
  return Run(c, site, false, [&] { return Sendrecv(c, x.untyped_data(), y->untyped_data()); });
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSendrecv, SendrecvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x, sent to peer
                                  .Arg<ffi::AnyBuffer>()  // receive template
                                  .Arg<ffi::Token>()      // ordering token
                                  .Ret<ffi::AnyBuffer>()  // y, received from peer2
                                  .Ret<ffi::Token>()      // ordering token
                                      VJPMPI_ATTRS);

// token -> token
ffi::Error BarrierImpl(ffi::Token, ffi::Result<ffi::Token>, int64_t comm, int64_t red,
                       int64_t root, int64_t peer, int64_t peer2, int64_t tag, int64_t tag2,
                       int64_t status, int64_t site) {
  Call c = MakeCall("barrier", comm, red, root, peer, peer2, tag, tag2, status);
  c.kind = Kind::kU8;
  return Run(c, site, true, [&] { return Barrier(c, nullptr, nullptr); });
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrier, BarrierImpl,
                              ffi::Ffi::Bind()
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

}  // namespace
}  // namespace vjpmpi

NB_MODULE(_vjpmpi_cpu, m) {
  using namespace vjpmpi;
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
    return d;
  });
  // The MPI library these kernels resolved at load time (checked at import
  // against the one mpi4py loaded).
  m.def("library_version", &LibraryVersion);
  // configure(check, timeout_seconds): the opt-in mismatch check and watchdog.
  m.def("configure", &Configure);
  m.def("register_site", &RegisterSite);
  m.def("trace_enabled", []() { return tracing; });
  // Returns and clears the recorded sequence of collectives.
  m.def("take_trace", []() {
    std::lock_guard<std::mutex> lock(trace_mutex);
    std::vector<std::string> out;
    out.swap(trace_log);
    return out;
  });
  // (kernel calls, calls that overlapped another running vjpmpi kernel)
  m.def("call_counts", []() {
    return nb::make_tuple(calls.load(), overlaps.load());
  });
#if defined(OPEN_MPI) && OPEN_MPI
  m.attr("abi") = nb::str("openmpi");
#elif defined(MPICH_VERSION)
  m.attr("abi") = nb::str("mpich");
#else
  m.attr("abi") = nb::str("unknown");
#endif
  m.attr("mpi_version") = nb::str((std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION)).c_str());
  m.attr("status_size") = nb::int_(static_cast<int64_t>(sizeof(MPI_Status)));
}
