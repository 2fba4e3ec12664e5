// metrics.jsonl: see metrics_log.h.
#include "train/metrics_log.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <cmath>

namespace roundpipe::train {

MetricsLog::MetricsLog(const std::string& path, int64_t first_step) : first_step_(first_step) {
  if (path.empty()) return;
  std::vector<std::string> kept;
  if (first_step > 0) {
    std::ifstream earlier(path);
    for (std::string line; std::getline(earlier, line);) {
      const auto entry = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (entry.is_object() && entry.value("step", int64_t{0}) <= first_step) kept.push_back(line);
    }
  }
  file_.open(path, std::ios::trunc);
  TORCH_CHECK(file_, "cannot write the metrics file ", path,
              ": check that the output folder is writable");
  for (const auto& line : kept) file_ << line << "\n";
  file_ << std::flush;
}

void MetricsLog::add_step(const std::string& json_object) {
  const auto line = nlohmann::json::parse(json_object, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(line.is_object() && line.contains("step") && line.contains("loss"),
              "a metrics step line must be a JSON object with step and loss, got ", json_object);
  waiting_.push_back(json_object);
}

void MetricsLog::add_eval(int64_t step, double loss) {
  waiting_.push_back(
      nlohmann::json{{"step", step}, {"eval_loss", loss}, {"eval_perplexity", std::exp(loss)}}
          .dump());
}

std::vector<std::string> MetricsLog::write_known(const std::vector<Update>& updates, bool final) {
  std::vector<std::string> written;
  while (!waiting_.empty()) {
    auto line = nlohmann::json::parse(waiting_.front());
    if (line.contains("loss")) {
      const int64_t update = line["step"].get<int64_t>() - 1 - first_step_;
      if (update >= 0 && update < static_cast<int64_t>(updates.size())) {
        const auto& u = updates[update];
        // (JSON has no inf.)
        line["grad_norm"] =
            std::isfinite(u.grad_norm) ? nlohmann::json(u.grad_norm) : nlohmann::json(nullptr);
        if (u.lr) line["lr"] = *u.lr;
        if (u.loss) line["loss"] = *u.loss;
      } else if (!final) {
        break;
      } else {
        line["grad_norm"] = nullptr;
        if (!line.contains("lr")) line["lr"] = nullptr;
      }
    }
    written.push_back(line.dump());
    waiting_.pop_front();
    if (file_.is_open()) file_ << written.back() << "\n";
  }
  if (file_.is_open()) file_ << std::flush;
  return written;
}

}  // namespace roundpipe::train
