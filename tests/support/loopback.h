// Loopback TCP helpers shared by the test servers (HTTP listener, fault proxy): a listening socket
// on 127.0.0.1 with a kernel-chosen port, and a send that writes everything or reports failure.
#pragma once

#include <cstddef>

namespace dtune::test {

// Listens on 127.0.0.1:<free port>; returns the fd and stores the port. Throws std::runtime_error
// naming `who` when the socket cannot be bound.
int listen_on_loopback(int backlog, int& port, const char* who);

// Writes all n bytes (no SIGPIPE); false when the peer went away.
bool send_all(int fd, const char* data, std::size_t n);

}  // namespace dtune::test
