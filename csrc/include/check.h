// The extension's argument and state checks: SYNCBN_CHECK (and its _VALUE and _TYPE forms, which
// raise ValueError and TypeError in Python) builds its message from strings only.
//
// Why not TORCH_CHECK's own formatting: it writes numbers through a std::ostream, and on the GPU
// machine's image every extension links libstdc++ statically; there, an ostream formatting an
// integer inside the extension crashes the process (benchmarks/RESULTS.md, "Known defect of the
// GPU image"), so a user's mistake would be a SIGSEGV instead of a Python exception. Here every
// piece of a message becomes a std::string first (std::to_string, snprintf, c10's own names), and
// TORCH_CHECK receives that one string, which it passes on without a stream.
// tests/test_cpp_checks.py fails on any other check or stream in csrc/.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace syncbn::check {

inline std::string text(const char* piece) { return piece; }
inline std::string text(const std::string& piece) { return piece; }
inline std::string text(c10::string_view piece) { return std::string(piece.data(), piece.size()); }
inline std::string text(bool value) { return value ? "true" : "false"; }

template <
    typename Integer,
    std::enable_if_t<std::is_integral_v<Integer> && !std::is_same_v<Integer, bool>, int> = 0>
std::string text(Integer value) {
  return std::to_string(value);
}

// As an ostream prints a double by default (six significant digits).
inline std::string text(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g", value);
  return buffer;
}
inline std::string text(float value) { return text(static_cast<double>(value)); }

// A shape as c10 prints it: "[2, 5, 3]".
inline std::string text(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(sizes[i]);
  }
  return out + "]";
}

inline std::string text(c10::ScalarType type) { return c10::toString(type); }
inline std::string text(c10::DeviceType type) { return c10::DeviceTypeName(type, true); }
inline std::string text(const c10::Device& device) { return device.str(); }

// The pieces of a message, concatenated.
template <typename... Pieces>
std::string message(const Pieces&... pieces) {
  std::string out;
  (out.append(text(pieces)), ...);
  return out;
}

}  // namespace syncbn::check

#define SYNCBN_CHECK(cond, ...) TORCH_CHECK(cond, ::syncbn::check::message(__VA_ARGS__))
#define SYNCBN_CHECK_VALUE(cond, ...) \
  TORCH_CHECK_VALUE(cond, ::syncbn::check::message(__VA_ARGS__))
#define SYNCBN_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::syncbn::check::message(__VA_ARGS__))
