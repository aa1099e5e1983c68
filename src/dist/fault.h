// The job's fault record: what a rank that fails publishes so that every other rank stops within
// a poll interval instead of waiting in a collective until its timeout (see fault_channel.h), and
// the text both sides use: the peers' "rank X stops because rank R failed ..." line, which
// `dtune launch` parses to report the rank that failed first rather than a peer it took down.
// Torch-free (the launcher uses it).
//
// Invariants: encode()/decode() round-trip every field (the message may hold any bytes but is cut
// to kMaxMessage); a record's exit_code is the code the failing rank exits with, and the peers
// exit with the same one (75 for a GPU fault, so the orchestrator replaces that machine).
#pragma once

#include <optional>
#include <string>

#include "core/error.h"

namespace dtune::dist {

struct FaultRecord {
    int rank = -1;        // the rank that failed
    int exit_code = 1;    // its exit code (75: GPU fault)
    std::string kind;     // "gpu_fault", "error", or "lost" (rank 0's store stopped answering)
    std::string node;     // its host name
    int gpu = -1;         // its GPU index on that node, -1 when none or unknown
    std::string message;  // its error, first line(s), at most kMaxMessage bytes
    static constexpr std::size_t kMaxMessage = 1000;
};

// "rank\nexit\nkind\nnode\ngpu\nmessage" (the message last: it may contain newlines).
std::string encode(const FaultRecord& record);
// nullopt when `text` is not an encoded record.
std::optional<FaultRecord> decode(const std::string& text);

// "rank <self> stops because rank <R> failed on node <N> (GPU <g>): <message>".
std::string peer_failure_line(const FaultRecord& record, int self_rank);
// The failing rank a peer_failure_line() names, or -1 when `line` is not one.
int origin_rank_in(const std::string& line);

// Thrown by a collective (and by the fault channel's checks) once another rank has published a
// fault: the peers unwind normally and exit with the failing rank's code.
class PeerFailure : public Error {
  public:
    PeerFailure(const FaultRecord& record, int self_rank)
        : Error(peer_failure_line(record, self_rank), static_cast<ExitCode>(record.exit_code)),
          record_(record) {}
    const FaultRecord& record() const { return record_; }

  private:
    FaultRecord record_;
};

// Whether `error` is a PeerFailure, also after something rethrew it as another type (its message).
bool is_peer_failure(const std::exception& error);

}  // namespace dtune::dist
