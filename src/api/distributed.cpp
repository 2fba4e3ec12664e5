// Process groups and the options of data parallel: see roundpipe/distributed.h.
#include "roundpipe/distributed.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if ROUNDPIPE_HAVE_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <cstdlib>
#include <map>
#include <mutex>

#include "roundpipe/errors.h"
#include "roundpipe/options.h"

namespace roundpipe {

RoundPipeOptions& RoundPipeOptions::set_data_parallel(const DataParallelOptions& v) {
  data_parallel = std::make_shared<const DataParallelOptions>(v);
  return *this;
}

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

int env_int(const char* name, int fallback) {
  const std::string text = env_or(name, "");
  if (text.empty()) return fallback;
  try {
    size_t used = 0;
    const int value = std::stoi(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  TORCH_CHECK(false, "the environment variable ", name, "=", text,
              " is not an integer (torchrun sets it; check the launcher)");
}

}  // namespace

LaunchEnvironment LaunchEnvironment::from_environment() {
  LaunchEnvironment env;
  env.world_size = env_int("WORLD_SIZE", 1);
  env.rank = env_int("RANK", 0);
  env.local_rank = env_int("LOCAL_RANK", env.rank);
  env.local_world_size = env_int("LOCAL_WORLD_SIZE", env.world_size);
  env.master_addr = env_or("MASTER_ADDR", "127.0.0.1");
  env.master_port = env_int("MASTER_PORT", 29500);
  env.agent_store = env_or("TORCHELASTIC_USE_AGENT_STORE", "") == "True";
  env.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0);
  TORCH_CHECK(env.world_size >= 1, "WORLD_SIZE=", env.world_size, " must be >= 1");
  TORCH_CHECK(env.rank >= 0 && env.rank < env.world_size, "RANK=", env.rank,
              " must be in [0, WORLD_SIZE=", env.world_size, ")");
  TORCH_CHECK(env.master_port > 0 && env.master_port < 65536, "MASTER_PORT=", env.master_port,
              " is not a TCP port");
  return env;
}

c10::intrusive_ptr<c10d::ProcessGroup> new_gloo_group(const LaunchEnvironment& env,
                                                      const std::string& name,
                                                      std::chrono::milliseconds timeout) {
#if ROUNDPIPE_HAVE_GLOO
  // One store per launch: several groups are prefixes of it. Rank 0
  // serves it unless torchrun's agent already does.
  static std::mutex mu;
  static std::map<std::string, c10::intrusive_ptr<c10d::Store>> stores;
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const std::string key = where + "/" + std::to_string(env.rank);
  c10::intrusive_ptr<c10d::Store> store;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto found = stores.find(key); found != stores.end()) store = found->second;
  }
  if (!store) {
    // (Not under the lock: the server waits for the other ranks, which may
    // be threads of this process in tests.)
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(env.master_port);
    options.isServer = env.rank == 0 && !env.agent_store;
    options.numWorkers = env.world_size;
    options.waitWorkers = !env.agent_store;
    options.timeout = timeout;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size,
                  " cannot reach the rendezvous store at ", where, ": ", error_message(e),
                  ". Check MASTER_ADDR and MASTER_PORT (torchrun sets them) and that every "
                  "process was started");
    }
    std::lock_guard<std::mutex> lock(mu);
    stores.emplace(key, store);
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
      "roundpipe/attempt_" + std::to_string(env.restart_count) + "/" + name, store);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // The interface the launcher names, as torch.distributed does; else the
  // one the host name resolves to (loopback when that is all there is).
  const std::string interface = env_or("GLOO_SOCKET_IFNAME", "");
  options->devices.push_back(interface.empty()
                                 ? c10d::ProcessGroupGloo::createDefaultDevice()
                                 : c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  c10::intrusive_ptr<c10d::ProcessGroupGloo> backend;
  try {
    backend =
        c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, env.rank, env.world_size, options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size, " cannot connect process group '",
                name, "' over Gloo (store ", where, "): ", error_message(e));
  }
  auto group = c10::make_intrusive<c10d::ProcessGroup>(prefixed, env.rank, env.world_size);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  group->setGroupName(name);
  return group;
#else
  (void)env;
  (void)name;
  (void)timeout;
  TORCH_CHECK(false,
              "this roundpipe was built without gloo's headers, so it cannot make a Gloo process "
              "group: install libgloo-dev (scripts/setup.sh does) and rebuild, or pass a group "
              "of your own to DataParallelOptions");
#endif
}

void all_reduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor& values) {
  std::vector<at::Tensor> tensors{values};
  try {
    group->allreduce(tensors)->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "process group '", group->getGroupName(), "' (rank ", group->getRank(),
                " of ", group->getSize(), "): a sum over the processes failed: ", error_message(e),
                ". Another process most likely stopped; its output says why");
  }
}

void barrier(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  // A one-element sum: every process must reach it (a barrier that does
  // not depend on the backend's barrier support).
  auto one = at::ones({1}, at::kDouble);
  all_reduce_sum(group, one);
}

}  // namespace roundpipe
