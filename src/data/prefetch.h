// A bounded read-ahead over a list of objects: `depth` fetches (S3 GETs) run in parallel, in list
// order, ahead of a consumer that takes each object once, so decoding and encoding do not wait on
// the network when it can keep up. Torch-free.
//
// Invariants: at most `depth` objects are fetched-but-not-taken or in flight at any time (memory
// stays bounded whatever the list's length); the lowest untaken index is always inside the window,
// so a consumer waiting on it always makes progress (no deadlock when consumers take out of order);
// a failed fetch is rethrown by take() of that index only; the destructor stops and joins the
// fetch threads (fetches in flight finish first).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dtune::data {

class ObjectPrefetcher {
  public:
    using Fetch = std::function<std::string(const std::string& path)>;

    // depth >= 1: the number of fetch threads and the read-ahead window.
    ObjectPrefetcher(std::vector<std::string> paths, Fetch fetch, int depth);
    ~ObjectPrefetcher();
    ObjectPrefetcher(const ObjectPrefetcher&) = delete;
    ObjectPrefetcher& operator=(const ObjectPrefetcher&) = delete;

    std::size_t size() const { return paths_.size(); }
    const std::string& path(std::size_t i) const { return paths_.at(i); }
    // The bytes of paths[i], waiting for its fetch; each index may be taken once.
    std::string take(std::size_t i);
    // The most fetches seen in flight at once (tests and logs).
    int peak_in_flight() const;

  private:
    struct Slot {
        bool ready = false;
        bool taken = false;
        std::string bytes;
        std::exception_ptr error;
    };
    void worker();

    std::vector<std::string> paths_;
    Fetch fetch_;
    std::size_t depth_;
    std::vector<Slot> slots_;
    std::size_t next_ = 0;    // next index to fetch
    std::size_t lowest_ = 0;  // lowest untaken index
    int in_flight_ = 0, peak_ = 0;
    bool stop_ = false;
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::vector<std::thread> threads_;
};

}  // namespace dtune::data
