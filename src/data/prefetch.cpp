// ObjectPrefetcher: fetch threads over a sliding window. See prefetch.h.
#include "data/prefetch.h"

#include <algorithm>

#include "core/error.h"

namespace dtune::data {

ObjectPrefetcher::ObjectPrefetcher(std::vector<std::string> paths, Fetch fetch, int depth)
    : paths_(std::move(paths)),
      fetch_(std::move(fetch)),
      depth_(static_cast<std::size_t>(std::max(1, depth))),
      slots_(paths_.size()) {
    const std::size_t threads = std::min(depth_, paths_.size());
    for (std::size_t t = 0; t < threads; ++t) threads_.emplace_back([this] { worker(); });
}

ObjectPrefetcher::~ObjectPrefetcher() {
    {
        std::lock_guard lock(mutex_);
        stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
}

void ObjectPrefetcher::worker() {
    for (;;) {
        std::size_t i = 0;
        {
            std::unique_lock lock(mutex_);
            cv_.wait(lock, [&] { return stop_ || next_ >= paths_.size() || next_ < lowest_ + depth_; });
            if (stop_ || next_ >= paths_.size()) return;
            i = next_++;
            peak_ = std::max(peak_, ++in_flight_);
        }
        Slot done;
        try {
            done.bytes = fetch_(paths_[i]);
        } catch (...) {
            done.error = std::current_exception();
        }
        {
            std::lock_guard lock(mutex_);
            --in_flight_;
            slots_[i].bytes = std::move(done.bytes);
            slots_[i].error = done.error;
            slots_[i].ready = true;
        }
        cv_.notify_all();
    }
}

std::string ObjectPrefetcher::take(std::size_t i) {
    DTUNE_CHECK(i < slots_.size(), "prefetch index ", i, " is outside the list of ", slots_.size());
    std::unique_lock lock(mutex_);
    DTUNE_CHECK(!slots_[i].taken, "prefetched object ", paths_[i], " was taken twice");
    cv_.wait(lock, [&] { return slots_[i].ready; });
    Slot& s = slots_[i];
    s.taken = true;
    std::string bytes = std::move(s.bytes);
    const std::exception_ptr error = s.error;
    s.bytes = std::string();
    s.error = nullptr;
    while (lowest_ < slots_.size() && slots_[lowest_].taken) ++lowest_;
    lock.unlock();
    cv_.notify_all();
    if (error) std::rethrow_exception(error);
    return bytes;
}

int ObjectPrefetcher::peak_in_flight() const {
    std::lock_guard lock(mutex_);
    return peak_;
}

}  // namespace dtune::data
