// Writing a directory so that a crash never destroys the previous version.
#pragma once

#include <functional>
#include <string>

namespace roundpipe {

// Calls write(tmp) with a fresh temporary directory beside `dir`, then swaps
// it into place: the old `dir` is renamed to "<dir>.previous", the new one to
// `dir`, and the previous one removed. A crash leaves either version whole.
void write_directory_atomically(const std::string& dir,
                                const std::function<void(const std::string& tmp)>& write);

// The directory to read: `dir`, or "<dir>.previous" when a crash fell
// between the two renames.
std::string readable_directory(const std::string& dir);

}  // namespace roundpipe
