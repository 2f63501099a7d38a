// The table of every handler a backend module exports (registrations()): the one-device
// handlers (bindings.h) and the device calls (device_bindings.h); those on host memory only
// (the ragged exchange, started calls) where B is the CPU backend (kAsync).
#pragma once

#include <utility>
#include <vector>

#include "bindings.h"
#include "device_bindings.h"

namespace vjpmpi {

// ------------------------------------------------------------ the table --
// (name, XLA_FFI_Handler*): what the module's registrations() returns, in this order.
using Registration = std::pair<const char*, void*>;

template <typename B>
std::vector<Registration> Registrations() {
  std::vector<Registration> r;
  auto add = [&r](const char* name, XLA_FFI_Handler* fn) {
    r.emplace_back(name, reinterpret_cast<void*>(fn));
  };
  add("allreduce", &Entry<&UnaryImpl<B, kAllreduceOp>, &UnaryBinding<B>>);
  add("reduce", &Entry<&UnaryImpl<B, kReduceOp>, &UnaryBinding<B>>);
  add("bcast", &Entry<&UnaryImpl<B, kBcastOp>, &UnaryBinding<B>>);
  add("allgather", &Entry<&UnaryImpl<B, kAllgatherOp>, &UnaryBinding<B>>);
  add("gather", &Entry<&UnaryImpl<B, kGatherOp>, &UnaryBinding<B>>);
  add("scatter", &Entry<&UnaryImpl<B, kScatterOp>, &UnaryBinding<B>>);
  add("alltoall", &Entry<&UnaryImpl<B, kAlltoallOp>, &UnaryBinding<B>>);
  add("reduce_scatter", &Entry<&UnaryImpl<B, kReduceScatterOp>, &UnaryBinding<B>>);
  add("scan", &Entry<&UnaryImpl<B, kScanOp>, &UnaryBinding<B>>);
  add("exscan", &Entry<&UnaryImpl<B, kExscanOp>, &UnaryBinding<B>>);
  add("send", &Entry<&SendImpl<B>, &ArgBinding<B>>);
  add("recv", &Entry<&RecvImpl<B>, &UnaryBinding<B>>);
  add("sendrecv", &Entry<&SendrecvImpl<B>, &BinaryBinding<B>>);
  add("barrier", &Entry<&BarrierImpl<B>, &TokenBinding<B>>);
  add("agree", &Entry<&UnaryImpl<B, kAgreeOp>, &UnaryBinding<B>>);
  add("recurrence", &Entry<&RecurrenceImpl<B>, &BinaryBinding<B>>);
  add("others_product", &Entry<&UnaryImpl<B, kOthersProductOp>, &UnaryBinding<B>>);
  add("hold", &Entry<&HoldImpl<B>, &UnaryBinding<B>>);
  // device calls (device_ops.h, device_p2p.h: a program on several devices of a process)
  add("allreduce_dev", &Entry<&DevUnaryImpl<B, kAllreduceOp>, &DevUnaryBinding<B>>);
  add("reduce_dev", &Entry<&DevUnaryImpl<B, kReduceOp>, &DevUnaryBinding<B>>);
  add("bcast_dev", &Entry<&DevUnaryImpl<B, kBcastOp>, &DevUnaryBinding<B>>);
  add("allgather_dev", &Entry<&DevUnaryImpl<B, kAllgatherOp>, &DevUnaryBinding<B>>);
  add("gather_dev", &Entry<&DevUnaryImpl<B, kGatherOp>, &DevUnaryBinding<B>>);
  add("scatter_dev", &Entry<&DevUnaryImpl<B, kScatterOp>, &DevUnaryBinding<B>>);
  add("alltoall_dev", &Entry<&DevUnaryImpl<B, kAlltoallOp>, &DevUnaryBinding<B>>);
  add("reduce_scatter_dev", &Entry<&DevUnaryImpl<B, kReduceScatterOp>, &DevUnaryBinding<B>>);
  add("scan_dev", &Entry<&DevUnaryImpl<B, kScanOp>, &DevUnaryBinding<B>>);
  add("exscan_dev", &Entry<&DevUnaryImpl<B, kExscanOp>, &DevUnaryBinding<B>>);
  add("agree_dev", &Entry<&DevUnaryImpl<B, kAgreeOp>, &DevUnaryBinding<B>>);
  add("others_product_dev", &Entry<&DevUnaryImpl<B, kOthersProductOp>, &DevUnaryBinding<B>>);
  add("send_dev", &Entry<&DevSendImpl<B>, &DevArgBinding<B>>);
  add("recv_dev", &Entry<&DevRecvImpl<B>, &DevUnaryBinding<B>>);
  add("sendrecv_dev", &Entry<&DevSendrecvImpl<B>, &DevBinaryBinding<B>>);
  add("recurrence_dev", &Entry<&DevRecurrenceImpl<B>, &DevBinaryBinding<B>>);
  add("barrier_dev", &Entry<&DevBarrierImpl<B>, &DevTokenBinding<B>>);
  if constexpr (B::kAsync) {
    add("ragged_alltoall_dev", &Entry<&DevRaggedImpl<B>, &DevRaggedBinding<B>>);
    add("ragged_alltoall", &Entry<&RaggedImpl<B>, &RaggedBinding<B>>);
    add("send_start", &Entry<&SendStartImpl<B>, &SendStartBinding<B>>);
    add("recv_start", &Entry<&RecvStartImpl<B>, &RecvStartBinding<B>>);
    add("sendrecv_start", &Entry<&SendrecvStartImpl<B>, &SendrecvStartBinding<B>>);
    add("wait", &Entry<&WaitImpl, &WaitBinding>);
    add("wait_sendrecv", &Entry<&WaitSendrecvImpl, &WaitSendrecvBinding>);
    add("send_start_dev", &Entry<&DevSendStartImpl<B>, &DevStartBinding<B>>);
    add("recv_start_dev", &Entry<&DevRecvStartImpl<B>, &DevStartBinding<B>>);
    add("sendrecv_start_dev", &Entry<&DevSendrecvStartImpl<B>, &DevSendrecvStartBinding<B>>);
    add("wait_dev", &Entry<&DevWaitImpl, &DevWaitBinding>);
    add("wait_send_dev", &Entry<&DevWaitSendImpl, &DevWaitSendBinding>);
    add("wait_send", &Entry<&WaitSendImpl, &WaitSendBinding>);
  }
  return r;
}

}  // namespace vjpmpi
