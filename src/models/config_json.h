// Reading config.json fields with their exact JSON kinds, errors naming the
// file and the field: shared by hf_config.cpp and the families' files.
// Internal header.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace roundpipe::models::detail {

// nlohmann converts between JSON number kinds silently (2.5 would read as
// the integer 2): each field is checked for its exact kind first.
template <typename T>
bool has_kind(const nlohmann::json& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    return v.is_number_integer();
  } else if constexpr (std::is_floating_point_v<T>) {
    return v.is_number();
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return v.is_array() &&
           std::all_of(v.begin(), v.end(), [](const nlohmann::json& e) { return e.is_string(); });
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return v.is_array() && std::all_of(v.begin(), v.end(), [](const nlohmann::json& e) {
             return e.is_number_integer();
           });
  } else {
    return v.is_string();
  }
}

template <typename T>
const char* kind_name() {
  if constexpr (std::is_same_v<T, bool>) {
    return "true or false";
  } else if constexpr (std::is_integral_v<T>) {
    return "a whole number";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "a number";
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return "a list of strings";
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return "a list of whole numbers";
  } else {
    return "a string";
  }
}

template <typename T>
T required(const nlohmann::json& j, const char* key, const std::string& what) {
  TORCH_CHECK(j.contains(key) && !j[key].is_null(), what, ": missing required field '", key, "'");
  TORCH_CHECK(has_kind<T>(j[key]), what, ": field '", key, "' has the wrong type: it must be ",
              kind_name<T>(), ", got ", j[key].dump());
  return j[key].get<T>();
}

template <typename T>
T optional(const nlohmann::json& j, const char* key, T fallback, const std::string& what) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return required<T>(j, key, what);
}

}  // namespace roundpipe::models::detail
