#include "support/trace.h"

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace roundpipe::detail {

thread_local const char* trace_who = "caller";

bool tracing() {
  static const bool on = [] {
    const char* v = std::getenv("ROUNDPIPE_TRACE");
    return v != nullptr && std::strcmp(v, "0") != 0;
  }();
  return on;
}
void trace_print(const char* format, ...) {
  char text[400];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof(text), format, args);
  va_end(args);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  std::fprintf(stderr, "[trace %9.3f %s] %s\n", std::fmod(ms, 1e5), trace_who, text);
}
double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace roundpipe::detail
