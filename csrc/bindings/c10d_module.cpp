// pybind11 module of the "afdep" c10d backend (torch_afdep._C); the class is in
// csrc/c10d/backend.h.
#include <torch/extension.h>
#include <torch/version.h>

#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "c10d/backend.h"

namespace {

#define AFDEP_STR_INNER(x) #x
#define AFDEP_STR(x) AFDEP_STR_INNER(x)
// "MAJOR.MINOR.PATCH" of the torch headers this module was compiled against.
constexpr const char* kTorchVersion = AFDEP_STR(TORCH_VERSION_MAJOR) "." AFDEP_STR(
    TORCH_VERSION_MINOR) "." AFDEP_STR(TORCH_VERSION_PATCH);

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_afdep._C: the 'afdep' c10d backend";
  // Registers torch's python Backend type, the base class below.
  py::module_::import("torch.distributed");

  m.attr("TORCH_VERSION") = py::str(kTorchVersion);

  m.def(
      "invalid_reason",
      [](int rank,
         int size,
         const std::vector<std::string>& roles,
         const afdep::BackendPtr& cpuInner,
         std::optional<afdep::BackendPtr> cudaInner) {
        afdep::BackendPtr cuda;
        if (cudaInner.has_value()) {
          cuda = std::move(*cudaInner);
        }
        return afdep::AfdepBackend::invalidReason(rank, size, roles, cpuInner, cuda);
      },
      "Why AfdepBackend(rank, size, roles, cpu_inner, cuda_inner) would be invalid, "
      "or '' when it is valid.",
      py::arg("rank"),
      py::arg("size"),
      py::arg("roles"),
      py::arg("cpu_inner"),
      py::arg("cuda_inner") = py::none());

  py::class_<
      afdep::AfdepBackend,
      c10d::Backend,
      c10::intrusive_ptr<afdep::AfdepBackend>>(
      m,
      "AfdepBackend",
      R"(c10d backend that knows every rank's AFD role and delegates collectives:
ops on CUDA tensors go to cuda_inner (NCCL), all others to cpu_inner (gloo).)")
      .def(
          py::init([](int rank,
                      int size,
                      std::vector<std::string> roles,
                      afdep::BackendPtr cpuInner,
                      std::optional<afdep::BackendPtr> cudaInner) {
            afdep::BackendPtr cuda;
            if (cudaInner.has_value()) {
              cuda = std::move(*cudaInner);
            }
            return c10::make_intrusive<afdep::AfdepBackend>(
                rank, size, std::move(roles), std::move(cpuInner), std::move(cuda));
          }),
          py::arg("rank"),
          py::arg("size"),
          py::arg("roles"),
          py::arg("cpu_inner"),
          py::arg("cuda_inner") = py::none())
      .def(
          "check",
          &afdep::AfdepBackend::check,
          "Raise ValueError if the constructor's arguments were invalid.")
      .def(
          "roles",
          [](const afdep::AfdepBackend& self) { return self.roles(); },
          "Role ('attention' or 'ffn') of every group rank.")
      .def(
          "role",
          [](const afdep::AfdepBackend& self) { return self.role(); },
          "Role of this rank.")
      .def(
          "cpu_inner",
          &afdep::AfdepBackend::cpuInner,
          "The backend that runs collectives on CPU tensors (gloo).")
      .def(
          "cuda_inner",
          [](const afdep::AfdepBackend& self) -> py::object {
            auto inner = self.cudaInner();
            if (!inner) {
              return py::none();
            }
            return py::cast(inner);
          },
          "The backend that runs collectives on CUDA tensors (NCCL), or None.")
      .def("__repr__", [](const afdep::AfdepBackend& self) {
        std::string s = "AfdepBackend(rank=" + std::to_string(self.getRank()) +
            ", size=" + std::to_string(self.getSize()) + ", roles=[";
        for (size_t i = 0; i < self.roles().size(); ++i) {
          s += (i ? ", '" : "'") + self.roles()[i] + "'";
        }
        s += std::string("], cuda_inner=") + (self.cudaInner() ? "yes" : "no") +
            ")";
        return s;
      });
}
