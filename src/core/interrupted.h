// The error for work that SIGINT/SIGTERM stopped before it finished (a cache build): exit code 4.
// What was done so far is kept, and the message says so and how to continue. Its own header, so
// that the few places that throw or catch it do not make every file that includes error.h rebuild.
#pragma once

#include <string>

#include "core/error.h"

namespace dtune {

class Interrupted : public Error {
  public:
    explicit Interrupted(const std::string& message) : Error(message, ExitCode::kInterrupted) {}
};

}  // namespace dtune
