// Point-to-point calls (send, recv, sendrecv, and the posted messages of started calls)
// with the opt-in header protocol of VJPMPI_CHECK (p2p.h).
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <vector>
#include "p2p.h"

namespace vjpmpi {

P2PHeader MakeHeader(const Call& c, const int64_t* dims, int ndim) {
  P2PHeader h{};
  h.kind = static_cast<int32_t>(c.kind);
  h.count = 1;
  for (int i = 0; i < ndim; ++i) h.count *= dims[i];
  PackDims(dims, ndim, h.dims, &h.ndim);
  h.site = c.site;
  if (c.site && c.site_text) std::snprintf(h.site_text, sizeof(h.site_text), "%s", c.site_text(c.site).c_str());
  return h;
}

std::string ShapeText(int32_t kind, const int64_t* dims, int ndim) {
  std::string s = std::string(KindName(static_cast<Kind>(kind))) + "[";
  for (int i = 0; i < ndim && i < kMaxDims; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (ndim > kMaxDims ? ", ...]" : "]");
}

std::string SiteSuffix(const char* text) {
  return text[0] ? std::string(" (") + text + ")" : std::string();
}

// "" if what arrived (`got`, from `source` with `tag`) matches this rank's template.
std::string CompareHeader(const Call& c, const P2PHeader& got, int source, int tag) {
  P2PHeader want = MakeHeader(c, c.dims2, c.ndim2);
  if (got.kind == want.kind && got.count == want.count) return {};
  return std::string("vjpmpi.") + c.op + ": (VJPMPI_CHECK) rank " + std::to_string(source) +
         " sent " + ShapeText(got.kind, got.dims, got.ndim) + SiteSuffix(got.site_text) +
         " with tag " + std::to_string(tag) + ", but rank " + std::to_string(Rank(c.comm)) +
         "'s receive template is " + ShapeText(want.kind, want.dims, want.ndim) +
         SiteSuffix(want.site_text) +
         ": the array sent and the template must have the same dtype and number of elements";
}

// After a mismatched header: take the data message off the queue (and send ours, for a
// sendrecv) so that neither side is left waiting; the receive is then an error.
std::string Drain(const Call& c, const void* send, int source, int tag) {
  MPI_Request req = MPI_REQUEST_NULL;
  if (send != nullptr) {
    size_t bytes = c.count * ByteSize(c.kind);
    auto e = Check(VJPMPI_BY_COUNT(bytes, MPI_Isend, send, n, MPI_BYTE, c.peer, c.tag, c.comm,
                                   &req),
                   c.op, "MPI_Isend");
    if (!e.empty()) return e;
  }
  MPI_Status st;
  MPI_Probe(source, tag, c.comm, &st);
  int bytes = 0;
  MPI_Get_count(&st, MPI_BYTE, &bytes);
  std::vector<unsigned char> scratch(static_cast<size_t>(bytes) + 1);
  MPI_Recv(scratch.data(), bytes, MPI_BYTE, source, tag, c.comm, MPI_STATUS_IGNORE);
  return send != nullptr ? Check(MPI_Wait(&req, MPI_STATUS_IGNORE), c.op, "MPI_Wait") : "";
}

std::string Send(const Call& c, const void* send, void*) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  if (c.check_p2p) {
    P2PHeader h = MakeHeader(c, c.dims, c.ndim);
    e = Check(MPI_Send(&h, sizeof(h), MPI_BYTE, c.peer, c.tag, c.comm), c.op,
              "MPI_Send (VJPMPI_CHECK header)");
    if (!e.empty()) return e;
  }
  size_t bytes = c.count * ByteSize(c.kind);  // (as bytes: see ReceivedAll)
  return Check(VJPMPI_BY_COUNT(bytes, MPI_Send, send, n, MPI_BYTE, c.peer, c.tag, c.comm), c.op,
               "MPI_Send");
}

// A receive fills its whole template or is an error: MPI accepts a shorter message
// and leaves the rest of the buffer as it was (a longer one is MPI_ERR_TRUNCATE).
// Point-to-point messages travel as bytes, so that one that is not a whole number of
// the template's elements arrives (and is an error here) instead of stopping MPICH in
// an assertion while it unpacks. Nothing arrives from MPI_PROC_NULL: the template is kept.
std::string ReceivedAll(const Call& c, const MPI_Status& st, size_t want) {
  if (st.MPI_SOURCE == MPI_PROC_NULL) return {};
  size_t w = ByteSize(c.kind);
#if MPI_VERSION >= 4
  MPI_Count got = 0;
  int rc = MPI_Get_count_c(&st, MPI_BYTE, &got);
#else
  int got = 0;
  int rc = MPI_Get_count(&st, MPI_BYTE, &got);
#endif
  if (rc != MPI_SUCCESS) return Check(rc, c.op, "MPI_Get_count");
  size_t bytes = static_cast<size_t>(got);
  if (bytes == want * w) return {};
  std::string what = bytes % w
      ? std::to_string(bytes) + " bytes (not a whole number of " + KindName(c.kind) + ")"
      : std::to_string(bytes / w) + " elements of " + KindName(c.kind);
  return std::string("vjpmpi.") + c.op + ": received " + what + " from rank " +
         std::to_string(st.MPI_SOURCE) + " (tag " + std::to_string(st.MPI_TAG) +
         "), but the receive template holds " + std::to_string(want) +
         " elements: the array sent and the template must have the same size and dtype";
}

// A receive's MPI error `rc` (from `fn`, with the receive's status `st`): for a message
// longer than the template (MPI_ERR_TRUNCATE), who sent it and what the template holds,
// before MPI's own text.
std::string ReceiveError(const Call& c, int rc, const MPI_Status& st, const char* fn) {
  std::string e = Check(rc, c.op, fn);
  int cls = MPI_SUCCESS;
  MPI_Error_class(rc, &cls);
  if (cls != MPI_ERR_TRUNCATE) return e;
  return std::string("vjpmpi.") + c.op + ": the message from rank " +
         std::to_string(st.MPI_SOURCE) + " (tag " + std::to_string(st.MPI_TAG) +
         ") is longer than the receive template, which holds " + std::to_string(c.count2) +
         " elements of " + KindName(c.kind) + " (" + std::to_string(c.count2 * ByteSize(c.kind)) +
         " bytes): the array sent and the template must have the same size and dtype (" +
         e.substr(e.find(':') + 2) + ")";
}

// VJPMPI_CHECK: receive the header of the message that `source` / `tag` (possibly
// MPI_ANY_SOURCE / MPI_ANY_TAG) will match next, then compare it with the template.
// On return *source and *tag name the actual sender and tag (what the data receive
// must name, so that it takes the message this header announced).
std::string ReceiveHeader(const Call& c, const void* send, int* source, int* tag) {
  P2PHeader got{};
  MPI_Status st;
  std::string e;
  if (send != nullptr) {  // sendrecv: our header goes to dest meanwhile
    P2PHeader mine = MakeHeader(c, c.dims, c.ndim);
    e = Check(MPI_Sendrecv(&mine, sizeof(mine), MPI_BYTE, c.peer, c.tag, &got, sizeof(got),
                           MPI_BYTE, *source, *tag, c.comm, &st),
              c.op, "MPI_Sendrecv (VJPMPI_CHECK header)");
  } else {
    e = Check(MPI_Recv(&got, sizeof(got), MPI_BYTE, *source, *tag, c.comm, &st), c.op,
              "MPI_Recv (VJPMPI_CHECK header)");
  }
  if (!e.empty() || st.MPI_SOURCE == MPI_PROC_NULL) return e;
  *source = st.MPI_SOURCE;
  *tag = st.MPI_TAG;
  got.site_text[sizeof(got.site_text) - 1] = '\0';
  e = CompareHeader(c, got, *source, *tag);
  if (e.empty()) return e;
  std::string drained = Drain(c, send, *source, *tag);
  return drained.empty() ? e : e + " (" + drained + ")";
}

std::string Recv(const Call& c, const void*, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  int source = c.peer2, tag = c.tag2;
  if (c.check_p2p) {
    e = ReceiveHeader(c, nullptr, &source, &tag);
    if (!e.empty()) return e;
  }
  MPI_Status st;
  size_t bytes = c.count * ByteSize(c.kind);
  int rc = VJPMPI_BY_COUNT(bytes, MPI_Recv, recv, n, MPI_BYTE, source, tag, c.comm, &st);
  if (c.status) *c.status = st;
  return rc == MPI_SUCCESS ? ReceivedAll(c, st, c.count) : ReceiveError(c, rc, st, "MPI_Recv");
}

std::string Sendrecv(const Call& c, const void* send, void* recv) {
  size_t big = c.count > c.count2 ? c.count : c.count2;
  auto e = CountCheck(big, c.op);
  if (!e.empty()) return e;
  int source = c.peer2, tag = c.tag2;
  if (c.check_p2p) {
    e = ReceiveHeader(c, send, &source, &tag);
    if (!e.empty()) return e;
  }
  MPI_Status st;
  size_t w = ByteSize(c.kind), out = c.count * w, in = c.count2 * w;
  int rc;
  if (Large(out) || Large(in)) {
#if MPI_VERSION >= 4
    rc = MPI_Sendrecv_c(send, (MPI_Count)out, MPI_BYTE, c.peer, c.tag, recv, (MPI_Count)in,
                        MPI_BYTE, source, tag, c.comm, &st);
#else
    return CountCheck(out > in ? out : in, c.op);
#endif
  } else {
    rc = MPI_Sendrecv(send, (int)out, MPI_BYTE, c.peer, c.tag, recv, (int)in, MPI_BYTE, source,
                      tag, c.comm, &st);
  }
  if (c.status) *c.status = st;
  return rc == MPI_SUCCESS ? ReceivedAll(c, st, c.count2) : ReceiveError(c, rc, st, "MPI_Sendrecv");
}

// A started call's messages (vjpmpi.start), posted without waiting: the messages Send,
// Recv and Sendrecv make, in their order (with the check on, the header before the
// data), so that they pair with those; TestPosted completes them. Nothing here blocks:
// a started send completes while the program's next call (a receive) waits, as MPI's
// Isend does. With the check on, a receive posts the header's and the data's receives
// together, from the call's source and tag (a receive from MPI.ANY_SOURCE could take

// `recv` (c.count2 elements from c.peer2, c.tag2) and `send` (c.count to c.peer, c.tag),
// either null.
std::string Post(const Call& c, const void* send, void* recv, Posted* p) {
  std::string e;
  size_t w = ByteSize(c.kind);
  if (recv != nullptr) {
    p->receives = true;
    e = CountCheck(c.count2, c.op);
    if (e.empty() && c.check_p2p) {
      e = Check(MPI_Irecv(&p->got, sizeof(p->got), MPI_BYTE, c.peer2, c.tag2, c.comm,
                          &p->req[Posted::kHeaderIn]),
                c.op, "MPI_Irecv (VJPMPI_CHECK header)");
    }
    if (e.empty()) {
      e = Check(VJPMPI_BY_COUNT(c.count2 * w, MPI_Irecv, recv, n, MPI_BYTE, c.peer2, c.tag2,
                                c.comm, &p->req[Posted::kDataIn]),
                c.op, "MPI_Irecv");
    }
    if (!e.empty()) return e;
  }
  if (send != nullptr) {
    e = CountCheck(c.count, c.op);
    if (e.empty() && c.check_p2p) {
      p->mine = MakeHeader(c, c.dims, c.ndim);
      e = Check(MPI_Isend(&p->mine, sizeof(p->mine), MPI_BYTE, c.peer, c.tag, c.comm,
                          &p->req[Posted::kHeaderOut]),
                c.op, "MPI_Isend (VJPMPI_CHECK header)");
    }
    if (e.empty()) {
      e = Check(VJPMPI_BY_COUNT(c.count * w, MPI_Isend, send, n, MPI_BYTE, c.peer, c.tag,
                                c.comm, &p->req[Posted::kDataOut]),
                c.op, "MPI_Isend");
    }
  }
  return e;
}

// Whether the posted messages are done (*done), and then what went wrong ("" if nothing):
// with the check on, the header compared first (the sender's sizes and call site, where a
// longer message also truncates the data's receive); a request that failed, with its own
// error (a truncated receive: ReceiveError); the whole template received. A request that
// fails leaves the others to end: their buffers are MPI's until they do.
std::string TestPosted(const Call& c, Posted* p, bool* done) {
  int n = 0;
  int idx[Posted::kRequests];
  MPI_Status st[Posted::kRequests];
  int rc = MPI_Testsome(Posted::kRequests, p->req, &n, idx, st);
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
    *done = true;
    return Check(rc, c.op, "MPI_Testsome");
  }
  for (int i = 0; n != MPI_UNDEFINED && i < n; ++i) {
    p->st[idx[i]] = st[i];
    if (rc == MPI_ERR_IN_STATUS && st[i].MPI_ERROR != MPI_SUCCESS) p->error[idx[i]] = st[i].MPI_ERROR;
  }
  *done = std::all_of(std::begin(p->req), std::end(p->req),
                      [](MPI_Request r) { return r == MPI_REQUEST_NULL; });
  if (!*done) return {};
  const MPI_Status& head = p->st[Posted::kHeaderIn];
  if (p->receives && c.check_p2p && !p->error[Posted::kHeaderIn] &&
      head.MPI_SOURCE != MPI_PROC_NULL) {
    p->got.site_text[sizeof(p->got.site_text) - 1] = '\0';
    std::string e = CompareHeader(c, p->got, head.MPI_SOURCE, head.MPI_TAG);
    if (!e.empty()) return e;
  }
  static const char* const kNames[Posted::kRequests] = {
      "MPI_Irecv (VJPMPI_CHECK header)", "MPI_Irecv", "MPI_Isend (VJPMPI_CHECK header)",
      "MPI_Isend"};
  for (int i = 0; i < Posted::kRequests; ++i) {
    if (!p->error[i]) continue;
    return i == Posted::kDataIn ? ReceiveError(c, p->error[i], p->st[i], kNames[i])
                                : Check(p->error[i], c.op, kNames[i]);
  }
  return p->receives ? ReceivedAll(c, p->st[Posted::kDataIn], c.count2) : std::string();
}

}  // namespace vjpmpi
