// Shared MPI layer of the vjpmpi kernels: handle conversion, dtype and reduction
// mapping (with user-defined ops for float16/bfloat16), error strings, and one
// function per MPI call shape working on plain host pointers.  A backend file
// (cpu_ffi.cc, cuda_ffi.cc) binds XLA FFI buffers to these functions.
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <sys/mman.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define VJPMPI_STREAM_STORES 1
#endif

#include <algorithm>
#include <iterator>
#include <climits>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // (Linux 6.1; older kernels answer EINVAL)
#endif

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
inline std::vector<std::string> ReductionNames() {
  return {
#define VJPMPI_X(e, name) #name,
      VJPMPI_REDUCTIONS(VJPMPI_X)
#undef VJPMPI_X
  };
}

enum class Kind {
#define VJPMPI_X(e, name, xla, mpi, bytes) e,
  VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
  kUnsupported
};

// NumPy names of the element kinds the kernels support, in Kind order.
inline std::vector<std::string> KindNames() {
  return {
#define VJPMPI_X(e, name, xla, mpi, bytes) #name,
      VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
  };
}

// ---------------------------------------------------- float16 / bfloat16 --
inline float HalfToFloat(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // overflow
  if (absx < 0x38800000u) {  // result is subnormal or zero
    if (absx < 0x33000000u) return (uint16_t)sign;
    uint32_t e = absx >> 23;
    uint32_t man = (absx & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (113 - e) - 1
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t half = ((absx - 0x38000000u) >> 13);
  uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return (uint16_t)(sign | half);
}

inline float BF16ToFloat(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return (uint16_t)(x >> 16);
}

// vjpmpi's own reductions, as user-defined MPI ops: SUM, PROD, MAX and MIN of
// float16 and bfloat16 (which travel as 16-bit words and are combined in float),
// and MAX and MIN of float32 and float64, where MPI's built-in ops keep or drop a
// NaN depending on the order of the operands (so the ranks of one allreduce could
// disagree). MAX and MIN give NaN wherever an operand is NaN, as jnp.max and
// jnp.min do, identically on every rank.
template <Red R, typename T>
T Combine(T x, T y) {
  if constexpr (R == Red::kSum) return x + y;
  else if constexpr (R == Red::kProd) return x * y;
  else if constexpr (R == Red::kMax) return (x != x || y != y) ? x + y : (x > y ? x : y);
  else return (x != x || y != y) ? x + y : (x < y ? x : y);
}

template <uint16_t (*ToBits)(float), float (*FromBits)(uint16_t), Red R>
void HalfReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = ToBits(Combine<R>(FromBits(a[i]), FromBits(b[i])));
}

template <typename T, Red R>
void PlainReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Combine<R>(a[i], b[i]);
}

// Whether (r, k) reduces with one of vjpmpi's own (int-count) user functions.
inline bool OwnOp(Red r, Kind k) {
  if (k == Kind::kF16 || k == Kind::kBF16) return static_cast<int>(r) <= static_cast<int>(Red::kMin);
  return (k == Kind::kF32 || k == Kind::kF64) && (r == Red::kMax || r == Red::kMin);
}

// The own ops, made once after MPI_Init; indexed by kind (float16, bfloat16,
// float32, float64) and the code of SUM, PROD, MAX, MIN (the first four).
static_assert(static_cast<int>(Red::kSum) == 0 && static_cast<int>(Red::kProd) == 1 &&
                  static_cast<int>(Red::kMax) == 2 && static_cast<int>(Red::kMin) == 3,
              "OwnOperation expects SUM, PROD, MAX, MIN to be codes 0-3");
template <Red R>
void Create(MPI_Op (&row)[4][4]) {
  constexpr int i = static_cast<int>(R);
  MPI_Op_create(&HalfReduce<FloatToHalf, HalfToFloat, R>, 1, &row[0][i]);
  MPI_Op_create(&HalfReduce<FloatToBF16, BF16ToFloat, R>, 1, &row[1][i]);
  if constexpr (R == Red::kMax || R == Red::kMin) {
    MPI_Op_create(&PlainReduce<float, R>, 1, &row[2][i]);
    MPI_Op_create(&PlainReduce<double, R>, 1, &row[3][i]);
  }
}

inline MPI_Op OwnOperation(Red r, Kind k) {
  static std::once_flag once;
  static MPI_Op ops[4][4];
  std::call_once(once, [] {
    Create<Red::kSum>(ops);
    Create<Red::kProd>(ops);
    Create<Red::kMax>(ops);
    Create<Red::kMin>(ops);
  });
  int kind = k == Kind::kF16 ? 0 : k == Kind::kBF16 ? 1 : k == Kind::kF32 ? 2 : 3;
  return ops[kind][static_cast<int>(r)];
}

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
inline MPI_Op Operation(Red r, Kind k) {
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

inline void FillIdentity(void* buf, size_t n, Kind k, Red r) {
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
inline std::string Check(int rc, const char* op, const char* what) {
  if (rc == MPI_SUCCESS) return {};
  char msg[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
  msg[len] = '\0';
  return std::string("vjpmpi.") + op + ": " + what + " failed: " + msg;
}

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

inline const char* KindName(Kind k) {
  switch (k) {
#define VJPMPI_X(e, name, xla, mpi, bytes) \
  case Kind::e:                            \
    return #name;
    VJPMPI_KINDS(VJPMPI_X)
#undef VJPMPI_X
    default: return "unsupported";
  }
}

// A collective call on host pointers; `count` is the element count of one
// block (the whole local array for elementwise ops, one rank's block for the
// gather/scatter family).  `send == recv` means in place.
inline void HostCopy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

inline constexpr int kMaxDims = 8;

// `ndim` dimensions into `out` (kMaxDims of them; more: the last one hashes the rest).
inline void PackDims(const int64_t* dims, int ndim, int64_t* out, int32_t* out_ndim) {
  for (int i = 0; i < kMaxDims; ++i) out[i] = i < ndim ? dims[i] : 0;
  if (ndim > kMaxDims) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = kMaxDims - 1; i < ndim; ++i) h = (h ^ static_cast<uint64_t>(dims[i])) * 1099511628211ULL;
    out[kMaxDims - 1] = static_cast<int64_t>(h);
  }
  *out_ndim = ndim;
}

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
  int64_t site = 0;        // call-site hash (its text: the runtime's registry), or 0
  std::string (*site_text)(int64_t) = nullptr;
  // Memory the buffers live in: host (default), or device memory handed to a
  // CUDA-aware MPI, where local copies go through `copy` (cudaMemcpy).
  void (*copy)(void* dst, const void* src, size_t bytes) = &HostCopy;
  bool device = false;
};

inline int Rank(MPI_Comm c) { int r = 0; MPI_Comm_rank(c, &r); return r; }

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

inline std::string Allreduce(const Call& c, const void* send, void* recv) {
  return VJPMPI_ELEMENTWISE(MPI_Allreduce, c.comm);
}

inline std::string Reduce(const Call& c, const void* send, void* recv) {
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

inline std::string Bcast(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  if (send != recv && Rank(c.comm) == c.root) c.copy(recv, send, c.count * ByteSize(c.kind));
  MPI_Datatype t = Datatype(c.kind);
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Bcast, recv, n, t, c.root, c.comm), c.op,
               "MPI_Bcast");
}

inline std::string Allgather(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Allgather, send, n, t, recv, n, t, c.comm), c.op,
               "MPI_Allgather");
}

inline std::string Gather(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op);
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  bool root = Rank(c.comm) == c.root;
  if (!root && send != recv) c.copy(recv, send, c.count * ByteSize(c.kind));
  void* r = root ? recv : nullptr;
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Gather, send, n, t, r, n, t, c.root, c.comm), c.op,
               "MPI_Gather");
}

inline std::string Scatter(const Call& c, const void* send, void* recv) {
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
enum class Derived { kDuplicate, kReversed };

inline int FreeDerived(MPI_Comm, int, void* attr, void*) {
  MPI_Comm* derived = static_cast<MPI_Comm*>(attr);
  MPI_Comm_free(derived);
  delete derived;
  return MPI_SUCCESS;
}

inline std::string DerivedComm(MPI_Comm comm, Derived kind, const char* op, MPI_Comm* out) {
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
inline std::string OrderedComm(const Call& c, MPI_Comm* out) {
  if (!c.reverse) {
    *out = c.comm;
    return {};
  }
  return DerivedComm(c.comm, Derived::kReversed, c.op, out);
}

// MPI's shared-memory copies of a large buffer run about 3x faster on huge pages, which
// NumPy asks for (so mpi4py's buffers have them) and XLA's allocator does not. A large
// buffer's whole 2 MiB pages are marked for huge pages and collapsed into them (Linux
// 6.1+; a no-op where they are huge already, as in the next calls of a loop on the same
// buffer; where the kernel refuses, nothing changes but the speed). Host memory only.
inline void HugePages(const void* buf, size_t n) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (n < 2 * kHuge) return;
  uintptr_t start = (reinterpret_cast<uintptr_t>(buf) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(buf) + n) & ~(kHuge - 1);
  if (end <= start) return;
  void* p = reinterpret_cast<void*>(start);
  madvise(p, end - start, MADV_HUGEPAGE);
  madvise(p, end - start, MADV_COLLAPSE);
}

// A copy of a block that another process reads next (by CMA): from `kStreamBytes` on,
// into 16-byte-aligned memory, written with non-temporal stores, so that the reader takes
// it from memory rather than from the writing core's cache. Where the two ranks' cores
// sit on different cache domains of the host (a cache line's round trip 4x longer), a
// plain copy made the 16 MiB alltoall 1.3-1.8x slower than MPI_Alltoall out of place;
// streamed, 0.56-1.03x in 90 trials of both placements.
constexpr size_t kStreamBytes = size_t{4} << 20;

inline void StreamCopy(void* dst, const void* src, size_t n) {
#ifdef VJPMPI_STREAM_STORES
  if (n >= kStreamBytes && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    auto* d = static_cast<unsigned char*>(dst);
    auto* s = static_cast<const unsigned char*>(src);
    size_t body = n & ~size_t{63};
    for (size_t i = 0; i < body; i += 16) {  // whole 64-byte lines, 16 bytes at a time
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), v);
    }
    _mm_sfence();
    std::memcpy(d + body, s + body, n - body);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// In-place alltoall on a power-of-two communicator: in round k swap block
// `rank ^ k` with that rank, through one block of scratch. Moves the same bytes
// as an out-of-place alltoall; MPICH's MPI_IN_PLACE algorithm copies each block
// twice more and ran 1.3-1.6x slower on 16-128 MiB.
inline std::string AlltoallPairwise(const Call& c, void* buf, int size) {
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

inline std::string Alltoall(const Call& c, const void* send, void* recv) {
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

inline std::string ReduceScatter(const Call& c, const void* send, void* recv) {
  auto e = CountCheck(c.count, c.op, OwnOp(c.red, c.kind));
  if (!e.empty()) return e;
  MPI_Datatype t = Datatype(c.kind);
  MPI_Op op = Operation(c.red, c.kind);
  return Check(VJPMPI_BY_COUNT(c.count, MPI_Reduce_scatter_block, send, recv, n, t, op, c.comm),
               c.op, "MPI_Reduce_scatter_block");
}

inline std::string Scan(const Call& c, const void* send, void* recv) {
  return VJPMPI_ELEMENTWISE(MPI_Scan, c.comm);
}

// Exscan in rank order, or (c.reverse) from the last rank down; the first rank
// of that order receives the identity of the reduction.
inline std::string Exscan(const Call& c, const void* send, void* recv) {
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
inline std::string OthersProduct(const Call& c, const void* x, void* out) {
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

// ------------------------------------------------ linear recurrence scan --
// Recurrence(a, b): e_s = sum over the ranks q before s of b_q * prod_{q < r < s} a_r,
// element-wise, "before" in rank order (or, for c.reverse, from the last rank down);
// 0 on the first rank. It is the exclusive scan of the affine maps z -> a_r z + b_r
// under composition, (a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2): associative, not
// commutative, so MPI applies it in rank order. Each element travels as an (a, b)
// pair; float16/bfloat16 compute in float.
template <typename T>
struct Plain {
  using F = T;
  static F Load(T v) { return v; }
  static T Store(F v) { return v; }
};
template <float (*From)(uint16_t), uint16_t (*To)(float)>
struct Half16 {
  using F = float;
  static F Load(uint16_t v) { return From(v); }
  static uint16_t Store(F v) { return To(v); }
};

template <typename T, typename A>
void ComposeAffine(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* u = static_cast<const T*>(in);
  T* v = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    auto a1 = A::Load(u[2 * i]), b1 = A::Load(u[2 * i + 1]);
    auto a2 = A::Load(v[2 * i]), b2 = A::Load(v[2 * i + 1]);
    v[2 * i] = A::Store(a1 * a2);
    v[2 * i + 1] = A::Store(a2 * b1 + b2);
  }
}

// The (a, b) pair datatype and the composition op of a floating kind, made once
// after MPI_Init; {MPI_DATATYPE_NULL, MPI_OP_NULL} for the other kinds.
struct PairOp {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
};

inline PairOp AffinePair(Kind k) {
  static std::once_flag once;
  static PairOp pairs[static_cast<int>(Kind::kUnsupported)];
  std::call_once(once, [] {
    auto make = [](Kind kind, MPI_User_function* fn) {
      PairOp& p = pairs[static_cast<int>(kind)];
      MPI_Type_contiguous(2, Datatype(kind), &p.type);
      MPI_Type_commit(&p.type);
      MPI_Op_create(fn, /*commute=*/0, &p.op);
    };
    make(Kind::kF16, &ComposeAffine<uint16_t, Half16<HalfToFloat, FloatToHalf>>);
    make(Kind::kBF16, &ComposeAffine<uint16_t, Half16<BF16ToFloat, FloatToBF16>>);
    make(Kind::kF32, &ComposeAffine<float, Plain<float>>);
    make(Kind::kF64, &ComposeAffine<double, Plain<double>>);
    make(Kind::kC64, &ComposeAffine<std::complex<float>, Plain<std::complex<float>>>);
    make(Kind::kC128, &ComposeAffine<std::complex<double>, Plain<std::complex<double>>>);
  });
  return k == Kind::kUnsupported ? PairOp{} : pairs[static_cast<int>(k)];
}

inline std::string Recurrence(const Call& c, const void* a, const void* b, void* out) {
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

inline P2PHeader MakeHeader(const Call& c, const int64_t* dims, int ndim) {
  P2PHeader h{};
  h.kind = static_cast<int32_t>(c.kind);
  h.count = 1;
  for (int i = 0; i < ndim; ++i) h.count *= dims[i];
  PackDims(dims, ndim, h.dims, &h.ndim);
  h.site = c.site;
  if (c.site && c.site_text) std::snprintf(h.site_text, sizeof(h.site_text), "%s", c.site_text(c.site).c_str());
  return h;
}

inline std::string ShapeText(int32_t kind, const int64_t* dims, int ndim) {
  std::string s = std::string(KindName(static_cast<Kind>(kind))) + "[";
  for (int i = 0; i < ndim && i < kMaxDims; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (ndim > kMaxDims ? ", ...]" : "]");
}

inline std::string SiteSuffix(const char* text) {
  return text[0] ? std::string(" (") + text + ")" : std::string();
}

// "" if what arrived (`got`, from `source` with `tag`) matches this rank's template.
inline std::string CompareHeader(const Call& c, const P2PHeader& got, int source, int tag) {
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
inline std::string Drain(const Call& c, const void* send, int source, int tag) {
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

inline std::string Send(const Call& c, const void* send, void*) {
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
inline std::string ReceivedAll(const Call& c, const MPI_Status& st, size_t want) {
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
inline std::string ReceiveError(const Call& c, int rc, const MPI_Status& st, const char* fn) {
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
inline std::string ReceiveHeader(const Call& c, const void* send, int* source, int* tag) {
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

inline std::string Recv(const Call& c, const void*, void* recv) {
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

inline std::string Sendrecv(const Call& c, const void* send, void* recv) {
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
inline std::string Post(const Call& c, const void* send, void* recv, Posted* p) {
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
inline std::string TestPosted(const Call& c, Posted* p, bool* done) {
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

// Agree: no data moves; the call is there for the ranks' agreement alone (vjpmpi_agree.h),
// which compares what every rank passes (a zero-size array whose shape and dtype are a
// composite's global array: vjpmpi.fft), so that ranks that disagree, or a rank that
// refuses its arguments, fail together.
inline std::string AgreeOnly(const Call&, const void*, void*) { return {}; }

inline std::string Barrier(const Call& c, const void*, void*) {
  return Check(MPI_Barrier(c.comm), c.op, "MPI_Barrier");
}

}  // namespace vjpmpi
