// Shared by the tests: the backends every engine test runs on, tolerances,
// and the models of the test matrix.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <roundpipe/roundpipe.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace roundpipe::testing {

// `text` contains `part` (printed when not).
#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

// What fn() throws, or "(no error)".
template <typename Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// A directory of this test process's own, made fresh (mkdtemp): the files a
// test writes there never meet those an earlier process with the same pid
// left behind.
inline const std::filesystem::path& process_temp_dir() {
  static const std::filesystem::path dir = [] {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "roundpipe_test_XXXXXX").string();
    TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "cannot make a temporary directory in ",
                std::filesystem::temp_directory_path().string());
    return std::filesystem::path(pattern);
  }();
  return dir;
}

// sim with 1, 2 and 3 devices (the multi-device ones with copy jitter to
// shake out missing waits), and the CUDA GPUs when there are any.
inline std::vector<std::string> backends() {
  // sim:3 also slices parameter uploads into small chunks.
  std::vector<std::string> specs = {"sim:1", "sim:2,jitter_us=150",
                                    "sim:3,jitter_us=150,chunk=16KiB"};
  if (cuda_device_count() > 0) specs.push_back("cuda");
  if (const char* only = std::getenv("ROUNDPIPE_TEST_BACKENDS")) {
    specs.clear();
    std::string list = only;
    size_t start = 0;
    while (start <= list.size()) {
      size_t end = list.find(';', start);
      if (end == std::string::npos) end = list.size();
      if (end > start) specs.push_back(list.substr(start, end - start));
      start = end + 1;
    }
  }
  return specs;
}

inline std::string backend_test_name(const std::string& spec) {
  std::string name;
  for (char c : spec) {
    if (std::isalnum(static_cast<unsigned char>(c)))
      name += c;
    else if (c == ':' || c == ',')
      name += '_';
    if (c == ',') break;
  }
  return name;
}

// The torch device a backend's oracle runs on.
inline c10::Device oracle_device(const std::string& spec) {
  return spec.rfind("cuda", 0) == 0 ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
}

// max |a - b| / max |b|: the relative error the quality bar speaks of.
inline double max_rel_error(const at::Tensor& a, const at::Tensor& b) {
  auto x = a.detach().to(at::kCPU, at::kDouble), y = b.detach().to(at::kCPU, at::kDouble);
  if (!x.sizes().equals(y.sizes())) return std::numeric_limits<double>::infinity();
  if (y.numel() == 0) return 0;
  const double scale = std::max(y.abs().max().item<double>(), 1e-12);
  return (x - y).abs().max().item<double>() / scale;
}

// Both tensors defined, of one shape, and error(a, b) <= tol.
#define EXPECT_TENSOR_ERROR_LE(error, a, b, tol, what)            \
  do {                                                            \
    const auto& a_ = (a);                                         \
    const auto& b_ = (b);                                         \
    ASSERT_TRUE(a_.defined()) << what << ": result undefined";    \
    ASSERT_TRUE(b_.defined()) << what << ": reference undefined"; \
    ASSERT_EQ(a_.sizes(), b_.sizes()) << what;                    \
    EXPECT_LE(error(a_, b_), (tol)) << what;                      \
  } while (0)

#define EXPECT_TENSOR_NEAR(a, b, tol, what) \
  EXPECT_TENSOR_ERROR_LE(::roundpipe::testing::max_rel_error, a, b, tol, what)

// max |a - b|: for values whose error bound is absolute (weights after Adam).
inline double max_abs_error(const at::Tensor& a, const at::Tensor& b) {
  auto x = a.detach().to(at::kCPU, at::kDouble), y = b.detach().to(at::kCPU, at::kDouble);
  if (!x.sizes().equals(y.sizes())) return std::numeric_limits<double>::infinity();
  return y.numel() == 0 ? 0 : (x - y).abs().max().item<double>();
}

#define EXPECT_TENSOR_ABS_NEAR(a, b, tol, what) \
  EXPECT_TENSOR_ERROR_LE(::roundpipe::testing::max_abs_error, a, b, tol, what)

// Weights after Adam steps. Adam moves a weight by lr * m / (sqrt(v) + eps):
// with the default eps=1e-8 an element whose gradient is near zero moves by
// up to lr on rounding noise alone, so weights after Adam cannot be compared
// at any tolerance. Tests that compare them use kAdamEps on both sides: a
// gradient difference d then changes a step by at most lr * d / kAdamEps
// (bias-corrected |m| <= 1.05 sqrt(v) within ten steps of betas (0.9, 0.999)).
constexpr double kAdamEps = 1e-3;
// The gradient difference, ours against the oracle, at any step: the same
// fp32 products (|g| <~ 1) summed in another order (microbatches; matmul
// blocking by SIMD width and thread count): a few ulps of max|g|, measured
// <= 7e-7 with the AVX-512, AVX2 and baseline ATen kernels and 1 or 2 threads.
constexpr double kGradError = 1e-5;
// Bound on |ours - oracle| for weights after `steps` Adam steps at kAdamEps
// (the weights' own rounding, < 1e-6 over a few steps, is far below it).
inline double adam_weight_tolerance(int steps, double lr, double grad_error = kGradError) {
  return steps * lr * grad_error / kAdamEps;
}

// The oracle's own split of a batch into n microbatches along dim 0
// (earlier microbatches one row larger when n does not divide the batch).
inline std::vector<at::Tensor> microbatches_of(const at::Tensor& t, int n) {
  std::vector<at::Tensor> parts;
  const int64_t batch = t.size(0);
  int64_t start = 0;
  for (int m = 0; m < n; ++m) {
    const int64_t rows = batch / n + (m < batch % n ? 1 : 0);
    parts.push_back(t.narrow(0, start, rows));
    start += rows;
  }
  return parts;
}

inline at::Tensor mse_loss(const c10::IValue& out, const c10::IValue& label) {
  return torch::nn::functional::mse_loss(out.toTensor(), label.toTensor());
}

// Plain LibTorch on one device: the sum over microbatches of the MSE loss.
inline at::Tensor plain_microbatch_loss(torch::nn::Sequential& model, const at::Tensor& x,
                                        const at::Tensor& y, int n, c10::Device dev) {
  auto xs = microbatches_of(x.to(dev), n), ys = microbatches_of(y.to(dev), n);
  at::Tensor loss = at::zeros({}, dev);
  for (int m = 0; m < n; ++m) loss = loss + mse_loss(model->forward(xs[m]), ys[m]);
  return loss;
}

// A port no one listens on now (the kernel's pick; free again at once).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  TORCH_CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0,
              "cannot find a free port");
  ::close(fd);
  return ntohs(address.sin_port);
}

// A tensor input cut into chunks of `rows` rows (a test layer's
// SplitsInputRows::split_input_rows).
inline std::vector<c10::IValue> split_tensor_rows(const c10::IValue& input,
                                                  const std::vector<int64_t>& rows) {
  std::vector<c10::IValue> chunks;
  int64_t first = 0;
  for (int64_t n : rows) {
    chunks.emplace_back(input.toTensor().narrow(0, first, n));
    first += n;
  }
  return chunks;
}

#ifdef ROUNDPIPE_PYTHON
// Runs `code` with the test's Python (transformers, peft, bitsandbytes:
// scripts/setup.sh) and `args`, then the path of a file it writes its
// answer to; returns that answer (the script's log is `tag`.txt.log).
inline std::string run_python(const std::string& tag, const std::string& code,
                              const std::string& args) {
  const auto dir = process_temp_dir();
  const std::string script = (dir / (tag + ".py")).string(), out = (dir / (tag + ".txt")).string();
  std::ofstream(script) << code;
  const std::string cmd = std::string(ROUNDPIPE_PYTHON) + " " + script + " " + args + " " + out +
                          " > " + out + ".log 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "see " << out << ".log";
  std::ifstream file(out);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}
#endif

// ---------------------------------------------------------------- models

// Input adapter of a transformer-like stack: hidden states plus rotary
// cos/sin and an additive causal mask, passed on as one tuple.
struct TupleInputImpl : torch::nn::Cloneable<TupleInputImpl> {
  int64_t dim;
  torch::nn::Linear proj{nullptr};
  explicit TupleInputImpl(int64_t d) : dim(d) { reset(); }
  void reset() override { proj = register_module("proj", torch::nn::Linear(dim, dim)); }
  c10::IValue forward(at::Tensor x) {
    const int64_t T = x.size(1);
    auto pos = at::arange(T, x.options()).unsqueeze(1);
    auto freq = at::arange(dim / 2, x.options()).unsqueeze(0) * 0.1 + 0.5;
    auto angle = pos * freq;  // [T, dim/2]
    auto mask = at::full({T, T}, -1e9, x.options()).triu(1);
    return c10::ivalue::Tuple::create({proj(x), angle.cos(), angle.sin(), mask, c10::IValue(T)});
  }
};
TORCH_MODULE(TupleInput);

// A block: rotary-mixed attention over the tuple's hidden states with the
// mask, residual MLP; returns the tuple with new hidden states.
struct TupleBlockImpl : torch::nn::Cloneable<TupleBlockImpl> {
  int64_t dim;
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, mlp{nullptr};
  explicit TupleBlockImpl(int64_t d) : dim(d) { reset(); }
  void reset() override {
    q = register_module("q", torch::nn::Linear(dim, dim));
    k = register_module("k", torch::nn::Linear(dim, dim));
    v = register_module("v", torch::nn::Linear(dim, dim));
    mlp = register_module("mlp", torch::nn::Linear(dim, dim));
  }
  static at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    auto halves = x.chunk(2, -1);
    return at::cat({halves[0] * cos - halves[1] * sin, halves[0] * sin + halves[1] * cos}, -1);
  }
  c10::IValue forward(c10::IValue in) {
    const auto& e = in.toTupleRef().elements();
    auto h = e[0].toTensor(), cos = e[1].toTensor(), sin = e[2].toTensor(), mask = e[3].toTensor();
    TORCH_CHECK(e[4].toInt() == h.size(1), "sequence length travels with the tuple");
    auto scores = at::matmul(rotate(q(h), cos, sin), rotate(k(h), cos, sin).transpose(1, 2));
    auto attn = at::softmax(scores / std::sqrt(double(dim)) + mask, -1);
    h = h + at::matmul(attn, v(h));
    h = h + at::gelu(mlp(h));
    return c10::ivalue::Tuple::create({h, e[1], e[2], e[3], e[4]});
  }
};
TORCH_MODULE(TupleBlock);

struct TupleOutputImpl : torch::nn::Cloneable<TupleOutputImpl> {
  int64_t dim, out;
  torch::nn::Linear head{nullptr};
  TupleOutputImpl(int64_t d, int64_t o) : dim(d), out(o) { reset(); }
  void reset() override { head = register_module("head", torch::nn::Linear(dim, out)); }
  at::Tensor forward(c10::IValue in) { return head(in.toTupleRef().elements()[0].toTensor()); }
};
TORCH_MODULE(TupleOutput);

// Uses another layer's weight (tied): y = x W^T + b with W shared. Its
// clone() gives the copy its own weight tensor, as RoundPipe requires.
struct TiedLinearImpl : torch::nn::Cloneable<TiedLinearImpl> {
  at::Tensor shared;
  at::Tensor weight, bias;
  explicit TiedLinearImpl(at::Tensor w) : shared(std::move(w)) { reset(); }
  void reset() override {
    weight = register_parameter("weight", shared);
    bias = register_parameter("bias", at::zeros({shared.size(0)}));
  }
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    auto copy = std::make_shared<TiedLinearImpl>(weight.detach().clone().requires_grad_());
    copy->bias.set_data(bias.detach().clone());
    copy->train(is_training());
    return copy;
  }
  at::Tensor forward(at::Tensor x) { return at::linear(x, weight, bias); }
};
TORCH_MODULE(TiedLinear);

enum class ModelKind { kMlp, kTupleStack, kDropout, kBatchNorm, kTied };

inline const char* model_name(ModelKind kind) {
  switch (kind) {
    case ModelKind::kMlp:
      return "Mlp";
    case ModelKind::kTupleStack:
      return "TupleStack";
    case ModelKind::kDropout:
      return "Dropout";
    case ModelKind::kBatchNorm:
      return "BatchNorm";
    case ModelKind::kTied:
      return "Tied";
  }
  return "?";
}

// A fresh model; the same seed gives the same weights (and ties).
inline torch::nn::Sequential make_model(ModelKind kind, uint64_t seed = 1) {
  torch::manual_seed(seed);
  namespace nn = torch::nn;
  switch (kind) {
    case ModelKind::kMlp:
      return nn::Sequential(nn::Linear(6, 16), nn::Tanh(), nn::Linear(16, 16), nn::ReLU(),
                            nn::Linear(16, 4));
    case ModelKind::kTupleStack:
      return nn::Sequential(TupleInput(8), TupleBlock(8), TupleBlock(8), TupleBlock(8),
                            TupleOutput(8, 3));
    case ModelKind::kDropout:
      return nn::Sequential(nn::Linear(6, 16), nn::Dropout(0.3), nn::Linear(16, 16),
                            nn::Dropout(0.3), nn::Tanh(), nn::Linear(16, 4));
    case ModelKind::kBatchNorm:
      // No bias before a BatchNorm: its gradient is zero up to rounding,
      // which no relative tolerance can judge. BatchNorm eps 0.1: over
      // microbatches of 2-3 rows the input gradient is terms of size 1/sigma
      // cancelling to ~eps/sigma^3, so fp32 rounding grows by sigma^2/eps
      // (to 4e-3 relative with the default 1e-5; < 1e-6 with 0.1).
      return nn::Sequential(nn::Linear(nn::LinearOptions(6, 12).bias(false)),
                            nn::BatchNorm1d(nn::BatchNormOptions(12).eps(0.1)), nn::ReLU(),
                            nn::Linear(nn::LinearOptions(12, 12).bias(false)),
                            nn::BatchNorm1d(nn::BatchNormOptions(12).eps(0.1)), nn::Linear(12, 4));
    case ModelKind::kTied: {
      nn::Linear a(8, 8);
      return nn::Sequential(nn::Linear(6, 8), a, nn::Tanh(), TiedLinear(a->weight), nn::Tanh(),
                            nn::Linear(8, 4));
    }
  }
  TORCH_CHECK(false, "unknown model");
}

// An input batch for the model kind; `requires_grad` marks it for input
// gradient checks.
inline at::Tensor make_input(ModelKind kind, int64_t batch, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  if (kind == ModelKind::kTupleStack) return at::randn({batch, 5, 8}, gen);
  return at::randn({batch, 6}, gen);
}

inline int64_t output_features(ModelKind kind) {
  return kind == ModelKind::kTupleStack ? 3 : 4;
}

}  // namespace roundpipe::testing
