// The MPI layer of vjpmpi's core library (libvjpmpi_core.so): handle conversion, the
// dtype and reduction tables (the one source of Python's codes), error strings, and one
// function per MPI call shape on plain pointers (mpi_ops.cc), with vjpmpi's own
// reductions for float16/bfloat16 (half.cc) and huge pages for host buffers
// (hugepages.cc). A backend binds XLA FFI buffers to these functions (handlers.h).
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace vjpmpi {
// ---------------------------------------------------------------- handles --
// mpi4py exposes `handle` as an integer: the MPI_Comm value itself for the
// MPICH ABI (an int), the object's address for Open MPI (a pointer).
template <typename H>
inline H FromHandle(int64_t h) {
  if constexpr (std::is_pointer_v<H>) {
    return reinterpret_cast<H>(static_cast<uintptr_t>(h));
  } else {
    return static_cast<H>(h);
  }
}

// ------------------------------------------------ reductions and dtypes --
// These two tables are the one source of vjpmpi's reduction codes and element
// kinds: the enums, the MPI objects and the names Python reads (the modules'
// reductions() and dtypes(), from which vjpmpi/_mpi.py builds RED_NAMES, the
// SUM..BXOR codes and the supported dtypes) are all expanded from them.

// X(enumerator, name): the code is the position; MPI_<name> is the MPI op and
// Python's MPI.<name> maps to it.
#define VJPMPI_REDUCTIONS(X)                                                             \
  X(kSum, SUM) X(kProd, PROD) X(kMax, MAX) X(kMin, MIN) X(kLand, LAND) X(kLor, LOR)      \
  X(kLxor, LXOR) X(kBand, BAND) X(kBor, BOR) X(kBxor, BXOR)

// X(enumerator, NumPy dtype name, XLA FFI DataType, MPI datatype, bytes per element).
// float16 and bfloat16 travel as 16-bit words and are reduced by OwnOperation.
#define VJPMPI_KINDS(X)                                                                  \
  X(kBool, bool, PRED, MPI_C_BOOL, 1)                                                   \
  X(kI8, int8, S8, MPI_INT8_T, 1)                                                       \
  X(kI16, int16, S16, MPI_INT16_T, 2)                                                   \
  X(kI32, int32, S32, MPI_INT32_T, 4)                                                   \
  X(kI64, int64, S64, MPI_INT64_T, 8)                                                   \
  X(kU8, uint8, U8, MPI_UINT8_T, 1)                                                     \
  X(kU16, uint16, U16, MPI_UINT16_T, 2)                                                 \
  X(kU32, uint32, U32, MPI_UINT32_T, 4)                                                 \
  X(kU64, uint64, U64, MPI_UINT64_T, 8)                                                 \
  X(kF16, float16, F16, MPI_UINT16_T, 2)                                                \
  X(kBF16, bfloat16, BF16, MPI_UINT16_T, 2)                                             \
  X(kF32, float32, F32, MPI_FLOAT, 4)                                                   \
  X(kF64, float64, F64, MPI_DOUBLE, 8)                                                  \
  X(kC64, complex64, C64, MPI_C_FLOAT_COMPLEX, 8)                                       \
  X(kC128, complex128, C128, MPI_C_DOUBLE_COMPLEX, 16)

enum class Red : int {
#define VJPMPI_X(e, name) e,
  VJPMPI_REDUCTIONS(VJPMPI_X)
#undef VJPMPI_X
};

// Reduction names in code order (what Python's RED_NAMES is made of).
// Reduction names in code order (what Python's RED_NAMES is made of).
std::vector<std::string> ReductionNames();

enum class Kind {
#define VJPMPI_X(e, name, xla, mpi, bytes) e,
  VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
  kUnsupported
};

// NumPy names of the element kinds the kernels support, in Kind order.
std::vector<std::string> KindNames();
const char* KindName(Kind k);

// ---------------------------------------------------- float16 / bfloat16 --
// (half.cc) Conversions, rounding to nearest even.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BF16ToFloat(uint16_t h);
uint16_t FloatToBF16(float f);

// vjpmpi's own reductions, as user-defined MPI ops: SUM, PROD, MAX and MIN of
// float16 and bfloat16 (which travel as 16-bit words and are combined in float),
// and MAX and MIN of float32 and float64, where MPI's built-in ops keep or drop a
// NaN depending on the order of the operands (so the ranks of one allreduce could
// disagree). MAX and MIN give NaN wherever an operand is NaN, as jnp.max and
// jnp.min do, identically on every rank.
//
// Whether (r, k) reduces with one of vjpmpi's own (int-count) user functions.
inline bool OwnOp(Red r, Kind k) {
  if (k == Kind::kF16 || k == Kind::kBF16) return static_cast<int>(r) <= static_cast<int>(Red::kMin);
  return (k == Kind::kF32 || k == Kind::kF64) && (r == Red::kMax || r == Red::kMin);
}

// The own ops, made once after MPI_Init (half.cc).
MPI_Op OwnOperation(Red r, Kind k);

// The MPI datatype an element kind travels as, and its size in bytes.
struct KindInfo {
  MPI_Datatype type;
  size_t bytes;
};

inline KindInfo Info(Kind k) {
  switch (k) {
#define VJPMPI_X(e, name, xla, mpi, bytes) \
  case Kind::e:                            \
    return {mpi, bytes};
    VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
    default: return {MPI_DATATYPE_NULL, 0};
  }
}

inline MPI_Datatype Datatype(Kind k) { return Info(k).type; }
inline size_t ByteSize(Kind k) { return Info(k).bytes; }

// The MPI_Op for a reduction code on an element kind; MPI_OP_NULL if the pair
// is not supported (Python validates first, this is the backstop).
MPI_Op Operation(Red r, Kind k);

// Fills `n` elements of kind `k` with the identity of `r` (for exscan's first rank).
void FillIdentity(void* buf, size_t n, Kind k, Red r);

// ----------------------------------------------------------------- errors --
// Empty string on success, else "vjpmpi.<op>: <what>: <MPI error string>".
std::string Check(int rc, const char* op, const char* what);

// Messages over INT_MAX elements use MPI-4's large-count calls (MPI_Bcast_c,
// ...); an MPI older than 4.0, or vjpmpi's own float16/bfloat16 reductions
// (int-count user functions), cannot carry them.
inline bool Large(size_t n) { return n > static_cast<size_t>(INT_MAX); }

inline std::string CountCheck(size_t n, const char* op, bool user_op = false) {
  if (!Large(n)) return {};
  if (MPI_VERSION >= 4 && !user_op) return {};
  return std::string("vjpmpi.") + op + ": message of " + std::to_string(n) +
         " elements exceeds MPI's int count limit (2**31 - 1)" +
         (user_op ? " for vjpmpi's own reductions (float16/bfloat16, and float MAX/MIN)"
                  : " and this MPI has no large-count calls");
}

template <typename Small, typename Big>
int ByCount(size_t n, Small small, Big big) {
  if (!Large(n)) return small(static_cast<int>(n));
#if MPI_VERSION >= 4
  return big(static_cast<MPI_Count>(n));
#else
  (void)big;
  return MPI_ERR_COUNT;
#endif
}

// MPI_FN(args) with `n` (the count) as int, or MPI_FN_c(args) with `n` as MPI_Count.
#if MPI_VERSION >= 4
#define VJPMPI_BY_COUNT(count, fn, ...) \
  ByCount(count, [&](int n) { return fn(__VA_ARGS__); }, [&](MPI_Count n) { return fn##_c(__VA_ARGS__); })
#else
#define VJPMPI_BY_COUNT(count, fn, ...) ByCount(count, [&](int n) { return fn(__VA_ARGS__); }, nullptr)
#endif

// A collective call on host pointers; `count` is the element count of one
// block (the whole local array for elementwise ops, one rank's block for the
// gather/scatter family).  `send == recv` means in place.
inline void HostCopy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

inline constexpr int kMaxDims = 8;

// `ndim` dimensions into `out` (kMaxDims of them; more: the last one hashes the rest).
void PackDims(const int64_t* dims, int ndim, int64_t* out, int32_t* out_ndim);

struct Call {
  const char* op;
  MPI_Comm comm;
  Kind kind;
  size_t count;   // elements sent (per rank block for the gather family)
  size_t count2;  // elements received, where that differs (sendrecv)
  Red red;
  int root;
  int peer;    // dest for send / sendrecv
  int peer2;   // source for recv / sendrecv
  int tag;
  int tag2;
  MPI_Status* status;
  bool reverse = false;  // scans: over the ranks in reverse order (see OrderedComm)
  bool host_op = false;  // reduces with a host function (must see host memory)
  int uses = 0;  // which of red / root the op takes, whether it waits for all (EntryFlags)
  // The shape every rank must agree on: the per-rank block (for send: what is sent;
  // for recv and sendrecv, dims2: the receive template).
  const int64_t* dims = nullptr;
  int ndim = 0;
  const int64_t* dims2 = nullptr;
  int ndim2 = 0;
  bool check_p2p = false;  // VJPMPI_CHECK: point-to-point messages carry a header
  int64_t layout = 0;      // a device call's devices' layout (devices.h Place), else 0
  int64_t run = 0;         // a device call's XLA run id (it stops waiting if its run failed)
  int64_t site = 0;        // call-site hash (its text: the runtime's registry), or 0
  std::string (*site_text)(int64_t) = nullptr;
  // Memory the buffers live in: host (default), or device memory handed to a
  // CUDA-aware MPI, where local copies go through `copy` (cudaMemcpy).
  void (*copy)(void* dst, const void* src, size_t bytes) = &HostCopy;
  bool device = false;
};

inline int Rank(MPI_Comm c) { int r = 0; MPI_Comm_rank(c, &r); return r; }

// ----------------------------------------------------- one per call shape --
// (mpi_ops.cc) Each returns "" or the error; `send == recv`: in place.
std::string Allreduce(const Call& c, const void* send, void* recv);
std::string Reduce(const Call& c, const void* send, void* recv);
std::string Bcast(const Call& c, const void* send, void* recv);
std::string Allgather(const Call& c, const void* send, void* recv);
std::string Gather(const Call& c, const void* send, void* recv);
std::string Scatter(const Call& c, const void* send, void* recv);
std::string Alltoall(const Call& c, const void* send, void* recv);
std::string ReduceScatter(const Call& c, const void* send, void* recv);
std::string Scan(const Call& c, const void* send, void* recv);
// Exscan in rank order, or (c.reverse) from the last rank down; the first rank
// of that order receives the identity of the reduction.
std::string Exscan(const Call& c, const void* send, void* recv);
// prod_{r != rank} x_r, element-wise (the derivative of a product over the ranks).
std::string OthersProduct(const Call& c, const void* x, void* out);
// The linear recurrence scan: e_s = sum over q before s of b_q * prod_{q < r < s} a_r.
std::string Recurrence(const Call& c, const void* a, const void* b, void* out);
// No data moves: the call is there for the ranks' agreement alone (agree.h).
std::string AgreeOnly(const Call& c, const void* send, void* recv);
std::string Barrier(const Call& c, const void* send, void* recv);

// The (a, b) pair datatype and the composition op of a floating kind (half.cc);
// {MPI_DATATYPE_NULL, MPI_OP_NULL} for the other kinds.
struct PairOp {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
};
PairOp AffinePair(Kind k);

// Communicators derived from `comm` for vjpmpi's own use, cached on `comm` as MPI
// attributes (freed with it):
//  - kDuplicate: a private duplicate for vjpmpi's point-to-point traffic inside a
//    collective, so it never matches the user's messages on `comm`;
//  - kReversed: the same group with the ranks in reverse order (rank size-1-r), on
//    which scans run "from the last rank down" (the adjoint order of a scan).
// Creating one is collective: only call this from inside a collective that every
// rank of `comm` runs.
enum class Derived { kDuplicate, kReversed };
std::string DerivedComm(MPI_Comm comm, Derived kind, const char* op, MPI_Comm* out);

// The communicator a scan runs on: `c.comm`, or its reversed twin for c.reverse.
std::string OrderedComm(const Call& c, MPI_Comm* out);

// --------------------------------------------------------------- memory --
// (hugepages.cc) A large host buffer's whole 2 MiB pages on huge pages (MPI's
// shared-memory copies run about 3x faster there); host memory only.
// (hot path: the size test inline, the system calls in HugePagesOf)
inline constexpr size_t kHugePage = size_t{2} << 20;
void HugePagesOf(const void* buf, size_t n);
inline void HugePages(const void* buf, size_t n) {
  if (n >= 2 * kHugePage) HugePagesOf(buf, n);
}
// A copy of a block that another process reads next: large ones with streaming stores.
void StreamCopy(void* dst, const void* src, size_t n);

// The MPI library's version string (what the kernels resolved at load time).
std::string LibraryVersion();

}  // namespace vjpmpi
