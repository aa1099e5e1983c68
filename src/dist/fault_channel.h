// The job's out-of-band fault channel, in the c10d TCPStore every group already has: a rank that
// fails publishes a FaultRecord there before it exits, and every rank's watcher thread polls for
// one (one small store request per poll interval, default 0.5 s), so a rank blocked in a
// collective learns of a peer's failure within a poll interval instead of at the collective
// timeout (default 600 s). A rank other than 0 whose store connection fails twice in a row treats
// that as rank 0 gone (the store lives in rank 0's process) and reports a "lost" record.
//
// Invariants: the first published record wins (later ones are ignored), so every rank reports the
// same failing rank; a rank never treats its own record as a peer's; on_peer_fault runs at most
// once per channel; a normal end (leave()) stops the watcher before the rank says it is leaving,
// and rank 0 keeps the store up until every rank has said so (or leave_timeout passes), so a
// rank finishing normally is never mistaken for a failed one.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "dist/fault.h"

namespace dtune::dist {

struct FaultChannelOptions {
    std::chrono::milliseconds poll_interval{500};
    // Rank 0 at a normal end: the longest it waits for the other ranks to stop watching.
    std::chrono::milliseconds leave_timeout{std::chrono::seconds(60)};
    std::string store_address;  // "host:port", for the "lost" message
};

// Publishes `record` in the job's store unless a record is there already (the first one wins);
// returns the record in the store now. Throws what the store throws. FaultChannel::publish and
// `dtune launch` (for a rank that died without publishing, e.g. by SIGKILL) use it.
FaultRecord publish_fault_record(c10d::Store& store, const FaultRecord& record);

class FaultChannel {
  public:
    // `store`: the job's TCPStore; the channel talks through its own clones of it (one for the
    // watcher, one for the caller's thread). `on_peer_fault` runs once, on the watcher thread or
    // in check_now()'s caller, when another rank's record (or the loss of rank 0) is seen.
    FaultChannel(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                 FaultChannelOptions options, std::function<void(const FaultRecord&)> on_peer_fault);
    ~FaultChannel();
    FaultChannel(const FaultChannel&) = delete;
    FaultChannel& operator=(const FaultChannel&) = delete;

    // Publishes this rank's failure unless a record is there already; returns the record that is
    // in the store now (this one, or the earlier one that won). Never throws: a store that cannot
    // be reached is logged and `record` returned.
    FaultRecord publish(const FaultRecord& record);
    // Another rank's record as the watcher saw it, else nullopt. Cheap (no store request).
    std::optional<FaultRecord> peer_fault() const;
    // Asks the store now (after a collective failed: was it a peer's failure?).
    std::optional<FaultRecord> check_now();

    // Normal end of the job: stops the watcher, then says this rank is leaving. Rank 0 (which
    // hosts the store) then waits until every rank has said so, a fault record appears, or
    // leave_timeout passes.
    void leave();
    // End after a failure: stops the watcher and says this rank is leaving. Rank 0 with a record in
    // its store keeps it up until every other rank has read the record (at most 4 poll intervals
    // + 1 s), so that they report the real cause rather than a lost store.
    void leave_after_failure();

  private:
    void watch();
    void stop_watcher();
    void deliver(const FaultRecord& record);
    std::optional<FaultRecord> read_record(c10d::Store& store);
    FaultRecord lost_record() const;

    int rank_, world_size_;
    FaultChannelOptions options_;
    std::function<void(const FaultRecord&)> on_peer_fault_;
    c10::intrusive_ptr<c10d::Store> store_;        // caller's thread (publish, check_now, leave)
    c10::intrusive_ptr<c10d::Store> watch_store_;  // watcher thread only
    mutable std::mutex mutex_;                     // guards peer_fault_, delivered_, stopping_
    std::condition_variable cv_;
    std::optional<FaultRecord> peer_fault_;
    bool delivered_ = false;
    bool stopping_ = false;
    bool left_ = false;
    std::thread thread_;
};

// A detached thread that ends the process with `exit_code` after `after` unless it ended first:
// the bound on a rank's exit once the job is failing, whatever its main thread is blocked in.
void exit_after(std::chrono::milliseconds after, int exit_code, std::string why);

}  // namespace dtune::dist
