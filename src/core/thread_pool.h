// A fixed-size thread pool for CPU work (image header scans, decoding, cache writes).
// Tasks return futures; an exception thrown in a task is rethrown by future::get().
// Destruction waits for queued tasks to finish.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>
#include <type_traits>
#include <vector>

namespace dtune {

// The CPUs this process may run on: its affinity mask (a cgroup cpuset or taskset limit), not the
// host's count; at least 1.
int usable_cpus();

class ThreadPool {
  public:
    // threads == 0 means one per hardware thread.
    explicit ThreadPool(std::size_t threads = 0);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    std::size_t size() const { return workers_.size(); }

    template <typename F>
    auto submit(F&& fn) -> std::future<std::invoke_result_t<F>> {
        using R = std::invoke_result_t<F>;
        auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
        std::future<R> result = task->get_future();
        enqueue([task] { (*task)(); });
        return result;
    }

    // Runs fn(i) for i in [0, n) across the pool and waits. Rethrows the first exception (by
    // index) after every task has finished, so no task outlives the call.
    void parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn);

  private:
    void enqueue(std::function<void()> job);
    void worker_loop();

    std::vector<std::thread> workers_;
    std::queue<std::function<void()>> jobs_;
    std::mutex mutex_;
    std::condition_variable cv_;
    bool stopping_ = false;
};

}  // namespace dtune
