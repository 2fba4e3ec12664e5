// Microbatch split and merge (REFERENCE.md section 3).
#include "roundpipe/microbatch.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>

#include <optional>
#include <sstream>

#include "runtime/values/ivalue_tree.h"

namespace roundpipe {
namespace {

std::optional<int64_t> find_batch_size(const c10::IValue& value) {
  for (const auto& t : flatten_tensors(value)) {
    if (t.defined() && t.dim() > 0) return t.size(0);
  }
  return std::nullopt;
}

c10::IValue merge_at(const std::vector<c10::IValue>& values, const std::string& path) {
  const c10::IValue& first = values.front();
  auto mismatch = [&](const c10::IValue& other) {
    TORCH_CHECK(false, "merge_microbatches: microbatch outputs differ in structure at ", path, ": ",
                first.tagKind(), " vs ", other.tagKind(),
                ". Give RunConfig::merge_output a function that merges them.");
  };
  for (const auto& v : values) {
    if (v.tagKind() != first.tagKind()) mismatch(v);
  }
  if (first.isTensor()) {
    std::vector<at::Tensor> tensors;
    for (const auto& v : values) tensors.push_back(v.toTensor());
    if (!tensors.front().defined()) return first;
    if (tensors.front().dim() == 0) {
      // 0-dim outputs (e.g. a mean loss) are averaged over microbatches.
      return at::stack(tensors).mean(0);
    }
    return at::cat(tensors, 0);
  }
  if (first.isTuple()) {
    const size_t n = first.toTupleRef().elements().size();
    std::vector<c10::IValue> merged;
    for (size_t i = 0; i < n; ++i) {
      std::vector<c10::IValue> column;
      for (const auto& v : values) {
        TORCH_CHECK(v.toTupleRef().elements().size() == n,
                    "merge_microbatches: tuple sizes differ at ", path);
        column.push_back(v.toTupleRef().elements()[i]);
      }
      merged.push_back(merge_at(column, path + "[" + std::to_string(i) + "]"));
    }
    return c10::ivalue::Tuple::create(std::move(merged));
  }
  if (first.isList()) {
    auto list0 = first.toList();
    c10::impl::GenericList out(list0.elementType());
    for (size_t i = 0; i < list0.size(); ++i) {
      std::vector<c10::IValue> column;
      for (const auto& v : values) {
        auto list = v.toList();
        TORCH_CHECK(list.size() == list0.size(), "merge_microbatches: list sizes differ at ", path);
        column.push_back(list.get(i));
      }
      out.push_back(merge_at(column, path + "[" + std::to_string(i) + "]"));
    }
    return out;
  }
  if (first.isGenericDict()) {
    auto dict0 = first.toGenericDict();
    c10::impl::GenericDict out(dict0.keyType(), dict0.valueType());
    for (const auto& entry : dict0) {
      std::vector<c10::IValue> column;
      for (const auto& v : values) {
        auto dict = v.toGenericDict();
        TORCH_CHECK(dict.contains(entry.key()), "merge_microbatches: key ", entry.key(),
                    " missing in a microbatch at ", path);
        column.push_back(dict.at(entry.key()));
      }
      std::ostringstream key;
      key << entry.key();
      out.insert(entry.key(), merge_at(column, path + "[" + key.str() + "]"));
    }
    return out;
  }
  if (const auto* opaque = as_opaque(first)) {
    for (const auto& v : values) {
      const auto* other = as_opaque(v);
      TORCH_CHECK(other && (other == opaque || opaque->equals(*other)),
                  "merge_microbatches: the value at ", path, " differs between microbatches (",
                  opaque->describe(), " vs ", other ? other->describe() : std::string("?"),
                  "). Non-tensor outputs must be equal in every microbatch, or give "
                  "RunConfig::merge_output a function that merges them.");
    }
    return first;
  }
  for (const auto& v : values) {
    TORCH_CHECK(v == first, "merge_microbatches: the non-tensor value at ", path,
                " differs between microbatches (", first, " vs ", v,
                "). Non-tensor outputs must be equal in every microbatch, or give "
                "RunConfig::merge_output a function that merges them.");
  }
  return first;
}

}  // namespace

int64_t batch_size_of(const c10::IValue& value) {
  auto batch = find_batch_size(value);
  TORCH_CHECK(batch.has_value(),
              "cannot split into microbatches: the value holds no tensor with a batch "
              "dimension. Pass at least one tensor whose dim 0 is the batch, or give "
              "RunConfig a split function.");
  return *batch;
}

int microbatch_count(const c10::IValue& value, int n) {
  const auto batch = find_batch_size(value);
  return batch && *batch >= 1 && *batch < n ? static_cast<int>(*batch) : n;
}

std::vector<int64_t> chunk_sizes(int64_t batch, int n) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < n; ++i) sizes.push_back(batch / n + (i < batch % n ? 1 : 0));
  return sizes;
}

std::vector<c10::IValue> split_microbatches(const c10::IValue& value, int n) {
  TORCH_CHECK(n >= 1, "num_microbatch must be at least 1, got ", n);
  const int64_t batch = batch_size_of(value);
  TORCH_CHECK(batch >= n, "cannot split a batch of ", batch, " into ", n,
              " microbatches: lower num_microbatch to at most ", batch, " or pass a larger batch.");
  const auto sizes = chunk_sizes(batch, n);
  std::vector<c10::IValue> out;
  int64_t start = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t len = sizes[i];
    out.push_back(map_tensors(value, [&](const at::Tensor& t) {
      if (t.defined() && t.dim() > 0 && t.size(0) == batch) return t.narrow(0, start, len);
      return t;
    }));
    start += len;
  }
  return out;
}

c10::IValue merge_microbatches(const std::vector<c10::IValue>& values) {
  TORCH_CHECK(!values.empty(), "merge_microbatches: no microbatches");
  return merge_at(values, "output");
}

}  // namespace roundpipe
