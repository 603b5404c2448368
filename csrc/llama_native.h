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

#include "thread_pool.h"



namespace {

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
