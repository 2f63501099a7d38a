// What every backend module (_vjpmpi_cpu, _vjpmpi_cuda) exports alike (module layer,
// module_common.cc, compiled into each module): its handlers, the tables Python builds
// its codes from, the MPI library's identity, and test views of the one runtime.
#pragma once

#include <utility>
#include <vector>

#include "nanobind/nanobind.h"

namespace vjpmpi {

// (name, XLA_FFI_Handler*), as registrations.h's Registrations<B>() lists them.
using Registration = std::pair<const char*, void*>;

// Also gives the core library its test of a Python thread (runtime.h, OnPythonThread).
void DefineCommon(nanobind::module_& m, std::vector<Registration> registrations);

}  // namespace vjpmpi
