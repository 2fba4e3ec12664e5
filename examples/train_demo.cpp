// roundpipe-demo: trains a small MLP regressor through RoundPipe on whatever
// devices exist (simulated ones on a CPU-only machine) and prints the loss
// falling. Usage: roundpipe-demo [steps] [device spec]
#include <roundpipe/roundpipe.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::stoi(argv[1]) : 60;
  torch::manual_seed(0);
  // The task: y = sin(3 x0) + x1 * x2, learnt from 8 noisy features.
  auto make_batch = [](int n) {
    auto x = torch::randn({n, 8});
    auto y = (torch::sin(3 * x.select(1, 0)) + x.select(1, 1) * x.select(1, 2)).unsqueeze(1);
    return std::make_pair(x, y);
  };
  torch::nn::Sequential model(
      torch::nn::Linear(8, 128), torch::nn::GELU(), torch::nn::Linear(128, 128), torch::nn::GELU(),
      torch::nn::Linear(128, 128), torch::nn::GELU(), torch::nn::Linear(128, 1));
  roundpipe::RoundPipe pipe(
      model, roundpipe::RoundPipeOptions().set_name("demo").set_devices(argc > 2 ? argv[2] : ""));
  std::printf("roundpipe-demo: %d layers on %d device(s) (%s), plan %s\n", pipe.num_layers(),
              pipe.devices().size(), pipe.devices().at(0)->name().c_str(),
              pipe.default_plan(true).to_string().c_str());
  torch::optim::Adam optimizer(pipe.parameters(), torch::optim::AdamOptions(3e-3));
  auto [test_x, test_y] = make_batch(512);
  auto mse = [](const c10::IValue& out, const c10::IValue& label) {
    return torch::mse_loss(out.toTensor(), label.toTensor());
  };
  for (int step = 0; step <= steps; ++step) {
    auto [x, y] = make_batch(256);
    auto result = pipe.forward_backward(x, y, mse);
    pipe.synchronize();
    optimizer.step();
    optimizer.zero_grad();
    if (step % 10 == 0) {
      torch::NoGradGuard no_grad;
      const double test = torch::mse_loss(pipe.forward(test_x), test_y).item<double>();
      std::printf("step %3d  train loss (sum of %d microbatches) %.4f  held-out mse %.4f\n", step,
                  pipe.devices().size() + 1, result.loss.item<double>(), test);
    }
  }
  return 0;
}
