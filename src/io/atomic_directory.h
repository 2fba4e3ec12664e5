// Writing checkpoint directories so that a crash never destroys what was
// there before, and never touches files that are not ours.
#pragma once

#include <functional>
#include <string>

namespace roundpipe {

// `dir` as one path: trailing separators dropped ("out/" is "out"), "." and
// ".." resolved against the current directory. Throws when `dir` is empty
// or names an existing non-directory.
std::string normalized_directory(const std::string& dir);

// For a directory that is wholly ours (a training checkpoint): calls
// write(tmp) with a fresh temporary directory beside `dir`, then swaps it
// into place: the old `dir` is renamed to "<dir>.previous", the new one to
// `dir`, and the previous one removed. A crash leaves either version whole
// (readable_directory() finds it). Temporaries that killed processes left
// beside `dir` are removed first.
void write_directory_atomically(const std::string& dir,
                                const std::function<void(const std::string& tmp)>& write);

// For a directory that may hold other files (a model output next to a
// tokenizer, say): calls write(tmp) with a fresh temporary directory inside
// `dir` (created if missing), then moves each file written there into
// `dir`, replacing a file of the same name atomically. Files in `dir` for
// which is_stale(name) holds and that this write did not produce (shards of
// an earlier save) are removed; everything else is left alone.
void write_files_into_directory(const std::string& dir,
                                const std::function<void(const std::string& tmp)>& write,
                                const std::function<bool(const std::string& name)>& is_stale);

// The directory to read: `dir`, or "<dir>.previous" when a crash fell
// between the two renames of write_directory_atomically().
std::string readable_directory(const std::string& dir);

// Removes the temporary directories that processes no longer running left
// beside `dir` (write_directory_atomically) and inside it
// (write_files_into_directory). Returns how many it removed.
int remove_stale_temporaries(const std::string& dir);

}  // namespace roundpipe
