// What ddpx's errors say when they carry another error's message.
#pragma once

#include <c10/util/Exception.h>

#include <chrono>
#include <exception>
#include <sstream>
#include <string>

namespace ddpx {

// An error's message without the C++ backtrace that c10's errors add to what().
inline std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

// A timeout as the errors print it, in seconds: "0.5", "300".
inline std::string seconds_text(std::chrono::milliseconds timeout) {
  std::ostringstream out;
  out << std::chrono::duration<double>(timeout).count();
  return out.str();
}

}  // namespace ddpx
