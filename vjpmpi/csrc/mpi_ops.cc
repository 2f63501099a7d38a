// One function per MPI call shape on plain pointers (mpi_ops.h), the dtype and
// reduction tables' lookups, error strings, and the communicators vjpmpi derives.
#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>
#include "mpi_ops.h"

namespace vjpmpi {

std::vector<std::string> ReductionNames() {
  return {
#define VJPMPI_X(e, name) #name,
      VJPMPI_REDUCTIONS(VJPMPI_X)
#undef VJPMPI_X
  };
}

std::vector<std::string> KindNames() {
  return {
#define VJPMPI_X(e, name, xla, mpi, bytes) #name,
      VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
  };
}

// The MPI_Op for a reduction code on an element kind; MPI_OP_NULL if the pair
// is not supported (Python validates first, this is the backstop).
MPI_Op Operation(Red r, Kind k) {
  if (OwnOp(r, k)) return OwnOperation(r, k);
  if (k == Kind::kF16 || k == Kind::kBF16) return MPI_OP_NULL;
  switch (r) {
#define VJPMPI_X(e, name) \
  case Red::e:            \
    return MPI_##name;
    VJPMPI_REDUCTIONS(VJPMPI_X)
#undef VJPMPI_X
  }
  return MPI_OP_NULL;
}

// ------------------------------------------------- identity (for exscan) --
template <typename T>
T Identity(Red r) {
  if constexpr (std::is_same_v<T, bool>) {
    return r == Red::kLand || r == Red::kBand || r == Red::kMin;
  } else if constexpr (std::is_integral_v<T>) {
    switch (r) {
      case Red::kProd: case Red::kLand: return T(1);
      case Red::kMax: return std::numeric_limits<T>::lowest();
      case Red::kMin: return std::numeric_limits<T>::max();
      case Red::kBand: return static_cast<T>(~T(0));
      default: return T(0);
    }
  } else {
    switch (r) {
      case Red::kProd: return T(1);
      case Red::kMax: return -std::numeric_limits<T>::infinity();
      case Red::kMin: return std::numeric_limits<T>::infinity();
      default: return T(0);
    }
  }
}

template <typename T>
void FillT(void* buf, size_t n, T v) {
  T* p = static_cast<T*>(buf);
  for (size_t i = 0; i < n; ++i) p[i] = v;
}

void FillIdentity(void* buf, size_t n, Kind k, Red r) {
  switch (k) {
    case Kind::kBool: return FillT<bool>(buf, n, Identity<bool>(r));
    case Kind::kI8: return FillT<int8_t>(buf, n, Identity<int8_t>(r));
    case Kind::kI16: return FillT<int16_t>(buf, n, Identity<int16_t>(r));
    case Kind::kI32: return FillT<int32_t>(buf, n, Identity<int32_t>(r));
    case Kind::kI64: return FillT<int64_t>(buf, n, Identity<int64_t>(r));
    case Kind::kU8: return FillT<uint8_t>(buf, n, Identity<uint8_t>(r));
    case Kind::kU16: return FillT<uint16_t>(buf, n, Identity<uint16_t>(r));
    case Kind::kU32: return FillT<uint32_t>(buf, n, Identity<uint32_t>(r));
    case Kind::kU64: return FillT<uint64_t>(buf, n, Identity<uint64_t>(r));
    case Kind::kF16: return FillT<uint16_t>(buf, n, FloatToHalf(Identity<float>(r)));
    case Kind::kBF16: return FillT<uint16_t>(buf, n, FloatToBF16(Identity<float>(r)));
    case Kind::kF32: return FillT<float>(buf, n, Identity<float>(r));
    case Kind::kF64: return FillT<double>(buf, n, Identity<double>(r));
    case Kind::kC64: {  // complex: real part = identity, imaginary part 0
      float* p = static_cast<float*>(buf);
      for (size_t i = 0; i < n; ++i) { p[2 * i] = Identity<float>(r); p[2 * i + 1] = 0.f; }
      return;
    }
    case Kind::kC128: {
      double* p = static_cast<double*>(buf);
      for (size_t i = 0; i < n; ++i) { p[2 * i] = Identity<double>(r); p[2 * i + 1] = 0.0; }
      return;
    }
    default: return;
  }
}

// ----------------------------------------------------------------- errors --
// Empty string on success, else "vjpmpi.<op>: <what>: <MPI error string>".
std::string Check(int rc, const char* op, const char* what) {
  if (rc == MPI_SUCCESS) return {};
  char msg[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
  msg[len] = '\0';
  return std::string("vjpmpi.") + op + ": " + what + " failed: " + msg;
}

// Messages over INT_MAX elements use MPI-4's large-count calls (MPI_Bcast_c,
// ...); an MPI older than 4.0, or vjpmpi's own float16/bfloat16 reductions

const char* KindName(Kind k) {
  switch (k) {
#define VJPMPI_X(e, name, xla, mpi, bytes) \
  case Kind::e:                            \
    return #name;
    VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
    default: return "unsupported";
  }
}

// `ndim` dimensions into `out` (kMaxDims of them; more: the last one hashes the rest).
void PackDims(const int64_t* dims, int ndim, int64_t* out, int32_t* out_ndim) {
  for (int i = 0; i < kMaxDims; ++i) out[i] = i < ndim ? dims[i] : 0;
  if (ndim > kMaxDims) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = kMaxDims - 1; i < ndim; ++i) h = (h ^ static_cast<uint64_t>(dims[i])) * 1099511628211ULL;
    out[kMaxDims - 1] = static_cast<int64_t>(h);
  }
  *out_ndim = ndim;
}

// ----------------------------------------------------- one per call shape --

// Allreduce, Scan and Exscan: one element-wise reduction call each, in place when
// XLA aliased the buffers.
#define VJPMPI_ELEMENTWISE(fn, comm)                                                     \
  [](const Call& c, MPI_Comm on, const void* send, void* recv) -> std::string {         \
    auto e = CountCheck(c.count, c.op, OwnOp(c.red, c.kind));                                   \
    if (!e.empty()) return e;                                                            \
    const void* s = send == recv ? MPI_IN_PLACE : send;                                  \
    MPI_Datatype t = Datatype(c.kind);                                                   \
    MPI_Op op = Operation(c.red, c.kind);                                                \
    return Check(VJPMPI_BY_COUNT(c.count, fn, s, recv, n, t, op, on), c.op, #fn);       \
  }(c, comm, send, recv)

std::string Allreduce(const Call& c, const void* send, void* recv) {
  return VJPMPI_ELEMENTWISE(MPI_Allreduce, c.comm);
}

std::string Reduce(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op, OwnOp(c.red, c.kind));
  if (!e.empty()) return e;
  bool root = Rank(c.comm) == c.root;
  if (!root && send != recv) c.copy(recv, send, c.count * ByteSize(c.kind));
  const void* s = (root && send == recv) ? MPI_IN_PLACE : send;
  void* r = root ? recv : nullptr;
  MPI_Datatype t = Datatype(c.kind);
  MPI_Op op = Operation(c.red, c.kind);
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Reduce, s, r, n, t, op, c.root, c.comm), c.op,
               "MPI_Reduce");
}

std::string Bcast(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  if (send != recv && Rank(c.comm) == c.root) c.copy(recv, send, c.count * ByteSize(c.kind));
  MPI_Datatype t = Datatype(c.kind);
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Bcast, recv, n, t, c.root, c.comm), c.op,
               "MPI_Bcast");
}

std::string Allgather(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Allgather, send, n, t, recv, n, t, c.comm), c.op,
               "MPI_Allgather");
}

std::string Gather(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  bool root = Rank(c.comm) == c.root;
  if (!root && send != recv) c.copy(recv, send, c.count * ByteSize(c.kind));
  void* r = root ? recv : nullptr;
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Gather, send, n, t, r, n, t, c.root, c.comm), c.op,
               "MPI_Gather");
}

std::string Scatter(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  const void* s = Rank(c.comm) == c.root ? send : nullptr;
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Scatter, s, n, t, recv, n, t, c.root, c.comm), c.op,
               "MPI_Scatter");
}

// Communicators derived from `comm` for vjpmpi's own use, cached on `comm` as MPI
// attributes (freed with it):
//  - kDuplicate: a private duplicate for vjpmpi's point-to-point traffic inside a
//    collective, so it never matches the user's messages on `comm`;
//  - kReversed: the same group with the ranks in reverse order (rank size-1-r), on
//    which scans run "from the last rank down" (the adjoint order of a scan).
// Creating one is collective: only call this from inside a collective that every
// rank of `comm` runs.

int FreeDerived(MPI_Comm, int, void* attr, void*) {
  MPI_Comm* derived = static_cast<MPI_Comm*>(attr);
  MPI_Comm_free(derived);
  delete derived;
  return MPI_SUCCESS;
}

std::string DerivedComm(MPI_Comm comm, Derived kind, const char* op, MPI_Comm* out) {
  static int keys[2] = {MPI_KEYVAL_INVALID, MPI_KEYVAL_INVALID};
  static std::once_flag once;
  std::call_once(once, [] {
    for (int& key : keys) MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, FreeDerived, &key, nullptr);
  });
  int key = keys[static_cast<int>(kind)];
  void* value = nullptr;
  int found = 0;
  auto e = Check(MPI_Comm_get_attr(comm, key, &value, &found), op, "MPI_Comm_get_attr");
  if (!e.empty()) return e;
  if (found) {
    *out = *static_cast<MPI_Comm*>(value);
    return {};
  }
  MPI_Comm* derived = new MPI_Comm;
  if (kind == Derived::kDuplicate) {
    e = Check(MPI_Comm_dup(comm, derived), op, "MPI_Comm_dup");
  } else {
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    e = Check(MPI_Comm_split(comm, 0, size - 1 - rank, derived), op, "MPI_Comm_split");
  }
  if (!e.empty()) {
    delete derived;
    return e;
  }
  MPI_Comm_set_errhandler(*derived, MPI_ERRORS_RETURN);
  *out = *derived;
  return Check(MPI_Comm_set_attr(comm, key, derived), op, "MPI_Comm_set_attr");
}

// The communicator a scan runs on: `c.comm`, or its reversed twin for c.reverse.
std::string OrderedComm(const Call& c, MPI_Comm* out) {
  if (!c.reverse) {
    *out = c.comm;
    return {};
  }
  return DerivedComm(c.comm, Derived::kReversed, c.op, out);
}

// `rank ^ k` with that rank, through one block of scratch. Moves the same bytes
// as an out-of-place alltoall; MPICH's MPI_IN_PLACE algorithm copies each block
// twice more and ran 1.3-1.6x slower on 16-128 MiB.
std::string AlltoallPairwise(const Call& c, void* buf, int size) {
  static thread_local std::vector<unsigned char> scratch;
  size_t bytes = c.count * ByteSize(c.kind);
  if (scratch.size() < bytes) {
    scratch.resize(bytes);
    HugePages(scratch.data(), bytes);
  }
  MPI_Datatype t = Datatype(c.kind);
  int rank = Rank(c.comm);
  MPI_Comm comm;
  auto e = DerivedComm(c.comm, Derived::kDuplicate, c.op, &comm);
  if (!e.empty()) return e;
  unsigned char* base = static_cast<unsigned char*>(buf);
  for (int k = 1; k < size; ++k) {
    int peer = rank ^ k;
    unsigned char* block = base + static_cast<size_t>(peer) * bytes;
    StreamCopy(scratch.data(), block, bytes);
    MPI_Status st;
    e = Check(VJPMPI_BY_COUNT(c.count, MPI_Sendrecv, scratch.data(), n, t, peer, 0, block, n, t,
                              peer, 0, comm, &st),
              c.op, "MPI_Sendrecv");
    if (!e.empty()) return e;
  }
  return {};
}

std::string Alltoall(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  int size = 1;
  MPI_Comm_size(c.comm, &size);
  if (send == recv && !c.device && (size & (size - 1)) == 0 && c.count > 0) {
    return AlltoallPairwise(c, recv, size);
  }
  const void* s = send == recv ? MPI_IN_PLACE : send;
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Alltoall, s, n, t, recv, n, t, c.comm), c.op,
               "MPI_Alltoall");
}

std::string ReduceScatter(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op, OwnOp(c.red, c.kind));
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  MPI_Op op = Operation(c.red, c.kind);
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Reduce_scatter_block, send, recv, n, t, op, c.comm),
               c.op, "MPI_Reduce_scatter_block");
}

std::string Scan(const Call& c, const void* send, void* recv) {
  return VJPMPI_ELEMENTWISE(MPI_Scan, c.comm);
}

// Exscan in rank order, or (c.reverse) from the last rank down; the first rank
// of that order receives the identity of the reduction.
std::string Exscan(const Call& c, const void* send, void* recv) {
  MPI_Comm comm;
  std::string e = OrderedComm(c, &comm);
  if (!e.empty()) return e;
  e = VJPMPI_ELEMENTWISE(MPI_Exscan, comm);
  if (e.empty() && Rank(comm) == 0) {
    if (c.device) {  // fill on the host, then copy to the device buffer
      std::vector<unsigned char> host(c.count * ByteSize(c.kind));
      FillIdentity(host.data(), c.count, c.kind, c.red);
      c.copy(recv, host.data(), host.size());
    } else {
      FillIdentity(recv, c.count, c.kind, c.red);
    }
  }
  return e;
}

// OthersProduct(x): prod_{r != rank} x_r, element-wise (the derivative of a product
// over the ranks): the exclusive product in rank order times the one from the last
// rank down, in blocks of at most 4 MiB so that MPI's own scratch for the scans, and
// ours for the second one, stay small whatever the array's size. No division, so
// exact with zeros. Out of place (x is the forward's input too).
std::string OthersProduct(const Call& c, const void* x, void* out) {
  auto e = CountCheck(c.count, c.op, OwnOp(c.red, c.kind));
  if (!e.empty()) return e;
  MPI_Comm rev;
  e = DerivedComm(c.comm, Derived::kReversed, c.op, &rev);
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  MPI_Op prod = Operation(Red::kProd, c.kind);
  size_t w = ByteSize(c.kind), block = std::max<size_t>(1, (size_t{4} << 20) / w);
  bool first = Rank(c.comm) == 0, last = Rank(rev) == 0;
  static thread_local std::vector<unsigned char> after;
  after.resize(std::min(block, c.count) * w);
  const unsigned char* in = static_cast<const unsigned char*>(x);
  unsigned char* res = static_cast<unsigned char*>(out);
  for (size_t at = 0; at < c.count; at += block) {
    int n = static_cast<int>(std::min(block, c.count - at));
    e = Check(MPI_Exscan(in + at * w, res + at * w, n, t, prod, c.comm), c.op, "MPI_Exscan");
    if (e.empty()) e = Check(MPI_Exscan(in + at * w, after.data(), n, t, prod, rev), c.op, "MPI_Exscan");
    if (!e.empty()) return e;
    if (first) FillIdentity(res + at * w, n, c.kind, Red::kProd);  // nothing before rank 0
    if (!last) MPI_Reduce_local(after.data(), res + at * w, n, t, prod);  // nor after the last
  }
  return {};
}


std::string Recurrence(const Call& c, const void* a, const void* b, void* out) {
  auto e = CountCheck(c.count, c.op, /*user_op=*/true);
  if (!e.empty()) return e;
  PairOp pair = AffinePair(c.kind);
  if (pair.op == MPI_OP_NULL) return std::string("vjpmpi.") + c.op + ": unsupported dtype";
  MPI_Comm comm;
  e = OrderedComm(c, &comm);
  if (!e.empty()) return e;
  size_t w = ByteSize(c.kind);
  static thread_local std::vector<unsigned char> pairs;
  pairs.resize(2 * c.count * w);
  const unsigned char* pa = static_cast<const unsigned char*>(a);
  const unsigned char* pb = static_cast<const unsigned char*>(b);
  for (size_t i = 0; i < c.count; ++i) {
    std::memcpy(&pairs[2 * i * w], pa + i * w, w);
    std::memcpy(&pairs[(2 * i + 1) * w], pb + i * w, w);
  }
  e = Check(MPI_Exscan(MPI_IN_PLACE, pairs.data(), static_cast<int>(c.count), pair.type, pair.op,
                       comm),
            c.op, "MPI_Exscan");
  if (!e.empty()) return e;
  unsigned char* po = static_cast<unsigned char*>(out);
  if (Rank(comm) == 0) {  // nothing before the first rank: the empty sum
    std::memset(po, 0, c.count * w);  // +0 in every floating kind
  } else {
    for (size_t i = 0; i < c.count; ++i) std::memcpy(po + i * w, &pairs[(2 * i + 1) * w], w);
  }
  return {};
}

// Agree: no data moves; the call is there for the ranks' agreement alone (agree.h),
// which compares what every rank passes (a zero-size array whose shape and dtype are a
// composite's global array: vjpmpi.fft), so that ranks that disagree, or a rank that
// refuses its arguments, fail together.
std::string AgreeOnly(const Call&, const void*, void*) { return {}; }

std::string Barrier(const Call& c, const void*, void*) {
  return Check(MPI_Barrier(c.comm), c.op, "MPI_Barrier");
}

std::string LibraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING + 1];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  buf[len] = '\0';
  return std::string(buf, len);
}

}  // namespace vjpmpi
