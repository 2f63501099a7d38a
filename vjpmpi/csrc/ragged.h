// The ragged exchange (vjpmpi.ragged_alltoall and the v-collectives built on it), on
// plain host pointers: every rank's offsets and sizes gathered to every rank (one
// MPI_Allgather), checked there alike (so a bad count is the same error on every rank),
// then one message per non-empty slice (MPI_Isend / MPI_Irecv on a duplicate of the
// communicator, rows as bytes).
//
// Forward: rank j sends rows [in_off, in_off + size) of its operand, for each slice i
// (to rank i / per), into the receiver's output at the slice's output offset: the one
// the sender names (form kRagged, jax.lax.ragged_all_to_all), or the next free row of
// its group's segment, in source-rank order (the packed forms, the v-collectives).
// Reverse (the transpose): each slice travels back, from the output-shaped cotangent
// into the operand-shaped accumulator (added: slices of the operand may overlap), and
// the cotangent's received rows are zeroed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <mpi.h>

#include "mpi_ops.h"

namespace vjpmpi {

// Which public op a ragged call is (the `form` attribute): the names its errors use.
enum RaggedForm : int { kRagged = 0, kAlltoallv = 1, kAllgatherv = 2, kGatherv = 3, kScatterv = 4 };
const char* RaggedName(int form);

// How a ragged call reaches the other ranks of its group: ProcessPeers (one process per
// rank: MPI on the communicator), or devices (device_ops.h: letters between devices of
// this process, MPI between processes). Sends and receives are posted in order and end in
// Finish; a receive from this process may wait there (after every send is posted).
struct RaggedPeers {
  int size = 1, rank = 0;
  size_t room = 0;  // bytes of rows a part may carry inline (InlineBytes; 0: none)
  virtual ~RaggedPeers() = default;
  // Every rank's part (`stride` int64 each) into `all`, in rank order.
  virtual std::string Gather(const int64_t* part, size_t stride, int64_t* all) = 0;
  // `tag`: the slice (the sender's index), which tells two messages of one pair apart.
  virtual std::string Send(const void* buf, size_t bytes, int peer, int tag) = 0;
  virtual std::string Recv(void* buf, size_t bytes, int peer, int tag) = 0;
  virtual std::string Finish() = 0;
};

// The ranks of `c.comm`, one per process.
struct ProcessPeers : RaggedPeers {
  const Call& c;
  MPI_Comm dup = MPI_COMM_NULL;  // its messages apart from the program's own
  std::vector<MPI_Request> reqs;
  explicit ProcessPeers(const Call& call);
  std::string Gather(const int64_t* part, size_t stride, int64_t* all) override;
  std::string Send(const void* buf, size_t bytes, int peer, int tag) override;
  std::string Recv(void* buf, size_t bytes, int peer, int tag) override;
  std::string Finish() override;
};

// One ragged call. `in`: the operand (forward) or the output-shaped cotangent (reverse);
// `out`: the output (forward, holding the template's rows already) or the accumulator
// (reverse, holding its initial value); `masked`: (reverse) the cotangent with its
// received rows zeroed, holding the cotangent already (it may be `in`); `received`
// (forward): the rows received per slice, int32 in receiver order (source j's slice s
// at j * per + s). `mine`: this rank's part, 2 + 4n values as RaggedPlan holds them.
std::string Ragged(const Call& c, int form, int groups, bool reverse, size_t row_bytes,
                   const std::vector<int64_t>& mine, int n, const void* in, void* out,
                   void* masked, int32_t* received);
// The same between the ranks `peers` reaches.
std::string RaggedWith(RaggedPeers& peers, const Call& c, int form, int groups, bool reverse,
                       size_t row_bytes, const std::vector<int64_t>& mine, int n, const void* in,
                       void* out, void* masked, int32_t* received);
// The bytes of rows a rank may send inline in the gathered parts, at `size` ranks.
size_t InlineBytes(int size);

}  // namespace vjpmpi
