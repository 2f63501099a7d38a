// Point-to-point calls on plain pointers (p2p.cc): send, recv and sendrecv, and the
// messages of a started call (vjpmpi.start), posted without waiting and tested until
// they are done. Under VJPMPI_CHECK each message is preceded by a header (P2PHeader).
#pragma once

#include <cstdint>
#include <string>

#include "mpi_ops.h"

namespace vjpmpi {

// VJPMPI_CHECK: each point-to-point message is preceded by a header saying what it
// holds (dtype, element count and shape, call site), which the receiver compares with
// its template: dtype and element count must agree (a message may change shape, as a
// sendrecv of a (6,) array into a (3, 2) template does). Without the check the element
// count is still compared, from the message itself (ReceivedAll), but not the dtype.
struct P2PHeader {
  int32_t kind, ndim;
  int64_t count;
  int64_t dims[kMaxDims];
  int64_t site;
  char site_text[176];  // the sender's call site
};

std::string Send(const Call& c, const void* send, void* recv);
// A receive fills its whole template or is an error (ReceivedAll, p2p.cc).
std::string Recv(const Call& c, const void* send, void* recv);
std::string Sendrecv(const Call& c, const void* send, void* recv);

// A started call's messages (vjpmpi.start), posted without waiting: the messages Send,
// Recv and Sendrecv make, in their order (with the check on, the header before the
// data), so that they pair with those; TestPosted completes them. Nothing here blocks:
// a started send completes while the program's next call (a receive) waits, as MPI's
// Isend does. With the check on, a receive posts the header's and the data's receives
// together, from the call's source and tag (a receive from MPI.ANY_SOURCE could take
// two senders' messages; the data's size is still checked).
struct Posted {
  enum { kHeaderIn, kDataIn, kHeaderOut, kDataOut, kRequests };
  MPI_Request req[kRequests] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL,
                                MPI_REQUEST_NULL};
  MPI_Status st[kRequests] = {};  // each request's status, once it has ended
  int error[kRequests] = {};      // MPI's error for a request that failed (0: none)
  P2PHeader mine{}, got{};
  bool receives = false;
};

// `recv` (c.count2 elements from c.peer2, c.tag2) and `send` (c.count to c.peer, c.tag),
// either null.
std::string Post(const Call& c, const void* send, void* recv, Posted* p);

// Whether the posted messages are done (*done), and then what went wrong ("" if nothing).
std::string TestPosted(const Call& c, Posted* p, bool* done);

}  // namespace vjpmpi
