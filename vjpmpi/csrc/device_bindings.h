// The XLA FFI bindings of device calls (device_ops.h, device_p2p.h: a program compiled
// for several devices of this process), for a backend B: each one-device binding
// (bindings.h) with `where` (int32[4]: the device's partition, then the call's root,
// destination and source) first and the `dev` attribute (int64[7]) among the attributes,
// in the order of their names.
#pragma once

#include <utility>

#include "bindings.h"
#include "device_p2p.h"

namespace vjpmpi {

#define VJPMPI_DEV_PARAMS ffi::Span<const int64_t> dev
template <typename Binding>
auto WithDev(Binding b) {
  return std::move(b).template Attr<ffi::Span<const int64_t>>("dev");
}
template <typename B>
auto BindDev() {
  return Bind<B>().template Arg<ffi::Buffer<ffi::S32>>();  // where
}

template <typename B, const UnaryOp& Op>
Res<B> DevUnaryImpl(CtxOf<B> ctx, ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer x,
                    ffi::Token, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                    VJPMPI_ATTR_PARAMS, VJPMPI_DEV_PARAMS) {
  return DevUnary<B::kAsync, Op.fn, Op.group, Op.count, Op.uses>(B::MakeDevMem(ctx), Op.name, where,
                                                                 x, y, VJPMPI_ATTRS_OF, dev);
}
template <typename B>
auto DevUnaryBinding() {  // (where, x, token) -> (y, token)
  return WithDev(WithAttrs(BindDev<B>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::Token>()
                               .template Ret<ffi::AnyBuffer>()
                               .template Ret<ffi::Token>()));
}
template <typename B>
Res<B> DevSendImpl(CtxOf<B> ctx, ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer x,
                   ffi::Token, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS, VJPMPI_DEV_PARAMS) {
  return DevP2PH<B::kAsync>(B::MakeDevMem(ctx), "send", where, &x, nullptr, nullptr,
                            VJPMPI_ATTRS_OF, dev);
}
template <typename B>
auto DevArgBinding() {  // (where, x, token) -> token
  return WithDev(WithAttrs(BindDev<B>().template Arg<ffi::AnyBuffer>().template Arg<ffi::Token>()
                               .template Ret<ffi::Token>()));
}
template <typename B>
Res<B> DevRecvImpl(CtxOf<B> ctx, ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer t,
                   ffi::Token, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                   VJPMPI_ATTR_PARAMS, VJPMPI_DEV_PARAMS) {
  return DevP2PH<B::kAsync>(B::MakeDevMem(ctx), "recv", where, nullptr, &t, y->untyped_data(),
                            VJPMPI_ATTRS_OF, dev);
}
template <typename B>
Res<B> DevSendrecvImpl(CtxOf<B> ctx, ffi::RunId run, ffi::Buffer<ffi::S32> where,
                       ffi::AnyBuffer x, ffi::AnyBuffer t, ffi::Token,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS,
                       VJPMPI_DEV_PARAMS) {
  return DevP2PH<B::kAsync>(B::MakeDevMem(ctx), "sendrecv", where, &x, &t, y->untyped_data(),
                            VJPMPI_ATTRS_OF, dev);
}
template <typename B>
Res<B> DevRecurrenceImpl(CtxOf<B> ctx, ffi::RunId run, ffi::Buffer<ffi::S32> where,
                         ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Token,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                         VJPMPI_ATTR_PARAMS, VJPMPI_DEV_PARAMS) {
  return DevRecurrenceH<B::kAsync>(B::MakeDevMem(ctx), where, a, b, y, VJPMPI_ATTRS_OF, dev);
}
template <typename B>
auto DevBinaryBinding() {  // (where, a, b, token) -> (y, token)
  return WithDev(WithAttrs(BindDev<B>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::Token>()
                               .template Ret<ffi::AnyBuffer>()
                               .template Ret<ffi::Token>()));
}
template <typename B>
Res<B> DevBarrierImpl(CtxOf<B> ctx, ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::Token,
                      ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS, VJPMPI_DEV_PARAMS) {
  return DevBarrierH<B::kAsync>(B::MakeDevMem(ctx), where, VJPMPI_ATTRS_OF, dev);
}
template <typename B>
Res<B> DevRaggedImpl(CtxOf<B> ctx, ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer a0,
                     ffi::AnyBuffer a1, ffi::AnyBuffer io, ffi::AnyBuffer ss, ffi::AnyBuffer oo,
                     ffi::AnyBuffer rs, ffi::Token, ffi::Result<ffi::AnyBuffer> r0,
                     ffi::Result<ffi::AnyBuffer> r1, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS,
                     VJPMPI_DEV_PARAMS, int64_t form, int64_t groups) {
  return DevRaggedH<B::kAsync>(B::MakeDevMem(ctx), where, a0, a1, io, ss, oo, rs, r0, r1,
                               VJPMPI_ATTRS_OF, form, groups, dev);
}
template <typename B>
auto DevRaggedBinding() {  // (where, the ragged exchange's operands, token) -> (r0, r1, token)
  // (attributes in the order of their names, as XLA hands them over)
  return WithDev(WithAttrs(BindDev<B>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::Token>()
                               .template Ret<ffi::AnyBuffer>()
                               .template Ret<ffi::AnyBuffer>()
                               .template Ret<ffi::Token>()))
      .template Attr<int64_t>("form")
      .template Attr<int64_t>("groups");
}
template <typename B>
auto DevTokenBinding() {  // (where, token) -> token
  return WithDev(WithAttrs(BindDev<B>().template Arg<ffi::Token>().template Ret<ffi::Token>()));
}

// vjpmpi.start of a device call (host memory): (where, its arrays, token) -> token, and
// its wait: (where, token) -> ([y,] token).
template <typename B>
Res<B> DevSendStartImpl(CtxOf<B>, ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer x,
                        ffi::Token, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS,
                        VJPMPI_DEV_PARAMS, int64_t slot) {
  return DevStartH("send", where, &x, nullptr, VJPMPI_ATTRS_OF, dev, slot);
}
template <typename B>
Res<B> DevRecvStartImpl(CtxOf<B>, ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::AnyBuffer t,
                        ffi::Token, ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS,
                        VJPMPI_DEV_PARAMS, int64_t slot) {
  return DevStartH("recv", where, nullptr, &t, VJPMPI_ATTRS_OF, dev, slot);
}
template <typename B>
auto DevStartBinding() {  // (where, x, token) -> token
  return WithDev(WithAttrs(BindDev<B>().template Arg<ffi::AnyBuffer>().template Arg<ffi::Token>()
                               .template Ret<ffi::Token>()))
      .template Attr<int64_t>("slot");
}
template <typename B>
Res<B> DevSendrecvStartImpl(CtxOf<B>, ffi::RunId run, ffi::Buffer<ffi::S32> where,
                            ffi::AnyBuffer x, ffi::AnyBuffer t, ffi::Token,
                            ffi::Result<ffi::Token>, VJPMPI_ATTR_PARAMS, VJPMPI_DEV_PARAMS,
                            int64_t slot) {
  return DevStartH("sendrecv", where, &x, &t, VJPMPI_ATTRS_OF, dev, slot);
}
template <typename B>
auto DevSendrecvStartBinding() {  // (where, x, template, token) -> token
  return WithDev(WithAttrs(BindDev<B>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::AnyBuffer>()
                               .template Arg<ffi::Token>()
                               .template Ret<ffi::Token>()))
      .template Attr<int64_t>("slot");
}
inline Outcome DevWaitImpl(ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::Token,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, int64_t comm,
                           VJPMPI_DEV_PARAMS, int64_t slot) {
  return DevWaitH(where, y->untyped_data(), y->size_bytes(), comm, slot, run.run_id, dev);
}
inline auto DevWaitBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Arg<ffi::Buffer<ffi::S32>>()  // where
      .Arg<ffi::Token>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::Token>()
      .Attr<int64_t>("comm")  // vjpmpi's number of the process communicator
      .Attr<ffi::Span<const int64_t>>("dev")
      .Attr<int64_t>("slot");
}
inline Outcome DevWaitSendImpl(ffi::RunId run, ffi::Buffer<ffi::S32> where, ffi::Token,
                               ffi::Result<ffi::Token>, int64_t comm, VJPMPI_DEV_PARAMS,
                               int64_t slot) {
  return DevWaitH(where, nullptr, 0, comm, slot, run.run_id, dev);
}
inline auto DevWaitSendBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Token>()
      .Ret<ffi::Token>()
      .Attr<int64_t>("comm")
      .Attr<ffi::Span<const int64_t>>("dev")
      .Attr<int64_t>("slot");
}

}  // namespace vjpmpi
