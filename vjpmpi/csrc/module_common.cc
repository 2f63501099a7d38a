// What every backend module exports alike (module_common.h).
#include "module_common.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_set>

#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "mpi_ops.h"
#include "runtime.h"

namespace nb = nanobind;

#if defined(OPEN_MPI) && OPEN_MPI
#define VJPMPI_MPI_ABI "openmpi"
#elif defined(MPICH_VERSION)
#define VJPMPI_MPI_ABI "mpich"
#else
#define VJPMPI_MPI_ABI "unknown"
#endif

namespace vjpmpi {
namespace {

// Whether this thread is a Python thread (XLA's own worker threads are not).
bool PythonThread() { return PyGILState_GetThisThreadState() != nullptr; }

// Names passed to _guard_for_test, kept for the life of the process (the
// watchdog may read the name of the last call after it ended).
const char* Intern(const std::string& name) {
  static std::mutex mutex;
  static std::unordered_set<std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  return names.insert(name).first->c_str();
}

}  // namespace

void DefineCommon(nb::module_& m, std::vector<Registration> registrations) {
  SetPythonThreadTest(&PythonThread);
  m.def("registrations", [registrations]() {
    nb::dict d;
    for (const auto& [name, fn] : registrations) d[name] = nb::capsule(fn);
    return d;
  });
  // The MPI library these kernels resolved at load time (checked at import
  // against the one mpi4py loaded).
  m.def("library_version", &LibraryVersion);
  // The reduction names in code order (the `red` attribute is the position) and
  // the NumPy names of the supported dtypes: vjpmpi/_mpi.py builds its codes from them.
  m.def("reductions", &ReductionNames);
  m.def("dtypes", &KindNames);
  // Test views of the one runtime (in the core library, libvjpmpi_core.so, which every
  // backend module links): its address, a call site's text, and one guarded "call"
  // entered exactly as this module's handlers enter one (trace, call counter, overlap
  // counter, watchdog entry), without MPI.
  m.def("runtime_address", []() {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(&runtime));
  });
  m.def("_site_for_test", [](int64_t id) { return Site(runtime, id, ""); });
  m.def("_guard_for_test", [](const std::string& name, int64_t site) {
    Guard guard(runtime, Intern(name), site, MPI_COMM_NULL);
  });
  m.attr("abi") = nb::str(VJPMPI_MPI_ABI);
  m.attr("mpi_version") =
      nb::str((std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION)).c_str());
  m.attr("status_size") = nb::int_(static_cast<int64_t>(sizeof(MPI_Status)));
  // The jaxlib whose XLA FFI headers this module was compiled against.
  m.attr("jaxlib_headers") = nb::str(VJPMPI_JAXLIB_HEADERS);
}

}  // namespace vjpmpi
