// float16 / bfloat16 conversions, vjpmpi's own reductions as user-defined MPI ops
// (OwnOperation), and the recurrence's (a, b) pair ops (AffinePair). mpi_ops.h declares them.
#include <complex>
#include <cstring>
#include <mutex>
#include "mpi_ops.h"

namespace vjpmpi {

float HalfToFloat(uint16_t h) {
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

uint16_t FloatToHalf(float f) {  // round to nearest even
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

float BF16ToFloat(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBF16(float f) {
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

MPI_Op OwnOperation(Red r, Kind k) {
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

// (made once after MPI_Init)
PairOp AffinePair(Kind k) {
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

}  // namespace vjpmpi
