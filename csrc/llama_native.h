// Native Llama forward for the CPU draft model: thread pool and SIMD kernels (header of llama_native.cpp).
//
// Kept apart from the CPython glue so the kernels read as plain C++. Everything is in an anonymous namespace:
// this header is included by exactly one translation unit.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
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

// ------------------------------------------------------------------ model and one forward's inputs
struct Shape {
    int vocab, d, layers, heads, kv_heads, head_dim, inter, max_pos;
    float eps;
    int q_dim() const { return heads * head_dim; }
    int kv_dim() const { return kv_heads * head_dim; }
    int qkv_dim() const { return q_dim() + 2 * kv_dim(); }
};

// Weights as handed over by Python: HF Linear layout [out, in], bf16 (uint16) or fp32 (one type per model).
// qkv = q|k|v rows; gate/up interleaved by row (2i = gate_i, 2i+1 = up_i) so one thread owns both halves.
struct LayerW {
    const void* qkv;
    const void* o;
    const void* gate_up;
    const void* down;
    const float* attn_norm;
    const float* mlp_norm;
};

struct Weights {
    bool bf16;
    const void* embed;    // [vocab, d]
    const void* lm_head;  // [vocab, d]
    const float* final_norm;
    std::vector<LayerW> layers;
    const float* cos;  // [max_pos, head_dim / 2]
    const float* sin;
};

struct Scratch {  // shared buffers of one forward, sized by the Python call before the threads start
    std::vector<float> x, xn, qkv, att, act, xw;  // residual, normed, q|k|v, attention out, MLP act, wanted rows
    std::vector<float> part_o, part_m, part_s;  // attention chunks: outputs [M*H*parts, hd], maxima, sums
    std::vector<std::vector<float>> local_xn, scores, qrot;  // per thread
};

struct Forward {  // one call: M new tokens of n_items requests
    const Shape* s;
    const Weights* w;
    Scratch* buf;
    Pool* pool;
    int M;
    const int32_t* tokens;    // [M]
    const int32_t* pos;       // [M] rotary positions
    const int32_t* tok_item;  // [M] item of each token
    const int32_t* tok_j;     // [M] index of the token within its item
    const int32_t* cached;    // [items] filled slots before this call
    const int32_t* n_new;     // [items]
    float* const* cache;      // [items] -> [layers, 2, kv_heads, capacity, head_dim]
    const int32_t* caps;      // [items] capacity of each cache
    const int64_t* mask_off;  // [items] byte offset of the item's [n_new, cached + n_new] mask, -1 = causal
    const uint8_t* masks;
    int n_want;
    const int32_t* want;  // [n_want] token indices whose logits are returned
    float* out;           // [n_want, vocab]
    int attn_parts;       // chunks per (token, head) of the attention phase
    int topk;             // > 0: also the top-k softmax of every wanted row
    float* top_p;         // [n_want, topk]
    int32_t* top_id;      // [n_want, topk]
};

// ------------------------------------------------------------------ scalar helpers shared by every SIMD width
inline float bf16_to_f32(uint16_t v) { return std::bit_cast<float>(uint32_t(v) << 16); }
inline float to_f32(uint16_t v) { return bf16_to_f32(v); }
inline float to_f32(float v) { return v; }

}  // namespace
