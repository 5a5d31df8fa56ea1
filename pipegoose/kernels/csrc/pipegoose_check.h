// PG_CHECK: TORCH_CHECK whose message is built without iostreams.
//
// Why: on the H200 machine (torch 2.11+cu130, its host compiler) a TORCH_CHECK that formatted a number crashed the
// process (SIGSEGV inside std::ostream::_M_insert<long>, called from c10::str in our extension) instead of raising:
// the iostream code inlined into an extension can disagree with the libstdc++ loaded in the process. A message that
// is a single std::string goes through c10 untouched (c10::str returns it as it is), so no stream is involved.
// Every check in pipegoose's kernels and bindings uses this macro; it takes the same arguments as TORCH_CHECK.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace pipegoose {
namespace msg {

inline void put(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>,
                                       int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}
inline void put(std::string& s, double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  s += buf;
}
inline void put(std::string& s, float v) { put(s, static_cast<double>(v)); }
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }  // implemented in libc10
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}

template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}

}  // namespace msg
}  // namespace pipegoose

#define PG_CHECK(cond, ...) TORCH_CHECK(cond, ::pipegoose::msg::cat(__VA_ARGS__))

namespace pipegoose {

// f(T{}) for the element type T of dtype dt: float, at::Half or at::BFloat16 (any other dtype is the caller's to
// refuse first, with PG_CHECK; it gets the bf16 branch). Used after the checks, where AT_DISPATCH would also
// instantiate double.
template <typename F>
void by_dtype(c10::ScalarType dt, F&& f) {
  if (dt == c10::ScalarType::Float) {
    f(float{});
  } else if (dt == c10::ScalarType::Half) {
    f(c10::Half{});
  } else {
    f(c10::BFloat16{});
  }
}

}  // namespace pipegoose
