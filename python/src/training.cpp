// roundpipe._C's training stack: the Python roundpipe.train runs on the
// same C++ code as roundpipe-train (token files, the held-out split, the
// per-epoch shuffle, packing and padding, the learning-rate schedules,
// metrics.jsonl), so one seed gives one trajectory in either.
#include "training.h"

#include <limits>

#include "roundpipe/train/lr_schedule.h"
#include "roundpipe/train/step_data.h"
#include "roundpipe/train/token_file.h"
#include "train/metrics_log.h"

namespace roundpipe::python {
namespace {

using train::Dataset;
using DatasetPtr = std::shared_ptr<Dataset>;

// A call's batch as forward keyword arguments: input_ids and labels, with
// attention_mask (padded) or position_ids (packed).
py::dict batch_dict(const train::Batch& batch) {
  py::dict out;
  out["input_ids"] = batch.input_ids;
  if (batch.attention_mask.defined()) out["attention_mask"] = batch.attention_mask;
  out["labels"] = batch.labels;
  if (batch.position_ids.defined()) out["position_ids"] = batch.position_ids;
  return out;
}

// An example as Python's (input_ids, trained) lists.
py::tuple example_tuple(const train::Example& ex) {
  std::vector<int> trained(ex.labels.size());
  for (size_t t = 0; t < ex.labels.size(); ++t) trained[t] = ex.labels[t] != -100;
  return py::make_tuple(ex.input_ids, trained);
}

}  // namespace

void bind_training(py::module_& m) {
  py::class_<Dataset, DatasetPtr>(m, "Dataset")
      .def("__len__", &Dataset::size)
      .def(
          "example", [](const Dataset& d, int64_t i) { return example_tuple(d.at(i)); },
          py::arg("index"), "example `index` as (input_ids, trained) lists");

  py::class_<train::TokenFile, Dataset, std::shared_ptr<train::TokenFile>>(m, "TokenFile")
      .def(py::init([](const std::string& path, std::optional<int64_t> max_tokens) {
             return std::make_shared<train::TokenFile>(
                 path, max_tokens.value_or(std::numeric_limits<int64_t>::max()));
           }),
           py::arg("path"), py::arg("max_tokens") = py::none())
      .def_property_readonly("header_json", &train::TokenFile::header_json);

  m.def(
      "examples_dataset",
      [](const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>& examples,
         int64_t max_tokens) -> DatasetPtr {
        std::vector<train::Example> out;
        out.reserve(examples.size());
        for (const auto& [ids, labels] : examples) {
          TORCH_CHECK_VALUE(ids.size() == labels.size(), "an example's input_ids (", ids.size(),
                            ") and labels (", labels.size(), ") differ in length");
          const auto n = std::min<size_t>(ids.size(), static_cast<size_t>(max_tokens));
          out.push_back({{ids.begin(), ids.begin() + n}, {labels.begin(), labels.begin() + n}});
        }
        return train::in_memory(std::move(out));
      },
      py::arg("examples"), py::arg("max_tokens"),
      "(input_ids, labels) pairs as a Dataset, each cut to max_tokens");

  m.def(
      "hold_out",
      [](DatasetPtr all, double fraction, uint64_t seed) {
        auto split = train::hold_out(std::move(all), fraction, seed);
        return std::make_pair(DatasetPtr(split.train), DatasetPtr(split.eval));
      },
      py::arg("data"), py::arg("fraction"), py::arg("seed"));

  m.def("steps_per_epoch", &train::steps_per_epoch, py::arg("num_examples"), py::arg("batch_size"),
        py::arg("grad_accum"));

  py::class_<train::StepData>(m, "StepData")
      .def(py::init([](DatasetPtr data, int64_t batch_size, int64_t grad_accum, int64_t seq_len,
                       bool packing, int64_t min_rows, uint64_t seed, int rank, int processes) {
             return std::make_unique<train::StepData>(std::move(data),
                                                      train::StepDataOptions()
                                                          .set_batch_size(batch_size)
                                                          .set_grad_accum(grad_accum)
                                                          .set_seq_len(seq_len)
                                                          .set_packing(packing)
                                                          .set_min_rows(min_rows)
                                                          .set_seed(seed)
                                                          .set_process(rank, processes));
           }),
           py::arg("data"), py::arg("batch_size"), py::arg("grad_accum"), py::arg("seq_len"),
           py::arg("packing"), py::arg("min_rows"), py::arg("seed"), py::arg("rank") = 0,
           py::arg("processes") = 1)
      .def("steps_per_epoch", &train::StepData::steps_per_epoch)
      .def(
          "at",
          [](train::StepData& self, int64_t step) {
            const auto s = self.at(step);
            py::list calls;
            for (const auto& b : s.batches) calls.append(py::make_tuple(batch_dict(b), b.tokens));
            return py::make_tuple(calls, s.tokens, s.loss_tokens);
          },
          py::arg("step"),
          "([(batch kwargs, tokens) a call], the step's tokens, its labelled tokens)");

  m.def(
      "collate",
      [](const Dataset& data, int64_t begin, int64_t count) {
        const auto batch = train::collate_range(data, begin, count);
        return py::make_tuple(batch_dict(batch), batch.loss_tokens);
      },
      py::arg("data"), py::arg("begin"), py::arg("count"),
      "examples [begin, begin + count) (fewer at the end) one a row, right padded: (batch kwargs, "
      "labelled tokens)");

  m.def(
      "pack",
      [](const Dataset& data, int64_t seq_len, int64_t min_rows) {
        std::vector<train::Example> examples;
        for (int64_t i = 0; i < data.size(); ++i) examples.push_back(data.at(i));
        std::vector<int64_t> order(examples.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
        const auto batch =
            train::pack(examples, order, 0, static_cast<int64_t>(order.size()), seq_len, min_rows);
        return py::make_tuple(batch_dict(batch), batch.loss_tokens);
      },
      py::arg("data"), py::arg("seq_len"), py::arg("min_rows"),
      "all examples packed into rows: (batch kwargs, labelled tokens)");

  py::class_<train::LrSchedule>(m, "LrSchedule")
      .def(py::init([](const std::string& kind, double peak_lr, double warmup_ratio,
                       int64_t warmup_steps, int64_t total_steps) {
             train::LrSchedule s;
             s.kind = train::lr_schedule_from_string(kind);
             s.peak_lr = peak_lr;
             s.warmup_steps = train::warmup_steps_of(warmup_ratio, warmup_steps, total_steps);
             s.total_steps = total_steps;
             return s;
           }),
           py::arg("kind"), py::arg("peak_lr"), py::arg("warmup_ratio"), py::arg("warmup_steps"),
           py::arg("total_steps"))
      .def_readonly("warmup_steps", &train::LrSchedule::warmup_steps)
      .def("at", &train::LrSchedule::at, py::arg("done"),
           "the learning rate of the update after `done` updates");

  py::class_<train::MetricsLog>(m, "MetricsLog")
      .def(py::init<const std::string&, int64_t>(), py::arg("path"), py::arg("first_step") = 0)
      .def("add_step", &train::MetricsLog::add_step, py::arg("json_object"))
      .def("add_eval", &train::MetricsLog::add_eval, py::arg("step"), py::arg("loss"))
      .def(
          "write_known",
          [](train::MetricsLog& self, const std::vector<double>& grad_norms,
             const std::vector<double>& lrs, const std::vector<double>& losses, bool final) {
            std::vector<train::MetricsLog::Update> updates(grad_norms.size());
            for (size_t k = 0; k < updates.size(); ++k) {
              updates[k].grad_norm = grad_norms[k];
              if (k < lrs.size()) updates[k].lr = lrs[k];
              if (k < losses.size()) updates[k].loss = losses[k];
            }
            return self.write_known(updates, final);
          },
          py::arg("grad_norms"), py::arg("lrs"), py::arg("losses"), py::arg("final") = false,
          "writes the waiting lines whose updates are known; returns them (JSON text)");
}

}  // namespace roundpipe::python
