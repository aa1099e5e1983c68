// The out-of-band fault channel (see fault_channel.h). Keys live outside the backend's prefix
// ("dtune/0/..."), so they never collide with what Gloo/NCCL keep in the store.
#include "dist/fault_channel.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "core/log.h"

namespace dtune::dist {
namespace {

const std::string kRecordKey = "dtune/fault/record";
const std::string kSeenKey = "dtune/fault/seen";        // ranks that read a peer's record
const std::string kLeavingKey = "dtune/fault/leaving";  // ranks whose watcher has stopped

std::vector<uint8_t> bytes(const std::string& s) {
    return {s.begin(), s.end()};
}

// Store requests of the watcher fail fast instead of after the rendezvous timeout (minutes).
constexpr auto kRequestTimeout = std::chrono::seconds(5);

}  // namespace

FaultChannel::FaultChannel(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                           FaultChannelOptions options, std::function<void(const FaultRecord&)> on_peer_fault)
    : rank_(rank),
      world_size_(world_size),
      options_(std::move(options)),
      on_peer_fault_(std::move(on_peer_fault)),
      store_(store->clone()),
      watch_store_(store->clone()) {
    watch_store_->setTimeout(kRequestTimeout);
    thread_ = std::thread([this] { watch(); });
}

FaultChannel::~FaultChannel() {
    stop_watcher();
}

void FaultChannel::stop_watcher() {
    {
        std::lock_guard lock(mutex_);
        stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
}

std::optional<FaultRecord> FaultChannel::read_record(c10d::Store& store) {
    if (!store.check({kRecordKey})) return std::nullopt;
    const auto value = store.get(kRecordKey);
    return decode(std::string(value.begin(), value.end()));
}

FaultRecord FaultChannel::lost_record() const {
    FaultRecord r;
    r.rank = 0;
    r.exit_code = static_cast<int>(ExitCode::kError);
    r.kind = "lost";
    r.message = str("the job's store on rank 0 (", options_.store_address,
                    ") stopped answering: rank 0 exited or its node is unreachable");
    return r;
}

void FaultChannel::deliver(const FaultRecord& record) {
    {
        std::lock_guard lock(mutex_);
        if (delivered_) return;
        delivered_ = true;
        peer_fault_ = record;
    }
    if (on_peer_fault_) on_peer_fault_(record);
}

void FaultChannel::watch() {
    int failures = 0;
    std::unique_lock lock(mutex_);
    while (!cv_.wait_for(lock, options_.poll_interval, [this] { return stopping_; })) {
        lock.unlock();
        try {
            if (auto record = read_record(*watch_store_)) {
                if (record->rank == rank_) return;  // our own failure: nothing left to watch for
                watch_store_->add(kSeenKey, 1);
                deliver(*record);
                return;
            }
            failures = 0;
        } catch (const std::exception& e) {
            // Rank 0 hosts the store in-process: an error there is not a lost peer.
            if (rank_ == 0) {
                if (failures++ == 0) log::warn() << "fault channel: store request failed: " << e.what();
            } else if (++failures >= 2) {
                deliver(lost_record());
                return;
            }
        }
        lock.lock();
    }
}

FaultRecord publish_fault_record(c10d::Store& store, const FaultRecord& record) {
    const auto now = store.compareSet(kRecordKey, {}, bytes(encode(record)));
    if (auto current = decode(std::string(now.begin(), now.end()))) return *current;
    return record;
}

FaultRecord FaultChannel::publish(const FaultRecord& record) {
    try {
        return publish_fault_record(*store_, record);
    } catch (const std::exception& e) {
        log::warn() << "fault channel: could not publish rank " << record.rank << "'s failure: " << e.what();
    }
    return record;
}

std::optional<FaultRecord> FaultChannel::peer_fault() const {
    std::lock_guard lock(mutex_);
    return peer_fault_;
}

std::optional<FaultRecord> FaultChannel::check_now() {
    if (auto seen = peer_fault()) return seen;
    try {
        auto record = read_record(*store_);
        if (!record || record->rank == rank_) return std::nullopt;
        deliver(*record);
    } catch (const std::exception&) {
        if (rank_ == 0) return std::nullopt;
        deliver(lost_record());
    }
    return peer_fault();
}

void FaultChannel::leave() {
    stop_watcher();
    if (left_) return;
    left_ = true;
    try {
        store_->add(kLeavingKey, 1);
        if (rank_ != 0) return;
        const auto deadline = std::chrono::steady_clock::now() + options_.leave_timeout;
        while (store_->add(kLeavingKey, 0) < world_size_ && !store_->check({kRecordKey})) {
            if (std::chrono::steady_clock::now() >= deadline) {
                log::warn() << "fault channel: not every rank finished within "
                            << options_.leave_timeout.count() / 1000 << " s of rank 0; closing the store";
                return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
    } catch (const std::exception& e) {
        log::warn() << "fault channel: leaving: " << e.what();
    }
}

void FaultChannel::leave_after_failure() {
    stop_watcher();
    if (left_) return;
    left_ = true;
    if (auto seen = peer_fault(); seen && seen->kind == "lost") return;  // no store left to tell
    try {
        store_->add(kLeavingKey, 1);
        if (rank_ != 0 || !store_->check({kRecordKey}) || peer_fault()) return;
        // This rank failed and hosts the store: let the others read why before it goes.
        const auto deadline =
            std::chrono::steady_clock::now() + 4 * options_.poll_interval + std::chrono::seconds(1);
        while (store_->add(kSeenKey, 0) < world_size_ - 1 && std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } catch (const std::exception& e) {
        log::warn() << "fault channel: leaving after a failure: " << e.what();
    }
}

void exit_after(std::chrono::milliseconds after, int exit_code, std::string why) {
    std::thread([after, exit_code, why = std::move(why)] {
        std::this_thread::sleep_for(after);
        const std::string line = str("dtune: ", why, "; still running ", after.count() / 1000.0,
                                     " s later, exiting with code ", exit_code, "\n");
        [[maybe_unused]] auto n = ::write(STDERR_FILENO, line.data(), line.size());
        std::_Exit(exit_code);
    }).detach();
}

}  // namespace dtune::dist
