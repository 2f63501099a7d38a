// The CUDA backend module (_vjpmpi_cuda): the same handlers on XLA's device buffers, in one of two modes.
//  - host-staged (default unless MPI is CUDA-aware): copy inputs device -> pinned
//    host buffers on XLA's stream, synchronise the stream, run the MPI call on the
//    host copies, copy outputs back and synchronise again (the pinned buffers are
//    reused by the next call);
//  - CUDA-aware: synchronise XLA's stream, then give MPI the device pointers
//    (local copies inside a collective use cudaMemcpy).
// Synchronising XLA's stream before MPI reads anything is what keeps a
// collective from reading data a preceding GPU kernel has not written yet.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "registrations.h"
#include "module_common.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"

namespace vjpmpi {
namespace {

// ------------------------------------------------------ CUDA-aware MPI --
// -1: not known (the MPI has no query), 0: no, 1: yes.
int QueryCudaAware() {
  using OmpiQuery = int (*)();
  using MpichQuery = int (*)(int, int*);
  if (auto q = reinterpret_cast<OmpiQuery>(dlsym(RTLD_DEFAULT, "MPIX_Query_cuda_support"))) {
    return q() ? 1 : 0;
  }
  if (auto q = reinterpret_cast<MpichQuery>(dlsym(RTLD_DEFAULT, "MPIX_GPU_query_support"))) {
    int yes = 0;
    if (q(/*MPIX_GPU_SUPPORT_CUDA*/ 0, &yes) == MPI_SUCCESS) return yes ? 1 : 0;
  }
  return -1;
}

// Mode: 0 host-staged, 1 CUDA-aware; chosen at configuration (VJPMPI_CUDA_AWARE).
std::atomic<int> cuda_mode{0};
std::string cuda_mode_error;

// setting: "auto" (use device pointers when MPI says it is CUDA-aware),
// "0" (always stage through host memory), "1" (require a CUDA-aware MPI).
std::string ConfigureCuda(const std::string& setting) {
  int aware = QueryCudaAware();
  cuda_mode_error.clear();
  if (setting == "1") {
    if (aware != 1) {
      cuda_mode_error = std::string("VJPMPI_CUDA_AWARE=1, but ") +
                        (aware == 0 ? "this MPI reports no CUDA support"
                                    : "this MPI cannot report CUDA support") +
                        " (MPIX_Query_cuda_support / MPIX_GPU_query_support); giving it device "
                        "pointers would crash. Unset it or set VJPMPI_CUDA_AWARE=0.";
      cuda_mode = 0;
      return cuda_mode_error;
    }
    cuda_mode = 1;
  } else if (setting == "0") {
    cuda_mode = 0;
  } else {
    cuda_mode = aware == 1 ? 1 : 0;
  }
  return {};
}

void DeviceCopy(void* dst, const void* src, size_t bytes) {
  cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
}

std::string CudaCheck(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return {};
  return std::string("vjpmpi (CUDA): ") + what + " failed: " + cudaGetErrorString(rc);
}

// Pinned host buffers, reused across calls (calls run one at a time).
struct Pinned {
  void* ptr = nullptr;
  size_t bytes = 0;
};
std::mutex pinned_mutex;
std::vector<Pinned> pinned(3);

// The memory policy of one call. `Shared` (the one-device calls): the module's pinned
// buffers, held by the call until it ends (calls run one at a time). Else (device calls,
// devices.h: every device of a program calls at once, and a group's calls wait for each
// other): each device thread's own pinned buffers, and always host-staged (a group's
// first device reads the others' buffers on the host).
template <bool Shared>
struct CudaMemT {
  cudaStream_t stream;
  bool aware = Shared && cuda_mode.load() == 1;
  struct Slot {
    const void* dev;
    void* host;
    size_t bytes;
    bool out;
  };
  std::vector<Slot> slots;
  std::string error;
  std::unique_lock<std::mutex> lock{pinned_mutex, std::defer_lock};

  explicit CudaMemT(cudaStream_t s) : stream(s) {}

  static std::vector<Pinned>& Pool() {
    if constexpr (Shared) {
      return pinned;
    } else {
      static thread_local std::vector<Pinned> own(3);
      return own;
    }
  }

  void Prepare(Call& c) {
    if (!cuda_mode_error.empty()) error = cuda_mode_error;
    // vjpmpi's own reductions (float16/bfloat16, float MAX/MIN, the recurrence's
    // pairs) are host functions: stage those.
    if (aware && (OwnOp(c.red, c.kind) || c.host_op)) aware = false;
    if (aware) {
      c.device = true;
      c.copy = &DeviceCopy;
    }
  }

  void* Stage(const void* dev, size_t bytes, bool out) {
    for (Slot& s : slots) {
      if (s.dev == dev) {
        s.out = s.out || out;
        return s.host;
      }
    }
    if (Shared && !lock.owns_lock()) lock.lock();
    std::vector<Pinned>& pool = Pool();
    size_t i = slots.size();
    if (i >= pool.size()) pool.resize(i + 1);
    Pinned& p = pool[i];
    if (p.bytes < bytes) {
      if (p.ptr) cudaFreeHost(p.ptr);
      p.ptr = nullptr;
      p.bytes = 0;
      std::string e = CudaCheck(cudaMallocHost(&p.ptr, bytes > 0 ? bytes : 1), "cudaMallocHost");
      if (!e.empty()) {
        error = e;
        return nullptr;
      }
      p.bytes = bytes;
    }
    slots.push_back({dev, p.ptr, bytes, out});
    return p.ptr;
  }

  const void* In(const void* dev, size_t bytes) {
    if (aware || !error.empty()) return dev;
    void* host = Stage(dev, bytes, false);
    if (host && bytes) {
      std::string e = CudaCheck(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream),
                                "cudaMemcpyAsync (device to host)");
      if (!e.empty()) error = e;
    }
    return host;
  }

  void* Out(void* dev, size_t bytes) {
    if (aware || !error.empty()) return dev;
    return Stage(dev, bytes, true);
  }

  std::string Begin() {
    if (!error.empty()) return error;
    return CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  std::string End() {
    if (aware || !error.empty()) return error;
    for (const Slot& s : slots) {
      if (!s.out || s.bytes == 0) continue;
      std::string e = CudaCheck(
          cudaMemcpyAsync(const_cast<void*>(s.dev), s.host, s.bytes, cudaMemcpyHostToDevice,
                          stream),
          "cudaMemcpyAsync (host to device)");
      if (!e.empty()) return e;
    }
    // the pinned buffers are reused by the next call: wait for the copies
    return CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  // (device to device, in the stream's order)
  std::string Copy(void* dst, const void* src, size_t n) {
    return CudaCheck(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync (device to device)");
  }
};

using CudaMem = CudaMemT<true>;
using CudaDevMem = CudaMemT<false>;

struct CudaBackend {
  static constexpr bool kAsync = false;  // a handler returns when its MPI call has
  using Ctx = ffi::PlatformStream<cudaStream_t>;
  using Mem = CudaMem;
  using DevMem = CudaDevMem;  // (device calls: devices.h)
  static Mem MakeMem(cudaStream_t stream) { return CudaMem(stream); }
  static DevMem MakeDevMem(cudaStream_t stream) { return CudaDevMem(stream); }
};

}  // namespace
}  // namespace vjpmpi

// The CUDA backend module: its handlers use the one runtime of the core library
// (libvjpmpi_core.so), which _vjpmpi_cpu's Python interface configures.
NB_MODULE(_vjpmpi_cuda, m) {
  vjpmpi::DefineCommon(m, vjpmpi::Registrations<vjpmpi::CudaBackend>());
  // configure_cuda("auto" | "0" | "1") -> "" or the error every call will report
  m.def("configure_cuda", &vjpmpi::ConfigureCuda);
  m.def("cuda_aware_query", &vjpmpi::QueryCudaAware);
  m.def("cuda_mode", []() { return vjpmpi::cuda_mode.load() == 1 ? "cuda-aware" : "host-staged"; });
}
