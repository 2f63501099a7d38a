// CPU backend: XLA's buffers are host memory, handed to MPI as they are.
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <string>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // (Linux 6.1; older kernels answer EINVAL)
#endif

namespace vjpmpi {
struct Call;

// MPI's shared-memory copies of a large buffer run about 3x faster on huge pages, which
// NumPy asks for (so mpi4py's buffers have them) and XLA's allocator does not. A large
// buffer's whole 2 MiB pages are marked for huge pages and collapsed into them (Linux
// 6.1+; a no-op where they are huge already, as in the next calls of a loop on the same
// buffer; where the kernel refuses, nothing changes but the speed).
inline void UseHugePages(const void* buf, size_t n) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (n < 2 * kHuge) return;
  uintptr_t start = (reinterpret_cast<uintptr_t>(buf) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(buf) + n) & ~(kHuge - 1);
  if (end <= start) return;
  void* p = reinterpret_cast<void*>(start);
  madvise(p, end - start, MADV_HUGEPAGE);
  madvise(p, end - start, MADV_COLLAPSE);
}

struct HostMem {
  void Prepare(Call&) {}
  const void* In(const void* buf, size_t n) {
    UseHugePages(buf, n);
    return buf;
  }
  void* Out(void* buf, size_t n) {
    UseHugePages(buf, n);
    return buf;
  }
  std::string Begin() { return {}; }
  std::string End() { return {}; }
};
}  // namespace vjpmpi

// This module owns vjpmpi's one runtime (vjpmpi_runtime.h); the others attach to it.
#define VJPMPI_RUNTIME_OWNER
#define VJPMPI_CTX_BIND
#define VJPMPI_CTX_PARAMS_FIRST
#define VJPMPI_MEM HostMem{}
#define VJPMPI_HOST_ASYNC  // large calls run on a communicator thread (vjpmpi_async.h)
#include "vjpmpi_handlers.h"

NB_MODULE(_vjpmpi_cpu, m) {
  vjpmpi::DefineCommon(m);
  vjpmpi::DefineRuntime(m);
}
