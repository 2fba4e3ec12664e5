// The fused CUDA kernels against the plain LibTorch compositions they
// replace: outputs and gradients, every dtype the kernels take, on the GPU
// (skipped where none is visible; bench/gpu_tests.sh runs them on the H200
// machine). On CPU tensors the dispatch must take the plain path exactly.
#include <gtest/gtest.h>
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/models/fused_ops.h>
#include <torch/torch.h>

#include <functional>
#include <string>

#ifdef ROUNDPIPE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace ops = roundpipe::models::ops;

namespace {

bool have_cuda() {
  return torch::cuda::is_available();
}

// Tolerance of one rounding of the dtype, scaled by the values' size.
double tolerance(c10::ScalarType t) {
  return t == torch::kFloat ? 2e-5 : t == torch::kBFloat16 ? 2e-2 : 4e-3;
}

// Max |a - b| relative to max |b| (both cast to float).
double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const auto fa = a.to(torch::kFloat).cpu(), fb = b.to(torch::kFloat).cpu();
  return (fa - fb).abs().max().item<double>() / std::max(fb.abs().max().item<double>(), 1e-12);
}

// Runs fn on leaf copies of inputs (fused) and on another set with the
// plain function, backward with the same random upstream gradient, and
// compares outputs and every input's gradient.
using Fn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
void expect_same(const std::string& what, const std::vector<at::Tensor>& inputs, const Fn& fused,
                 const Fn& plain, std::vector<bool> differentiable) {
  auto leaves = [&] {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < inputs.size(); ++i)
      out.push_back(inputs[i].detach().clone().requires_grad_(differentiable[i]));
    return out;
  };
  auto a = leaves(), b = leaves();
  auto ya = fused(a), yb = plain(b);
  const auto dtype = inputs[0].scalar_type();
  EXPECT_EQ(ya.sizes(), yb.sizes()) << what;
  EXPECT_LT(relative_error(ya, yb), tolerance(dtype)) << what << " output";
  auto upstream = torch::randn_like(yb);
  ya.backward(upstream);
  yb.backward(upstream);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!differentiable[i]) continue;
    ASSERT_TRUE(a[i].grad().defined()) << what << " input " << i;
    // Weight gradients sum thousands of rounded products: allow a bit more.
    EXPECT_LT(relative_error(a[i].grad(), b[i].grad()), 2 * tolerance(dtype))
        << what << " gradient of input " << i;
  }
}

class FusedOpsTest : public ::testing::TestWithParam<c10::ScalarType> {
 protected:
  void SetUp() override {
    if (!have_cuda()) GTEST_SKIP() << "no CUDA GPU: the fused kernels run on the GPU machine";
    torch::manual_seed(0);
  }
  at::TensorOptions opts() const { return at::TensorOptions().dtype(GetParam()).device(at::kCUDA); }
};

TEST_P(FusedOpsTest, RMSNormMatchesPlain) {
  ASSERT_TRUE(ops::fused_available(torch::empty({1}, opts())));
  for (int64_t dim : {128, 2048, 2560}) {
    auto x = torch::randn({3, 37, dim}, opts()) * 3;
    auto w = torch::rand({dim}, opts()) + 0.5;
    expect_same(
        "rms_norm dim " + std::to_string(dim), {x, w},
        [](const auto& v) { return ops::rms_norm(v[0], v[1], 1e-6); },
        [](const auto& v) { return ops::plain::rms_norm(v[0], v[1], 1e-6); }, {true, true});
  }
}

TEST_P(FusedOpsTest, RotaryMatchesPlain) {
  const int64_t B = 2, T = 33, H = 3, D = 128;
  auto x = torch::randn({B, T, H, D}, opts());
  auto angles = torch::rand({T, D}, opts().dtype(torch::kFloat)) * 6;
  auto cos = angles.cos().to(GetParam()), sin = angles.sin().to(GetParam());
  expect_same(
      "rotary", {x, cos, sin}, [](const auto& v) { return ops::rotary(v[0], v[1], v[2]); },
      [](const auto& v) { return ops::plain::rotary(v[0], v[1], v[2]); }, {true, false, false});
}

TEST_P(FusedOpsTest, SwiGLUMatchesPlain) {
  auto gate = torch::randn({5, 17, 384}, opts()) * 4, up = torch::randn({5, 17, 384}, opts());
  expect_same(
      "swiglu", {gate, up}, [](const auto& v) { return ops::swiglu(v[0], v[1]); },
      [](const auto& v) { return ops::plain::swiglu(v[0], v[1]); }, {true, true});
}

TEST_P(FusedOpsTest, OddShapesTakeThePlainPathAndStayCorrect) {
  // A row of 7 elements is no whole 16-byte pack: the dispatch falls back.
  auto x = torch::randn({4, 7}, opts()), w = torch::rand({7}, opts());
  EXPECT_LT(relative_error(ops::rms_norm(x, w, 1e-6), ops::plain::rms_norm(x, w, 1e-6)), 1e-6);
  auto g = torch::randn({3, 5}, opts()), u = torch::randn({3, 5}, opts());
  EXPECT_LT(relative_error(ops::swiglu(g, u), ops::plain::swiglu(g, u)), 1e-6);
}

// The fused linear + cross-entropy against the unfused float32 formula.
TEST_P(FusedOpsTest, LinearCrossEntropyMatchesFloatFormula) {
  const int64_t N = 300, D = 64, V = 1000;  // V * 2 bytes is whole packs
  auto hidden = torch::randn({N, D}, opts());
  auto weight = torch::randn({V, D}, opts()) * 0.2;
  auto labels =
      torch::randint(0, V, {N}, at::TensorOptions().dtype(torch::kLong).device(at::kCUDA));
  labels.narrow(0, 10, 20).fill_(-100);  // ignored positions
  auto h1 = hidden.clone().requires_grad_(), w1 = weight.clone().requires_grad_();
  auto loss = roundpipe::models::chunked_linear_cross_entropy(h1, w1, labels, /*chunk=*/128);
  // Copies (for float32, to() would return the tensors themselves and make
  // `hidden` and `weight` below require grad).
  auto h2 = hidden.to(torch::kFloat, false, /*copy=*/true).requires_grad_(),
       w2 = weight.to(torch::kFloat, false, /*copy=*/true).requires_grad_();
  auto expected =
      at::cross_entropy_loss(at::matmul(h2, w2.t()), labels, {}, at::Reduction::Mean, -100);
  const double tol = GetParam() == torch::kFloat ? 1e-5 : 2e-2;
  EXPECT_NEAR(loss.item<double>(), expected.item<double>(), tol * expected.item<double>());
  (loss * 3).backward();
  (expected * 3).backward();
  EXPECT_LT(relative_error(h1.grad(), h2.grad()), 3 * tol);
  EXPECT_LT(relative_error(w1.grad(), w2.grad()), 3 * tol);
  // A frozen weight: the hidden state's gradient alone, the same.
  auto h3 = hidden.clone().requires_grad_();
  roundpipe::models::chunked_linear_cross_entropy(h3, weight, labels, 128).backward();
  EXPECT_LT(relative_error(h3.grad() * 3, h1.grad()), tol);
  // Without a gradient wanted the same loss comes out.
  torch::NoGradGuard no_grad;
  auto plain_loss = roundpipe::models::chunked_linear_cross_entropy(hidden, weight, labels, 128);
  EXPECT_NEAR(plain_loss.item<double>(), loss.item<double>(), 1e-6 * loss.item<double>() + 1e-6);
}

// Without grad mode the fused loss makes no gradient, though its weight
// (a parameter) requires grad: an evaluation call holds a chunk's logits and
// a few scalars beyond its inputs, not the weight's float32 gradient (V x D
// x 4 bytes, 16 MiB here); and its loss is the one with grad.
TEST_P(FusedOpsTest, LinearCrossEntropyWithoutGradModeMakesNoGradient) {
#ifdef ROUNDPIPE_WITH_CUDA
  const int64_t N = 256, D = 1024, V = 4096, chunk = 128;
  const auto hidden = torch::randn({N, D}, opts());
  const auto weight = (torch::randn({V, D}, opts()) * 0.05).requires_grad_();
  const auto labels =
      torch::randint(0, V, {N}, at::TensorOptions().dtype(torch::kLong).device(at::kCUDA));
  const double with_grad =
      roundpipe::models::chunked_linear_cross_entropy(hidden, weight, labels, chunk).item<double>();
  torch::NoGradGuard no_grad;
  roundpipe::models::chunked_linear_cross_entropy(hidden, weight, labels, chunk);  // (workspaces)
  torch::cuda::synchronize();
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const auto before = alloc::getDeviceStats(0).allocated_bytes[0].current;
  alloc::resetPeakStats(0);
  const auto loss = roundpipe::models::chunked_linear_cross_entropy(hidden, weight, labels, chunk);
  EXPECT_FALSE(loss.requires_grad());
  torch::cuda::synchronize();
  const auto held = alloc::getDeviceStats(0).allocated_bytes[0].peak - before;
  const int64_t logits = chunk * V * 4;  // a chunk's logits, float32 at most
  EXPECT_LT(held, 2 * logits) << "the weight's float32 gradient is " << V * D * 4 << " bytes";
  // (The kernel adds the rows' losses in whatever order its blocks finish:
  // 256 float32 additions, each off by at most one rounding.)
  EXPECT_NEAR(loss.item<double>(), with_grad, N * 6e-8 * with_grad);
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// scaled_to on the GPU, where the product is cast as it is stored: bit for
// bit the whole product cast, in blocks of one row, of a few with a short
// last one, of all rows, and more; x not contiguous, the scale half.
TEST_P(FusedOpsTest, ScaledToIsTheWholeProductCastBitForBit) {
  const auto x = (torch::randn({24, 37}, opts().dtype(torch::kFloat)) * 1e3).t();
  const auto scale = torch::full({}, 0.3, opts().dtype(torch::kHalf));
  const auto expected = (x * scale).to(GetParam());
  for (int64_t block_rows : {int64_t{1}, int64_t{5}, int64_t{37}, int64_t{100}}) {
    const auto got = ops::scaled_to(x, scale, GetParam(), block_rows * 24 * 4);
    EXPECT_EQ(got.scalar_type(), GetParam());
    EXPECT_TRUE(torch::equal(got, expected)) << block_rows << " rows a block";
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOpsTest,
                         ::testing::Values(torch::kFloat, torch::kHalf, torch::kBFloat16),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

// scaled_to gives (x * scale).to(dtype) bit for bit, whatever its blocks:
// rows that fill blocks evenly, a last short block, one block, one a row.
TEST(FusedOpsCpu, ScaledToIsTheWholeProductCastBitForBit) {
  torch::manual_seed(0);
  const auto x = torch::randn({37, 24}) * 1e3;
  const auto scale = torch::full({}, 0.3f);
  for (auto dtype : {torch::kHalf, torch::kBFloat16, torch::kFloat}) {
    const auto expected = (x * scale).to(dtype);
    for (int64_t block_rows : {int64_t{1}, int64_t{5}, int64_t{37}, int64_t{100}}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + ", " + std::to_string(block_rows));
      const auto got = ops::scaled_to(x, scale, dtype, block_rows * 24 * 4);
      EXPECT_EQ(got.scalar_type(), dtype);
      EXPECT_TRUE(torch::equal(got, expected));
    }
  }
}

// Where the product must carry a graph (a backward with create_graph),
// scaled_to is the plain expression (out= has no autograd): the same values
// and the scale's gradient through them.
TEST(FusedOpsCpu, ScaledToCarriesAGraphWhereOneIsWanted) {
  torch::manual_seed(0);
  const auto x = torch::randn({37, 24});
  const auto scale = torch::full({}, 0.3f).requires_grad_();
  const auto got = ops::scaled_to(x, scale, torch::kHalf, 24 * 4);
  ASSERT_TRUE(got.requires_grad());
  EXPECT_TRUE(torch::equal(got.detach(), (x * scale.detach()).to(torch::kHalf)));
  got.to(torch::kFloat).sum().backward();
  // d/dscale sum(x * scale) = sum(x), the cast's gradient passing through
  // (one float32 rounding per element of the sum).
  EXPECT_NEAR(scale.grad().item<double>(), x.sum().item<double>(),
              1e-6 * x.abs().sum().item<double>());
}

// On CPU tensors the dispatch is the plain composition, bit for bit.
TEST(FusedOpsCpu, DispatchIsPlainOnCpu) {
  torch::manual_seed(0);
  auto x = torch::randn({2, 5, 3, 8}), cos = torch::randn({5, 8}), sin = torch::randn({5, 8});
  EXPECT_FALSE(ops::fused_available(x));
  EXPECT_TRUE(torch::equal(ops::rotary(x, cos, sin), ops::plain::rotary(x, cos, sin)));
  auto w = torch::rand({8});
  EXPECT_TRUE(torch::equal(ops::rms_norm(x, w, 1e-6), ops::plain::rms_norm(x, w, 1e-6)));
  // The plain rotary is x * cos + rotate_half(x) * sin, written out here.
  auto first = x.narrow(3, 0, 4), second = x.narrow(3, 4, 4);
  auto rotated = torch::cat({-second, first}, 3);
  auto expected = x * cos.view({1, 5, 1, 8}) + rotated * sin.view({1, 5, 1, 8});
  EXPECT_TRUE(torch::allclose(ops::plain::rotary(x, cos, sin), expected));
}

}  // namespace
