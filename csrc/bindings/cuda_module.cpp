// pybind11 bindings of torch_afdep's CUDA path (torch_afdep._cuda). No torch headers: tensors
// travel as raw device pointers (Python ints), streams as cudaStream_t ints.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include "afdep/comm.h"
#include "afdep/forms.h"
#include "afdep/launch.h"

namespace py = pybind11;
using afdep::Comm;
using afdep::CommConfig;

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "torch_afdep CUDA transport and kernels (CUDA IPC, one NVLink domain)";
  // Every protocol control bit by name, as a dict and (older callers) one attribute each;
  // both come from layout.h's one list, AFDEP_CONTROL_FLAGS.
  py::dict control_bits;
#define AFDEP_CONTROL_EXPORT(name, bit)                  \
  control_bits[#name] = static_cast<int>(afdep::F_##name); \
  m.attr(#name) = static_cast<int>(afdep::F_##name);
  AFDEP_CONTROL_FLAGS(AFDEP_CONTROL_EXPORT)
#undef AFDEP_CONTROL_EXPORT
  m.attr("CONTROL_BITS") = control_bits;
  m.attr("ALL_ROLE_AWARE") = static_cast<int>(afdep::kAllRoleAware);
  m.attr("ROUTE_BUCKET_MISMATCH") = static_cast<int>(afdep::kRouteBucket);

  // Every kernel form's value by name (forms.h's one list, AFDEP_KERNEL_FORMS): what
  // Comm.last_forms() reports
  py::dict kernel_forms;
#define AFDEP_FORM_EXPORT(name, value) kernel_forms[#name] = static_cast<int>(afdep::name);
  AFDEP_KERNEL_FORMS(AFDEP_FORM_EXPORT)
#undef AFDEP_FORM_EXPORT
  m.attr("KERNEL_FORMS") = kernel_forms;

  m.attr("TRACE_RING") = afdep::kTraceRing;
  m.attr("TRACE_POINTS") = afdep::kTracePts;
  // Diagnostics (benchmarks.trace): one thread writes %globaltimer ns to the device address
  // `out` (8 bytes) on `stream`, in order with the stream's other work.
  m.def("stamp", [](uint64_t out, uint64_t stream) {
    const cudaError_t e = afdep::launch_stamp(reinterpret_cast<uint64_t*>(out),
                                              reinterpret_cast<cudaStream_t>(stream));
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("torch_afdep CUDA: stamp: ") + cudaGetErrorString(e));
  });
  // Diagnostics: %globaltimer's resolution, by one thread reading it `reads` times; writes
  // three uint64 to the device address `out`: smallest step (ns), steps seen, span (ns).
  m.def("timer_step", [](uint64_t out, int reads, uint64_t stream) {
    if (reads < 1) throw std::invalid_argument("timer_step: reads must be >= 1");
    const cudaError_t e = afdep::launch_timer_step(reinterpret_cast<uint64_t*>(out), reads,
                                                   reinterpret_cast<cudaStream_t>(stream));
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("torch_afdep CUDA: timer_step: ") +
                               cudaGetErrorString(e));
  });
  m.def("runtime_version", []() {
    int v = 0;
    cudaRuntimeGetVersion(&v);
    return v;
  });
  // NCCL the extension was built against (0: built without NCCL) and the one loaded.
  m.attr("NCCL_VERSION_CODE") = afdep::nccl_header_version();
  m.def("nccl_runtime_version", []() { return afdep::nccl_runtime_version(); });
  m.def("device_count", []() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
  });

  py::class_<Comm>(m, "Comm")
      .def(py::init([](int rank, int device, std::vector<int> is_ffn, int num_sms, int hidden,
                       int elem, int scale_cols, int num_experts, int top_k, int capacity,
                       double timeout_s, unsigned flags, int ffn_ctas, int attn_ctas,
                       std::string transport, bool trace, int debug, bool token_layout) {
             CommConfig c;
             c.rank = rank;
             c.device = device;
             c.is_ffn = std::move(is_ffn);
             c.num_sms = num_sms;
             c.hidden = hidden;
             c.elem = elem;
             c.scale_cols = scale_cols;
             c.num_experts = num_experts;
             c.top_k = top_k;
             c.capacity = capacity;
             c.timeout_s = timeout_s;
             c.flags = flags;
             c.ffn_ctas = ffn_ctas;
             c.attn_ctas = attn_ctas;
             c.transport = std::move(transport);
             c.trace = trace;
             c.debug = debug;
             c.token_layout = token_layout;
             return new Comm(c);
           }),
           py::arg("rank"), py::arg("device"), py::arg("is_ffn"), py::arg("num_sms"),
           py::arg("hidden"), py::arg("elem"), py::arg("scale_cols"), py::arg("num_experts"),
           py::arg("top_k"), py::arg("capacity"), py::arg("timeout_s"), py::arg("flags"),
           py::arg("ffn_ctas") = 24, py::arg("attn_ctas") = 24, py::arg("transport") = "ipc",
           py::arg("trace") = false, py::arg("debug") = 0, py::arg("token_layout") = false)
      .def("local_handle", [](Comm& c) { return py::bytes(c.local_handle()); })
      .def("open",
           [](Comm& c, const std::vector<py::bytes>& hs) {
             std::vector<std::string> v;
             for (const auto& h : hs) v.emplace_back(std::string(h));
             c.open(v);
           })
      .def_property_readonly("registered_bytes", &Comm::registered_bytes)
      .def_property_readonly("union_bytes", &Comm::union_bytes)
      .def_property_readonly("ffn_grid", &Comm::ffn_grid)
      .def_property_readonly("attn_grid", &Comm::attn_grid)
      .def_property_readonly("signal_bytes", [](const Comm& c) { return c.layout().signal_bytes; })
      .def("dispatch", &Comm::dispatch, py::arg("x"), py::arg("x_scales"), py::arg("expert_ids"),
           py::arg("ids_64"), py::arg("weights"), py::arg("route"), py::arg("T"),
           py::arg("stream"), py::arg("bucket") = 0, py::call_guard<py::gil_scoped_release>())
      .def("receive", &Comm::receive, py::call_guard<py::gil_scoped_release>())
      .def("reply", &Comm::reply, py::call_guard<py::gil_scoped_release>())
      .def("receive_tokens", &Comm::receive_tokens, py::arg("bucket"), py::arg("expert_ids"),
           py::arg("weights"), py::arg("src_rank"), py::arg("src_token"), py::arg("num_tokens"),
           py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("reply_tokens", &Comm::reply_tokens, py::arg("bucket"), py::arg("rows"),
           py::arg("src_token"), py::arg("num_tokens"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>())
      .def("token_view_ptrs", &Comm::token_view_ptrs)
      .def("combine", &Comm::combine, py::call_guard<py::gil_scoped_release>())
      .def("combine_in_place", &Comm::combine_in_place, py::call_guard<py::gil_scoped_release>())
      .def("view_ptr", &Comm::view_ptr)
      .def("ping", &Comm::ping, py::call_guard<py::gil_scoped_release>())
      .def("poll_error",
           [](Comm& c, bool clear) {
             auto e = c.poll_error(clear);
             py::dict d;
             d["timeout"] = e.timeout;
             d["phase"] = e.phase;
             d["peer"] = e.peer;
             d["rank"] = e.rank;
             d["route"] = e.route;
             d["route_kind"] = e.route_kind;
             d["route_bad_id"] = e.route_bad_id;
             d["route_peer"] = e.route_peer;
             d["route_own"] = e.route_own;
             return d;
           },
           py::arg("clear") = true)
      .def("trace", &Comm::trace)
      .def("last_forms", &Comm::last_forms)
      .def_property_readonly("transport_name", &Comm::transport_name)
      .def("close", &Comm::close, py::arg("clean") = true);
}
