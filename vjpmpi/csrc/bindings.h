// The XLA FFI bindings of every handler, for a backend B (a struct; cpu_module.cc,
// cuda_module.cc):
//   static constexpr bool kAsync   handlers return a future; a large call runs on its
//                                  communicator's thread; the ragged exchange and the
//                                  started calls exist (host memory: the CPU)
//   using Ctx                      the FFI context each handler binds first (the CUDA
//                                  stream; NoContext: none)
//   using Mem; static Mem MakeMem(CtxOf<B>)   the memory policy of one call (handlers.h)
// registrations.h's Registrations<B>() lists the handlers a backend module exports.
// Every handler binds B::Ctx, then XLA's run id, its arrays, the ordering token (last
// in, last out: it carries no data, it only orders the custom calls inside one XLA
// program), then the attributes.
//
// Adding a collective: its MPI call in mpi_ops.cc (declared in mpi_ops.h); an op with
// one array in and one out is then one UnaryOp line below and one line in
// Registrations; another shape needs its handler body in handler_ops.h, an Impl and a
// binding here.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "handler_ops.h"

namespace vjpmpi {
// A backend without a context of its own (the CPU) binds this: nothing to decode.
struct NoContext {};
}  // namespace vjpmpi

template <>
struct xla::ffi::CtxDecoding<vjpmpi::NoContext> {
  using Type = vjpmpi::NoContext;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*,
                                    DiagnosticEngine&) {
    return Type{};
  }
};

namespace vjpmpi {

template <typename B>
using CtxOf = typename ffi::CtxDecoding<typename B::Ctx>::Type;
template <typename B>
using Res = Result<B::kAsync>;

// The backend's context, then the execution's run id.
template <typename B>
auto Bind() {
  return ffi::Ffi::Bind().template Ctx<typename B::Ctx>().template Ctx<ffi::RunId>();
}

// The attributes every handler takes, packed in one int64 array attribute `call` (XLA
// checks one attribute's name and type per call instead of twelve), in the order of
// Python's CALL_ATTRS (vjpmpi/_lowering.py):
//   comm     vjpmpi's number of the communicator
//   red      reduction code, see Red
//   root     root rank
//   peer     destination rank
//   peer2    source rank
//   tag      send tag
//   tag2     receive tag
//   status   status slot to fill (a live MPI.Status), or 0
//   reverse  scans: 1 = from the last rank down
//   site     call-site hash (check/timeout), or 0
//   sig      the program's signature on the communicator
//   invalid  hash of an argument error found at trace time
// A `call` of another length (a program lowered by another vjpmpi) gets comm -1, which
// Run refuses with a message.
inline constexpr size_t kCallAttrs = 12;
inline Attrs AttrsOf(ffi::Span<const int64_t> v, int64_t run) {
  if (v.size() != kCallAttrs) {
    Attrs a{};
    a.comm = -1;
    a.run = run;
    return a;
  }
  return Attrs{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], run};
}
inline int64_t CommOf(ffi::Span<const int64_t> v) { return v.size() == kCallAttrs ? v[0] : -1; }

#define VJPMPI_ATTR_PARAMS ffi::Span<const int64_t> call
#define VJPMPI_ATTRS_OF AttrsOf(call, run.run_id)

template <typename Binding>
auto WithAttrs(Binding b) {
  return std::move(b).template Attr<ffi::Span<const int64_t>>("call");
}

// XLA's entry point for handler `Impl` with the binding `MakeBinding()` makes (what
// XLA_FFI_DEFINE_HANDLER_SYMBOL defines, as a template).
template <auto Impl, auto MakeBinding>
XLA_FFI_Error* Entry(XLA_FFI_CallFrame* frame) {
  static auto* handler = MakeBinding().To(Impl).release();
  return handler->Call(frame);
}

// ------------------------------------------------ one array in, one out --
struct UnaryOp {
  const char* name;
  Impl fn;          // the MPI call (mpi_ops.h)
  GroupImpl group;  // a group's process part, where its ranks are devices (devices.h)
  Count count;      // how its element count follows from the buffers
  int uses;         // EntryFlags: kUsesRed, kUsesRoot, kWaitsForAll
};
constexpr int kRed = kUsesRed, kRoot = kUsesRoot, kAll = kWaitsForAll;
inline constexpr UnaryOp kAllreduceOp{"allreduce", &Allreduce, &DevAllreduce, Count::kIn, kRed | kAll};
inline constexpr UnaryOp kReduceOp{"reduce", &Reduce, &DevReduce, Count::kIn, kRed | kRoot};
inline constexpr UnaryOp kBcastOp{"bcast", &Bcast, &DevBcast, Count::kIn, kRoot};
inline constexpr UnaryOp kAllgatherOp{"allgather", &Allgather, &DevAllgather, Count::kIn, kAll};
inline constexpr UnaryOp kGatherOp{"gather", &Gather, &DevGather, Count::kIn, kRoot};
inline constexpr UnaryOp kScatterOp{"scatter", &Scatter, &DevScatter, Count::kOut, kRoot};
inline constexpr UnaryOp kAlltoallOp{"alltoall", &Alltoall, &DevAlltoall, Count::kInPerRank, kAll};
inline constexpr UnaryOp kReduceScatterOp{"reduce_scatter", &ReduceScatter, &DevReduceScatter,
                                          Count::kOut, kRed | kAll};
inline constexpr UnaryOp kScanOp{"scan", &Scan, &DevScan, Count::kIn, kRed};
inline constexpr UnaryOp kExscanOp{"exscan", &Exscan, &DevExscan, Count::kIn, kRed};
inline constexpr UnaryOp kOthersProductOp{"others_product", &OthersProduct, &DevOthersProduct,
                                          Count::kIn, kAll};
inline constexpr UnaryOp kAgreeOp{"agree", &AgreeOnly, &DevAgreeOnly, Count::kIn, 0};

// (x, token) -> (y, token)
template <typename B, const UnaryOp& Op>
Res<B> UnaryImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer x, ffi::Token,
                 ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS) {
  return Unary<B::kAsync, Op.fn, Op.count, Op.uses>(B::MakeMem(ctx), Op.name, x, y,
                                                    VJPMPI_ATTRS_OF);
}
template <typename B>
auto UnaryBinding() {
  return WithAttrs(Bind<B>()
                       .template Arg<ffi::AnyBuffer>()   // x
                       .template Arg<ffi::Token>()       // ordering token
                       .template Ret<ffi::AnyBuffer>()   // y
                       .template Ret<ffi::Token>());     // ordering token
}

// ------------------------------------------------------- point to point --
// send: (x, token) -> token
template <typename B>
Res<B> SendImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer x, ffi::Token,
                ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS) {
  return SendH<B::kAsync>(B::MakeMem(ctx), x, VJPMPI_ATTRS_OF);
}
template <typename B>
auto ArgBinding() {  // (x, token) -> token
  return WithAttrs(Bind<B>().template Arg<ffi::AnyBuffer>().template Arg<ffi::Token>()
                       .template Ret<ffi::Token>());
}

// recv: (template, token) -> (y, token); y may alias the template
template <typename B>
Res<B> RecvImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer x, ffi::Token,
                ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS) {
  return RecvH<B::kAsync>(B::MakeMem(ctx), x, y->untyped_data(), VJPMPI_ATTRS_OF);
}

// Two arrays in, one out (which may alias the second): (a, b, token) -> (y, token).
// sendrecv: a is sent to peer; y, received from peer2, aliases b (the receive template)
template <typename B>
Res<B> SendrecvImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer a, ffi::AnyBuffer b,
                    ffi::Token, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                    VJPMPI_ATTR_PARAMS) {
  return SendrecvH<B::kAsync>(B::MakeMem(ctx), a, b, y->untyped_data(), VJPMPI_ATTRS_OF);
}
// recurrence: a, the coefficients, and b, the inputs; y may alias b
template <typename B>
Res<B> RecurrenceImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer a, ffi::AnyBuffer b,
                      ffi::Token, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                      VJPMPI_ATTR_PARAMS) {
  return RecurrenceH<B::kAsync>(B::MakeMem(ctx), a, b, y, VJPMPI_ATTRS_OF);
}
template <typename B>
auto BinaryBinding() {
  return WithAttrs(Bind<B>()
                       .template Arg<ffi::AnyBuffer>()   // a
                       .template Arg<ffi::AnyBuffer>()   // b
                       .template Arg<ffi::Token>()       // ordering token
                       .template Ret<ffi::AnyBuffer>()   // y
                       .template Ret<ffi::Token>());     // ordering token
}

// barrier: token -> token
template <typename B>
Res<B> BarrierImpl(CtxOf<B> ctx, ffi::RunId run, ffi::Token, ffi::Result<ffi::Token>,
                   VJPMPI_ATTR_PARAMS) {
  return BarrierH<B::kAsync>(B::MakeMem(ctx), VJPMPI_ATTRS_OF);
}
template <typename B>
auto TokenBinding() {
  return WithAttrs(Bind<B>().template Arg<ffi::Token>().template Ret<ffi::Token>());
}

// hold: (x, token) -> (y, token), y = x in x's buffer (aliased; a copy only where XLA
// gave y a buffer of its own). No MPI, no trace, never asynchronous: a point of the
// program's order that XLA's fusion cannot cross (vjpmpi.nn's pipeline holds values there).
template <typename B>
Res<B> HoldImpl(CtxOf<B> ctx, ffi::RunId, ffi::AnyBuffer x, ffi::Token,
                ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS) {
  void* out = y->untyped_data();
  const void* in = x.untyped_data();
  return Finish<B::kAsync>(out == in ? std::string()
                                     : B::MakeMem(ctx).Copy(out, in, x.size_bytes()));
}

// ----------------------------------------- host memory only (B::kAsync) --
// The ragged exchange (handler_ops.h): (a0, a1, input_offsets, send_sizes,
// output_offsets, recv_sizes, token) -> (r0, r1, token).
template <typename B>
Res<B> RaggedImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer a0, ffi::AnyBuffer a1,
                  ffi::AnyBuffer io, ffi::AnyBuffer ss, ffi::AnyBuffer oo, ffi::AnyBuffer rs,
                  ffi::Token, ffi::Result<ffi::AnyBuffer> r0, ffi::Result<ffi::AnyBuffer> r1,
                  ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS, int64_t form, int64_t groups) {
  return RaggedH<B::kAsync>(B::MakeMem(ctx), a0, a1, io, ss, oo, rs, r0, r1, VJPMPI_ATTRS_OF,
                            form, groups);
}
template <typename B>
auto RaggedBinding() {
  return WithAttrs(Bind<B>()
                       .template Arg<ffi::AnyBuffer>()   // a0
                       .template Arg<ffi::AnyBuffer>()   // a1
                       .template Arg<ffi::AnyBuffer>()   // input_offsets
                       .template Arg<ffi::AnyBuffer>()   // send_sizes
                       .template Arg<ffi::AnyBuffer>()   // output_offsets
                       .template Arg<ffi::AnyBuffer>()   // recv_sizes
                       .template Arg<ffi::Token>()       // ordering token
                       .template Ret<ffi::AnyBuffer>()   // r0
                       .template Ret<ffi::AnyBuffer>()   // r1
                       .template Ret<ffi::Token>())      // ordering token
      .template Attr<int64_t>("form")     // which public op (RaggedForm)
      .template Attr<int64_t>("groups");  // the packed forms' segments
}

// vjpmpi.start of a point-to-point call: (its arrays, token) -> ([r,] token), r the
// buffer the array received lands in (a direct call's; the wait's result aliases it).
// `slot` names the call for its wait; `own`: the call between buffers of its own, copied
// from and into XLA's (Started).
inline std::shared_ptr<Started> StartedFor(ffi::Span<const int64_t> call, int64_t slot,
                                           ffi::RunId run, int64_t own) {
  auto s = NewStarted(CommOf(call), slot, StartedRun(slot, run.run_id));
  s->direct = own == 0 && slot >= 0;  // (an eager start's buffers are its program's)
  return s;
}
template <typename B>
Res<B> SendStartImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer x, ffi::Token,
                     ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS, int64_t slot, int64_t own) {
  return SendH<B::kAsync>(B::MakeMem(ctx), x, VJPMPI_ATTRS_OF, StartedFor(call, slot, run, own));
}
template <typename B>
auto SendStartBinding() {  // (x, token) -> token
  return ArgBinding<B>().template Attr<int64_t>("slot").template Attr<int64_t>("own");
}
template <typename B>
Res<B> RecvStartImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer tmpl, ffi::Token,
                     ffi::Result<ffi::AnyBuffer> r, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS,
                     int64_t slot, int64_t own) {
  return RecvH<B::kAsync>(B::MakeMem(ctx), tmpl, r->untyped_data(), VJPMPI_ATTRS_OF,
                          StartedFor(call, slot, run, own));
}
template <typename B>
auto RecvStartBinding() {  // (template, token) -> (r, token)
  return UnaryBinding<B>().template Attr<int64_t>("slot").template Attr<int64_t>("own");
}
template <typename B>
Res<B> SendrecvStartImpl(CtxOf<B> ctx, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer tmpl,
                         ffi::Token, ffi::Result<ffi::AnyBuffer> r, ffi::Result<ffi::Token>,
                         VJPMPI_ATTR_PARAMS, int64_t slot, int64_t own) {
  return SendrecvH<B::kAsync>(B::MakeMem(ctx), x, tmpl, r->untyped_data(), VJPMPI_ATTRS_OF,
                              StartedFor(call, slot, run, own));
}
template <typename B>
auto SendrecvStartBinding() {  // (x, template, token) -> (r, token)
  return BinaryBinding<B>().template Attr<int64_t>("slot").template Attr<int64_t>("own");
}

// vjpmpi.wait: (the arrays the call uses, token) -> ([y,] token): the arrays are the
// array sent (kept by XLA until here) and the start's r (y aliases it); no backend
// context (host memory).
inline ffi::Future WaitImpl(ffi::RunId run, ffi::AnyBuffer, ffi::Token,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                            int64_t comm, int64_t slot) {
  return WaitFor(comm, slot, StartedRun(slot, run.run_id), y->untyped_data(), y->size_bytes());
}
inline auto WaitBinding() {  // recv: (r, token) -> (y, token); a send: (x, token) -> token
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Arg<ffi::AnyBuffer>()  // r
      .Arg<ffi::Token>()      // ordering token
      .Ret<ffi::AnyBuffer>()  // y
      .Ret<ffi::Token>()      // ordering token
      .Attr<int64_t>("comm")  // vjpmpi's number of the communicator
      .Attr<int64_t>("slot");  // the started call
}
inline ffi::Future WaitSendrecvImpl(ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Token,
                                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                                    int64_t comm, int64_t slot) {
  return WaitFor(comm, slot, StartedRun(slot, run.run_id), y->untyped_data(), y->size_bytes());
}
inline auto WaitSendrecvBinding() {  // (x, r, token) -> (y, token)
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Arg<ffi::AnyBuffer>()  // x
      .Arg<ffi::AnyBuffer>()  // r
      .Arg<ffi::Token>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::Token>()
      .Attr<int64_t>("comm")
      .Attr<int64_t>("slot");
}
inline ffi::Future WaitSendImpl(ffi::RunId run, ffi::AnyBuffer, ffi::Token,
                                ffi::Result<ffi::Token>, int64_t comm, int64_t slot) {
  return WaitFor(comm, slot, StartedRun(slot, run.run_id), nullptr, 0);
}
inline auto WaitSendBinding() {  // (x, token) -> token
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Token>()
      .Ret<ffi::Token>()
      .Attr<int64_t>("comm")
      .Attr<int64_t>("slot");
}

}  // namespace vjpmpi
