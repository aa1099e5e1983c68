#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>

#include "core/thread_pool.h"

namespace dtune {

TEST(ThreadPool, SubmitReturnsValues) {
    ThreadPool pool(3);
    EXPECT_EQ(pool.size(), 3u);
    auto a = pool.submit([] { return 6 * 7; });
    auto b = pool.submit([] { return std::string("ok"); });
    EXPECT_EQ(a.get(), 42);
    EXPECT_EQ(b.get(), "ok");
}

TEST(ThreadPool, ParallelForVisitsEveryIndexOnce) {
    ThreadPool pool(4);
    std::vector<std::atomic<int>> hits(10007);
    pool.parallel_for(hits.size(), [&](std::size_t i) { hits[i]++; });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

TEST(ThreadPool, ExceptionsPropagateAfterAllTasksFinish) {
    ThreadPool pool(2);
    std::atomic<int> done{0};
    EXPECT_THROW(pool.parallel_for(100,
                                   [&](std::size_t i) {
                                       if (i == 17) throw std::runtime_error("bad image 17");
                                       done++;
                                   }),
                 std::runtime_error);
    // Items in other chunks all ran; the chunk holding 17 stopped at 17.
    EXPECT_GE(done.load(), 90);
    auto f = pool.submit([]() -> int { throw std::runtime_error("boom"); });
    EXPECT_THROW(f.get(), std::runtime_error);
}

TEST(ThreadPool, DestructorDrainsQueue) {
    std::atomic<int> n{0};
    {
        ThreadPool pool(2);
        for (int i = 0; i < 200; ++i) pool.submit([&] { n++; });
    }
    EXPECT_EQ(n.load(), 200);
}

TEST(ThreadPool, ZeroMeansHardwareThreads) {
    ThreadPool pool(0);
    EXPECT_GE(pool.size(), 1u);
}

}  // namespace dtune
