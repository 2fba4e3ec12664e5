// A Python torch.nn.Module as a RoundPipe layer. The device workers run its
// forward under the GIL (on a structural copy bound to device tensors);
// everything else (uploads, backward, the optimizer) runs without it.
#pragma once

#include "pytree.h"
#include "roundpipe/layer.h"

namespace roundpipe::python {

class PyModuleLayer final : public Layer {
 public:
  // takes_call_arguments: the layer is layer 0 and gets the user's call as
  // the pair (args tuple, kwargs dict), which it unpacks into module(*args,
  // **kwargs); later layers get the previous output as their one argument.
  PyModuleLayer(py::object module, bool takes_call_arguments);

  std::string type_name() const override { return type_name_; }
  std::vector<at::Tensor> parameters() const override { return params_; }
  std::vector<at::Tensor> buffers() const override { return buffers_; }
  std::vector<std::string> parameter_names() const override { return param_names_; }
  std::vector<std::string> buffer_names() const override { return buffer_names_; }
  void set_parameter_data(size_t i, const at::Tensor& data) override;
  bool is_training() const override;
  std::unique_ptr<LayerInstance> make_instance() override;
  bool meterable() const override { return false; }  // Python may use the profiler

 private:
  std::unique_ptr<LayerInstance> make_instance_with_gil();
  PyRef module_;
  bool takes_call_arguments_;
  std::string type_name_;
  std::vector<at::Tensor> params_, buffers_;
  std::vector<std::string> param_names_, buffer_names_;
};

}  // namespace roundpipe::python
