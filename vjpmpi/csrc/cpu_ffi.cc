// CPU backend: XLA's buffers are host memory, handed to MPI as they are (large ones on
// huge pages: HugePages, vjpmpi_mpi.h).
#include <cstddef>
#include <cstdint>
#include <string>

#include "vjpmpi_mpi.h"

namespace vjpmpi {

struct HostMem {
  void Prepare(Call&) {}
  const void* In(const void* buf, size_t n) {
    HugePages(buf, n);
    return buf;
  }
  void* Out(void* buf, size_t n) {
    HugePages(buf, n);
    return buf;
  }
  std::string Begin() { return {}; }
  std::string End() { return {}; }
  std::string Copy(void* dst, const void* src, size_t n) {
    HostCopy(dst, src, n);
    return {};
  }
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
