// Host memory for MPI's shared-memory copies: huge pages and streamed copies.
#include <sys/mman.h>
#include <cstring>
#include "mpi_ops.h"

namespace vjpmpi {

#if defined(__x86_64__) || defined(_M_X64)
}  // namespace vjpmpi
#include <emmintrin.h>
#define VJPMPI_STREAM_STORES 1
namespace vjpmpi {
#endif

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // (Linux 6.1; older kernels answer EINVAL)
#endif


// MPI's shared-memory copies of a large buffer run about 3x faster on huge pages, which
// NumPy asks for (so mpi4py's buffers have them) and XLA's allocator does not. A large
// buffer's whole 2 MiB pages are marked for huge pages and collapsed into them (Linux
// 6.1+; a no-op where they are huge already, as in the next calls of a loop on the same
// buffer; where the kernel refuses, nothing changes but the speed). Host memory only.
void HugePagesOf(const void* buf, size_t n) {
  constexpr uintptr_t kHuge = kHugePage;
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

void StreamCopy(void* dst, const void* src, size_t n) {
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

}  // namespace vjpmpi
