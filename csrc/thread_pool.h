// SPMD thread pool of the native draft-model forward (llama_native.cpp): every thread runs every job, with
// barriers inside. Header-only, in an anonymous namespace. (The suffix engine's lane job uses WorkerPool in
// worker_pool.inc instead: independent rows handed out one at a time, a late helper never holds the caller up.)
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

constexpr int kSpinsBeforeYield = 1 << 12;  // barrier / join spins before sched_yield (a preempted peer)
constexpr int kClockEvery = 256;            // idle-spin iterations between clock reads

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

// ------------------------------------------------------------------ thread pool (SPMD: every thread runs the job)
// run(job) wakes the workers, runs job(0) on the caller and waits for all. Inside a job, barrier() syncs all
// threads. Idle workers spin for `spin_us` after a job (the drafter calls forward back to back), then sleep on
// a futex (std::atomic::wait), so an idle drafter costs no CPU.
class Pool {
  public:
    using Job = void (*)(void* ctx, int tid);

    Pool(int threads, const std::vector<int>& cpus, int spin_us) : n_(std::max(1, threads)), spin_us_(spin_us) {
        for (int t = 1; t < n_; ++t) {
            workers_.emplace_back([this, t, cpus] {
                if (!cpus.empty()) pin(cpus[t % cpus.size()]);
                loop(t);
            });
        }
    }
    ~Pool() {
        stop_.store(true, std::memory_order_release);
        gen_.fetch_add(1, std::memory_order_acq_rel);
        gen_.notify_all();
        for (auto& w : workers_) w.join();
    }
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;

    int size() const { return n_; }

    void run(Job job, void* ctx) {
        job_ = job;
        ctx_ = ctx;
        pending_.store(n_ - 1, std::memory_order_relaxed);
        gen_.fetch_add(1, std::memory_order_release);
        gen_.notify_all();
        job(ctx, 0);
        for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
            cpu_relax();
            if (spins > kSpinsBeforeYield) sched_yield();
        }
    }

    void barrier() {
        if (n_ == 1) return;
        const uint32_t g = bar_gen_.load(std::memory_order_acquire);
        if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
            bar_count_.store(0, std::memory_order_relaxed);
            bar_gen_.fetch_add(1, std::memory_order_release);
            return;
        }
        for (int spins = 0; bar_gen_.load(std::memory_order_acquire) == g; ++spins) {
            cpu_relax();
            if (spins > kSpinsBeforeYield) sched_yield();
        }
    }

  private:
    static void pin(int cpu) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);  // best effort: a bad id leaves it unpinned
    }

    void loop(int tid) {
        uint32_t seen = 0;
        for (;;) {
            const auto t0 = std::chrono::steady_clock::now();
            uint32_t g;
            for (int spins = 1; (g = gen_.load(std::memory_order_acquire)) == seen; ++spins) {
                cpu_relax();
                if (spins % kClockEvery == 0 &&
                    std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_)) {
                    gen_.wait(seen, std::memory_order_acquire);
                }
            }
            seen = g;
            if (stop_.load(std::memory_order_acquire)) return;
            job_(ctx_, tid);
            pending_.fetch_sub(1, std::memory_order_acq_rel);
        }
    }

    const int n_;
    const int spin_us_;
    std::vector<std::thread> workers_;
    Job job_ = nullptr;
    void* ctx_ = nullptr;
    std::atomic<bool> stop_{false};
    alignas(64) std::atomic<uint32_t> gen_{0};
    alignas(64) std::atomic<int> pending_{0};
    alignas(64) std::atomic<int> bar_count_{0};
    alignas(64) std::atomic<uint32_t> bar_gen_{0};
};

}  // namespace
