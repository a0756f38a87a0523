// A harness for csrc/thread_pool.cpp on its own (tests/kernels/test_thread_pool.py compiles and runs
// it): results at any thread count, nested regions, two callers at once, resizing between regions,
// an exception in a part, and a forked child. Prints one "ok <check>" line per check; exits non-zero
// on the first failure. `nofork` skips the fork check (ThreadSanitizer cannot follow one).
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "thread_pool.h"

using namespace tmk;

#define CHECK(cond, name)                                        \
    do {                                                         \
        if (!(cond)) {                                           \
            std::printf("FAILED %s (line %d)\n", name, __LINE__); \
            return 1;                                            \
        }                                                        \
    } while (0)

// Each index written once, by whichever thread runs its range.
static bool squares(int64_t n, int64_t grain) {
    std::vector<int64_t> out(size_t(n), -1);
    std::vector<std::atomic<int>> visits(static_cast<size_t>(n));
    parallel_for(n, grain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            out[size_t(i)] = i * i;
            visits[size_t(i)].fetch_add(1);
        }
    });
    for (int64_t i = 0; i < n; ++i)
        if (out[size_t(i)] != i * i || visits[size_t(i)].load() != 1) return false;
    return true;
}

int main(int argc, char** argv) {
    const bool fork_check = !(argc > 1 && std::strcmp(argv[1], "nofork") == 0);

    for (int t : {1, 2, 3, 4, 7, 16})
        for (int64_t n : {1, 2, 5, 17, 100, 1000})
            for (int64_t grain : {1, 3, 64}) {
                set_num_threads(t);
                CHECK(squares(n, grain), "every index once, any thread count");
            }
    std::printf("ok ranges\n");

    set_num_threads(4);
    pool::reset_stats();
    for (int r = 0; r < 20000; ++r) {
        std::atomic<int> parts{0};
        run(4, [&](int, int) { parts.fetch_add(1); });
        CHECK(parts.load() == 4, "each part once");
    }
    pool::Stats s = pool::stats();
    CHECK(s.regions == 20000 && s.threads == 4, "regions counted");
    std::printf("ok regions\n");

    std::atomic<int64_t> inner{0};
    std::atomic<int> inner_parts{0};
    parallel_for(8, 1, [&](int64_t, int64_t) {
        run(4, [&](int, int n) { inner_parts.fetch_add(n); });  // nested: inline, one part
        parallel_for(10, 1, [&](int64_t b, int64_t e) { inner.fetch_add(e - b); });
    });
    CHECK(inner.load() == 40 && inner_parts.load() == 4, "nested regions run inline");
    std::printf("ok nested\n");

    std::atomic<int64_t> a_sum{0}, b_sum{0};
    auto caller = [](std::atomic<int64_t>* sum) {
        for (int r = 0; r < 5000; ++r) parallel_for(64, 1, [&](int64_t b, int64_t e) { sum->fetch_add(e - b); });
    };
    std::thread a(caller, &a_sum), b(caller, &b_sum);
    a.join();
    b.join();
    CHECK(a_sum.load() == 5000 * 64 && b_sum.load() == 5000 * 64, "two callers at once");
    std::printf("ok concurrent\n");

    for (int r = 0; r < 300; ++r) {
        set_num_threads(1 + r % 6);
        CHECK(squares(50, 1), "resized between regions");
    }
    std::printf("ok resize\n");

    set_num_threads(4);
    bool caught = false;
    try {
        run(4, [](int i, int) {
            if (i == 2) throw std::runtime_error("part 2");
        });
    } catch (const std::runtime_error& e) {
        caught = std::strcmp(e.what(), "part 2") == 0;
    }
    CHECK(caught, "an exception in a part reaches the caller");
    CHECK(squares(100, 1), "the pool works after an exception");
    std::printf("ok exception\n");

    if (fork_check) {
        CHECK(squares(100, 1), "pool started before the fork");
        const pid_t pid = fork();
        if (pid == 0) {
            const bool ok = squares(1000, 1) && pool::stats().threads == 4;
            _exit(ok ? 0 : 3);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "a forked child gets a working pool");
        CHECK(squares(100, 1), "the parent's pool still works");
        std::printf("ok fork\n");
    }
    return 0;
}
