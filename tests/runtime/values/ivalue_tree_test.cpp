// Walking the tensors of IValue trees (runtime/values/ivalue_tree.h): the
// order of flatten_tensors, replace and map keep the structure, and
// backward_through sends each gradient to its own tensor.
#include "runtime/values/ivalue_tree.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

c10::IValue tree(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("z", b);  // insertion order, not key order
  dict.insert("a", c10::IValue(3));
  dict.insert("b", c);
  return c10::ivalue::Tuple::create({a, c10::IValue("text"), dict});
}

TEST(IValueTree, FlattensDepthFirstInInsertionOrderAndReplacesInPlace) {
  const auto a = at::ones({2}), b = at::zeros({3}), c = at::full({1}, 5.0);
  const auto t = tree(a, b, c);
  const auto flat = flatten_tensors(t);
  ASSERT_EQ(flat.size(), 3u);
  EXPECT_TRUE(flat[0].is_same(a));
  EXPECT_TRUE(flat[1].is_same(b));
  EXPECT_TRUE(flat[2].is_same(c));
  const auto doubled = map_tensors(t, [](const at::Tensor& x) { return x * 2; });
  const auto& e = doubled.toTupleRef().elements();
  EXPECT_EQ(e[1].toStringRef(), "text");
  EXPECT_EQ(e[2].toGenericDict().at("a").toInt(), 3);
  EXPECT_TRUE(at::equal(e[2].toGenericDict().at("b").toTensor(), c * 2));
  const auto replaced = replace_tensors(t, {c, a, b});
  EXPECT_TRUE(flatten_tensors(replaced)[0].is_same(c));
  EXPECT_THROW(replace_tensors(t, {a}), c10::Error);
}

TEST(IValueTree, BackwardThroughSendsEachGradientToItsTensor) {
  const auto x = at::randn({3}).requires_grad_(true);
  const auto out = c10::ivalue::Tuple::create({x * 2, at::ones({1}), x.pow(2).sum()});
  backward_through(out, {at::full({3}, 0.5), at::ones({1}), at::full({}, 3.0)});
  // d/dx (0.5 . 2x + 3 sum x^2) = 1 + 6x; the constant's gradient goes nowhere.
  EXPECT_TENSOR_NEAR(x.grad(), 1 + 6 * x.detach(), 1e-6, "input gradient");
}

}  // namespace
}  // namespace roundpipe::testing
