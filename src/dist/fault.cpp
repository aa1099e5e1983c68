// Fault record encoding and the peer-failure line (see fault.h).
#include "dist/fault.h"

#include <cstdlib>
#include <string_view>

namespace dtune::dist {

std::string encode(const FaultRecord& r) {
    std::string message = r.message.substr(0, FaultRecord::kMaxMessage);
    std::string node = r.node;
    for (char& c : node)
        if (c == '\n') c = ' ';
    std::string kind = r.kind;
    for (char& c : kind)
        if (c == '\n') c = ' ';
    return str(r.rank, '\n', r.exit_code, '\n', kind, '\n', node, '\n', r.gpu, '\n', message);
}

namespace {

bool parse_int(const std::string& s, int& out) {
    if (s.empty()) return false;
    char* end = nullptr;
    const long v = std::strtol(s.c_str(), &end, 10);
    if (!end || *end != '\0') return false;
    out = static_cast<int>(v);
    return true;
}

}  // namespace

std::optional<FaultRecord> decode(const std::string& text) {
    FaultRecord r;
    std::string fields[5];
    std::size_t at = 0;
    for (auto& field : fields) {
        const std::size_t nl = text.find('\n', at);
        if (nl == std::string::npos) return std::nullopt;
        field = text.substr(at, nl - at);
        at = nl + 1;
    }
    if (!parse_int(fields[0], r.rank) || !parse_int(fields[1], r.exit_code) || !parse_int(fields[4], r.gpu))
        return std::nullopt;
    r.kind = fields[2];
    r.node = fields[3];
    r.message = text.substr(at);
    return r;
}

namespace {
constexpr const char* kBecause = " stops because rank ";
}

std::string peer_failure_line(const FaultRecord& r, int self_rank) {
    std::string where = r.node.empty() ? std::string() : str(" on node ", r.node);
    if (r.gpu >= 0) where += str(" (GPU ", r.gpu, ")");
    // One line: the launcher quotes it, and parses the rank back with origin_rank_in().
    std::string message = r.message;
    for (char& c : message)
        if (c == '\n') c = ' ';
    return str("rank ", self_rank, kBecause, r.rank, " failed", where, ": ", message);
}

int origin_rank_in(const std::string& line) {
    const std::size_t at = line.find(kBecause);
    if (at == std::string::npos) return -1;
    const char* p = line.c_str() + at + std::char_traits<char>::length(kBecause);
    char* end = nullptr;
    const long rank = std::strtol(p, &end, 10);
    if (end == p || std::string_view(end).rfind(" failed", 0) != 0) return -1;
    return static_cast<int>(rank);
}

bool is_peer_failure(const std::exception& error) {
    return dynamic_cast<const PeerFailure*>(&error) || origin_rank_in(error.what()) >= 0;
}

}  // namespace dtune::dist
