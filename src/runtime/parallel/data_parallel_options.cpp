// DataParallelOptions (roundpipe/data_parallel_options.h).
#include "roundpipe/data_parallel_options.h"

#include <c10/util/Exception.h>

namespace roundpipe {

DataParallelOptions::DataParallelOptions(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : process_group(std::move(group)) {
  TORCH_CHECK(process_group, "DataParallelOptions needs a process group (got none)");
}
int DataParallelOptions::rank() const {
  return process_group->getRank();
}
int DataParallelOptions::world_size() const {
  return process_group->getSize();
}

}  // namespace roundpipe
