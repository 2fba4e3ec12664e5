#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

int main() {
  // Any torch::nn::Sequential: each child becomes one scheduled layer.
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 1));
  roundpipe::RoundPipe pipe(model, roundpipe::RoundPipeOptions().set_model_run_config(
                                       roundpipe::RunConfig().set_num_microbatch(4)));
  torch::optim::AdamW optimizer(pipe.parameters(), torch::optim::AdamWOptions(1e-3));
  auto loss_fn = [](const c10::IValue& output, const c10::IValue& label) {
    return torch::mse_loss(output.toTensor(), label.toTensor());
  };
  for (int step = 0; step < 20; ++step) {
    auto x = torch::randn({64, 32});
    auto y = x.sum(1, /*keepdim=*/true);
    // Forward, loss and backward over 4 microbatches; returns the summed loss.
    auto loss = pipe.forward_backward(x, y, loss_fn).loss;
    pipe.synchronize();  // gradients now in model->parameters()[i].grad()
    optimizer.step();
    optimizer.zero_grad();
    std::printf("step %d loss %.4f\n", step, loss.item<double>());
  }
}
