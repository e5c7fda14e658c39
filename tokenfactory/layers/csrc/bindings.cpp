// The CPU kernels' Python module (cpu_kernels.h): torch/python.h (the Tensor casters, ~14 s of headers) rather
// than torch/extension.h (all of the C++ frontend too, ~23 s).
#include <torch/python.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Release the GIL like PyTorch's own ops: the server's event loop runs while the engine thread computes.
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start"), py::arg("scale"),
        py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start"), py::arg("scale"), py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("int4pack_dequantize_t", &int4pack_dequantize_t, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_kv", &rope_write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("rope_decode_attention", &rope_decode_attention, py::call_guard<py::gil_scoped_release>());
  m.def("q8act_linear", &q8act_linear, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("mins"),
        py::arg("q4"), py::arg("fast") = true, py::call_guard<py::gil_scoped_release>());
  m.def("q8act_fast_path", &q8act_fast_path);
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<const std::vector<torch::Tensor>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
                    const std::vector<int64_t>&, int64_t, int64_t, double, double, int64_t>())
      .def("run", &DecodePlan::run, py::call_guard<py::gil_scoped_release>())
      .def("run_logits", &DecodePlan::run_logits, py::call_guard<py::gil_scoped_release>())
      .def("set_head", &DecodePlan::set_head)
      .def("set_one_region", &DecodePlan::set_one_region)
      .def_property_readonly("num_layers", &DecodePlan::num_layers);
}
