// Native CPU forward of the Llama draft model (specdec.drafters._llama_native), used by backend "native".
//
// Python (drafters/model_native.py) owns the weights (numpy arrays in the layout of llama_native.h) and every
// request's KV cache; this module borrows them through the buffer protocol. A forward appends M tokens of any
// number of requests and returns the logits of the wanted tokens. The work runs on a private thread pool with
// the GIL released: SIMD kernels compiled for AVX-512, AVX2+FMA and SSE2 (picked at load by CPU features, or
// forced), weights bf16 (exact for bf16 checkpoints, half the bytes) or fp32.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <memory>
#include <mutex>
#include <string>

#include <unistd.h>

#include "llama_native.h"

namespace {
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace k16 {
#define SPECDEC_LANES 16
#include "llama_kernels.inc"
#undef SPECDEC_LANES
}  // namespace k16
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace k8 {
#define SPECDEC_LANES 8
#include "llama_kernels.inc"
#undef SPECDEC_LANES
}  // namespace k8
#pragma GCC pop_options
#endif
namespace k4 {
#define SPECDEC_LANES 4
#include "llama_kernels.inc"
#undef SPECDEC_LANES
}  // namespace k4

constexpr int kLocalRows = 16;  // = kLocalNormMax of the kernels: per-thread normed rows
constexpr int kMinChunk = 256;  // attention positions per chunk at least (a chunk costs a merge and a barrier)
constexpr const char* kCapsule = "specdec.llama_native.Model";

struct Buf {  // a borrowed contiguous buffer, released on scope exit
    Py_buffer b{};
    bool ok = false;
    ~Buf() {
        if (ok) PyBuffer_Release(&b);
    }
    template <class T>
    T* ptr() const { return static_cast<T*>(b.buf); }
    Py_ssize_t count() const { return b.itemsize ? b.len / b.itemsize : 0; }
};

bool get_buf(PyObject* obj, Buf& out, const char* name, Py_ssize_t itemsize, bool writable) {
    if (PyObject_GetBuffer(obj, &out.b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s buffer", name, writable ? " writable" : "");
        return false;
    }
    out.ok = true;
    if (out.b.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: item size %zd, expected %zd", name, out.b.itemsize, itemsize);
        return false;
    }
    return true;
}

struct Model {
    Shape s{};
    Weights w{};
    Scratch buf;
    std::unique_ptr<Pool> pool;
    Pool::Job job = nullptr;
    std::string isa;
    std::vector<std::unique_ptr<Buf>> held;  // the weight buffers, kept alive
    std::vector<int32_t> tok_item, tok_j, n_new;
    std::mutex mu;
    pid_t owner = getpid();  // the pool's threads exist only in the process that created it

    const void* hold(PyObject* obj, const char* name, size_t count, bool weight) {  // nullptr + error set on failure
        auto b = std::make_unique<Buf>();
        if (!get_buf(obj, *b, name, weight ? (w.bf16 ? 2 : 4) : 4, false)) return nullptr;
        if (size_t(b->count()) != count) {
            PyErr_Format(PyExc_ValueError, "%s: %zd elements, expected %zu", name, b->count(), count);
            return nullptr;
        }
        const void* p = b->b.buf;
        held.push_back(std::move(b));
        return p;
    }

    void size_scratch(int M, int n_want, int max_ctx, int parts) {
        const size_t rows = size_t(std::max(M, n_want));
        auto grow = [](std::vector<float>& v, size_t n) {
            if (v.size() < n) v.resize(n);
        };
        grow(buf.x, rows * s.d);
        grow(buf.xn, rows * s.d);
        grow(buf.qkv, size_t(M) * s.qkv_dim());
        grow(buf.att, size_t(M) * s.q_dim());
        grow(buf.act, size_t(M) * s.inter);
        grow(buf.part_o, size_t(M) * s.heads * parts * s.head_dim);
        grow(buf.part_m, size_t(M) * s.heads * parts);
        grow(buf.part_s, size_t(M) * s.heads * parts);
        const int T = pool->size();
        buf.local_xn.resize(T);
        buf.scores.resize(T);
        buf.qrot.resize(T);
        for (int t = 0; t < T; ++t) {
            grow(buf.local_xn[t], size_t(kLocalRows) * s.d);
            grow(buf.scores[t], size_t(max_ctx));
            grow(buf.qrot[t], size_t(s.head_dim));
        }
    }
};

// chunks per (token, head) in attention: enough tasks for every thread, but no chunk under kMinChunk positions
int attn_parts(int tasks, int threads, int max_ctx) {
    if (tasks >= threads) return 1;
    return std::max(1, std::min((threads + tasks - 1) / tasks, max_ctx / kMinChunk));
}

Pool::Job pick_isa(const std::string& want, std::string& name) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if ((want == "auto" && has512) || (want == "avx512" && has512)) return name = "avx512", k16::forward_job;
    if ((want == "auto" && has2) || (want == "avx2" && has2)) return name = "avx2", k8::forward_job;
    if (want == "avx512" || want == "avx2") return nullptr;
#endif
    if (want != "auto" && want != "sse") return nullptr;
    return name = "sse", k4::forward_job;
}

void destroy(PyObject* cap) {
    Model* m = static_cast<Model*>(PyCapsule_GetPointer(cap, kCapsule));
    if (m && getpid() != m->owner) return;  // forked child: joining the parent's threads here is undefined; leak
    delete m;
}

Model* get_model(PyObject* cap) { return static_cast<Model*>(PyCapsule_GetPointer(cap, kCapsule)); }

// create(shape, bf16, embed, lm_head, final_norm, layers, cos, sin, threads, cpus, spin_us, isa) -> model
PyObject* create(PyObject*, PyObject* args) {
    PyObject *shape, *embed, *head, *fnorm, *layers, *cos, *sin, *cpus;
    int bf16, threads, spin_us;
    const char* isa;
    if (!PyArg_ParseTuple(args, "O!pOOOO!OOiO!is", &PyTuple_Type, &shape, &bf16, &embed, &head, &fnorm,
                          &PyList_Type, &layers, &cos, &sin, &threads, &PyList_Type, &cpus, &spin_us, &isa))
        return nullptr;
    auto m = std::make_unique<Model>();
    Shape& s = m->s;
    if (!PyArg_ParseTuple(shape, "iiiiiiiif", &s.vocab, &s.d, &s.layers, &s.heads, &s.kv_heads, &s.head_dim,
                          &s.inter, &s.max_pos, &s.eps))
        return nullptr;
    if (s.kv_heads <= 0 || s.heads % s.kv_heads || s.head_dim % 2 || PyList_GET_SIZE(layers) != s.layers) {
        PyErr_SetString(PyExc_ValueError, "shape: heads must be a multiple of kv_heads, head_dim even, "
                                          "one weight tuple per layer");
        return nullptr;
    }
    m->w.bf16 = bf16;
    const size_t d = s.d, V = s.vocab, I = s.inter;
    if (!(m->w.embed = m->hold(embed, "embed", V * d, true)) || !(m->w.lm_head = m->hold(head, "lm_head", V * d, true)) ||
        !(m->w.final_norm = static_cast<const float*>(m->hold(fnorm, "final_norm", d, false))) ||
        !(m->w.cos = static_cast<const float*>(m->hold(cos, "cos", size_t(s.max_pos) * s.head_dim / 2, false))) ||
        !(m->w.sin = static_cast<const float*>(m->hold(sin, "sin", size_t(s.max_pos) * s.head_dim / 2, false))))
        return nullptr;
    for (int l = 0; l < s.layers; ++l) {
        PyObject *qkv, *o, *gu, *down, *an, *mn;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(layers, l), "OOOOOO", &qkv, &o, &gu, &down, &an, &mn)) return nullptr;
        LayerW lw{};
        if (!(lw.qkv = m->hold(qkv, "qkv", size_t(s.qkv_dim()) * d, true)) ||
            !(lw.o = m->hold(o, "o", d * s.q_dim(), true)) || !(lw.gate_up = m->hold(gu, "gate_up", 2 * I * d, true)) ||
            !(lw.down = m->hold(down, "down", d * I, true)) ||
            !(lw.attn_norm = static_cast<const float*>(m->hold(an, "attn_norm", d, false))) ||
            !(lw.mlp_norm = static_cast<const float*>(m->hold(mn, "mlp_norm", d, false))))
            return nullptr;
        m->w.layers.push_back(lw);
    }
    std::vector<int> cpu_ids;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(cpus); ++i) cpu_ids.push_back(int(PyLong_AsLong(PyList_GET_ITEM(cpus, i))));
    if (PyErr_Occurred()) return nullptr;
    if (!(m->job = pick_isa(isa, m->isa))) {
        PyErr_Format(PyExc_ValueError, "isa=%s is not available on this CPU (valid: auto, avx512, avx2, sse)", isa);
        return nullptr;
    }
    m->pool = std::make_unique<Pool>(threads, cpu_ids, spin_us);
    PyObject* cap = PyCapsule_New(m.get(), kCapsule, destroy);
    if (cap) m.release();
    return cap;
}

// checks of one forward's index arrays; returns false with a ValueError set
bool check_batch(const Model& m, const Forward& f, int n_items, const int32_t* item_start, const int32_t* caps,
                 Py_ssize_t mask_bytes) {
    const Shape& s = m.s;
    if (item_start[0] != 0 || item_start[n_items] != f.M) {
        PyErr_Format(PyExc_ValueError, "item_start must run from 0 to the token count %d", f.M);
        return false;
    }
    for (int i = 0; i < n_items; ++i) {
        const int n = f.n_new[i];
        if (n < 0 || f.cached[i] < 0 || f.cached[i] + n > caps[i]) {
            PyErr_Format(PyExc_ValueError, "item %d: %d cached + %d new tokens exceed its cache capacity %d", i,
                         f.cached[i], n, caps[i]);
            return false;
        }
        const int64_t off = f.mask_off[i];
        if (off >= 0 && off + int64_t(n) * (f.cached[i] + n) > mask_bytes) {
            PyErr_Format(PyExc_ValueError, "item %d: its mask runs past the mask buffer", i);
            return false;
        }
    }
    for (int t = 0; t < f.M; ++t) {
        if (f.tokens[t] < 0 || f.tokens[t] >= s.vocab || f.pos[t] < 0 || f.pos[t] >= s.max_pos) {
            PyErr_Format(PyExc_ValueError, "token %d: id %d must be in [0, %d) and position %d in [0, %d)", t,
                         f.tokens[t], s.vocab, f.pos[t], s.max_pos);
            return false;
        }
    }
    for (int k = 0; k < f.n_want; ++k) {
        if (f.want[k] < 0 || f.want[k] >= f.M) {
            PyErr_Format(PyExc_ValueError, "want[%d]=%d is not a token index in [0, %d)", k, f.want[k], f.M);
            return false;
        }
    }
    return true;
}

void embed_tokens(Model& m, const Forward& f) {
    const size_t d = m.s.d;
    float* x = m.buf.x.data();
    for (int t = 0; t < f.M; ++t) {
        float* row = x + size_t(t) * d;
        if (m.w.bf16) {
            const uint16_t* e = static_cast<const uint16_t*>(m.w.embed) + size_t(f.tokens[t]) * d;
            for (size_t k = 0; k < d; ++k) row[k] = bf16_to_f32(e[k]);
        } else {
            std::memcpy(row, static_cast<const float*>(m.w.embed) + size_t(f.tokens[t]) * d, sizeof(float) * d);
        }
    }
}

// forward(model, tokens, positions, item_start, cache_addrs, cached, caps, mask_off, masks, want, out
//         [, top_p, top_id]): with the last two ([n_want, k] float32 / int32), also each wanted row's top-k softmax
PyObject* forward(PyObject*, PyObject* args) {
    PyObject *cap, *o_tok, *o_pos, *o_start, *o_addr, *o_cached, *o_caps, *o_moff, *o_masks, *o_want, *o_out;
    PyObject *o_tp = nullptr, *o_ti = nullptr;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO|OO", &cap, &o_tok, &o_pos, &o_start, &o_addr, &o_cached, &o_caps,
                          &o_moff, &o_masks, &o_want, &o_out, &o_tp, &o_ti))
        return nullptr;
    Model* m = get_model(cap);
    if (!m) return nullptr;
    if (getpid() != m->owner) {  // a forked child has the pool object but not its threads: fail, never hang
        PyErr_SetString(PyExc_RuntimeError, "native draft backend used in a forked process (its worker threads "
                                            "live in the parent); build the backend in the process that uses it");
        return nullptr;
    }
    Buf tok, pos, start, addr, cached, caps, moff, masks, want, out;
    if (!get_buf(o_tok, tok, "tokens", 4, false) || !get_buf(o_pos, pos, "positions", 4, false) ||
        !get_buf(o_start, start, "item_start", 4, false) || !get_buf(o_addr, addr, "cache_addrs", 8, false) ||
        !get_buf(o_cached, cached, "cached", 4, false) || !get_buf(o_caps, caps, "caps", 4, false) ||
        !get_buf(o_moff, moff, "mask_off", 8, false) || !get_buf(o_masks, masks, "masks", 1, false) ||
        !get_buf(o_want, want, "want", 4, false) || !get_buf(o_out, out, "out", 4, true))
        return nullptr;
    Buf tp, ti;
    int topk = 0;
    if (o_tp || o_ti) {
        if (!o_tp || !o_ti || !get_buf(o_tp, tp, "top_p", 4, true) || !get_buf(o_ti, ti, "top_id", 4, true)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "forward: pass both top_p and top_id");
            return nullptr;
        }
        topk = want.count() ? int(tp.count() / want.count()) : 0;
        if (tp.count() != ti.count() || (want.count() && (topk < 1 || topk > m->s.vocab ||
                                                          tp.count() != Py_ssize_t(topk) * want.count()))) {
            PyErr_SetString(PyExc_ValueError, "forward: top_p and top_id must both be [n_want, k], 1 <= k <= vocab");
            return nullptr;
        }
    }
    const int M = int(tok.count()), n_items = int(start.count()) - 1, n_want = int(want.count());
    if (pos.count() != M || n_items < 0 || addr.count() != n_items || cached.count() != n_items ||
        caps.count() != n_items || moff.count() != n_items || out.count() != Py_ssize_t(n_want) * m->s.vocab) {
        PyErr_SetString(PyExc_ValueError, "forward: array lengths disagree (tokens/positions: M; cache_addrs, "
                                          "cached, caps, mask_off: items; item_start: items + 1; out: want x vocab)");
        return nullptr;
    }
    if (M == 0) Py_RETURN_NONE;  // nothing to append (n_want == 0 still appends: the cache must grow)
    const int32_t* st = start.ptr<int32_t>();
    m->tok_item.resize(M);
    m->tok_j.resize(M);
    m->n_new.resize(n_items);
    int max_ctx = 1;
    for (int i = 0; i < n_items; ++i) {
        if (st[i + 1] < st[i]) {
            PyErr_SetString(PyExc_ValueError, "item_start must be non-decreasing");
            return nullptr;
        }
        m->n_new[i] = st[i + 1] - st[i];
        max_ctx = std::max(max_ctx, cached.ptr<int32_t>()[i] + m->n_new[i]);
        for (int t = st[i]; t < st[i + 1]; ++t) m->tok_item[t] = i, m->tok_j[t] = t - st[i];
    }
    Forward f{&m->s, &m->w, &m->buf, m->pool.get(), M, tok.ptr<int32_t>(), pos.ptr<int32_t>(), m->tok_item.data(),
              m->tok_j.data(), cached.ptr<int32_t>(), m->n_new.data(), addr.ptr<float* const>(), caps.ptr<int32_t>(), moff.ptr<int64_t>(),
              masks.ptr<uint8_t>(), n_want, want.ptr<int32_t>(), out.ptr<float>(),
              attn_parts(m->s.heads * M, m->pool->size(), max_ctx), topk,
              topk ? tp.ptr<float>() : nullptr, topk ? ti.ptr<int32_t>() : nullptr};
    if (!check_batch(*m, f, n_items, st, caps.ptr<int32_t>(), masks.b.len)) return nullptr;
    Py_BEGIN_ALLOW_THREADS
    {
        std::lock_guard<std::mutex> lock(m->mu);  // one forward at a time per model
        m->size_scratch(M, n_want, max_ctx, f.attn_parts);
        embed_tokens(*m, f);
        m->pool->run(m->job, &f);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* info(PyObject*, PyObject* args) {
    PyObject* cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return nullptr;
    Model* m = get_model(cap);
    if (!m) return nullptr;
    return Py_BuildValue("{s:s,s:i,s:s}", "isa", m->isa.c_str(), "threads", m->pool->size(), "weights",
                         m->w.bf16 ? "bf16" : "fp32");
}

PyObject* isas(PyObject*, PyObject*) {  // the kernel widths this CPU runs, widest first
    PyObject* out = PyList_New(0);
    if (!out) return nullptr;
    for (const char* name : {"avx512", "avx2", "sse"}) {
        std::string got;
        if (!pick_isa(name, got)) continue;
        PyObject* item = PyUnicode_FromString(name);
        const int rc = item ? PyList_Append(out, item) : -1;
        Py_XDECREF(item);
        if (rc != 0) {
            Py_DECREF(out);
            return nullptr;
        }
    }
    return out;
}

PyMethodDef methods[] = {
    {"isas", isas, METH_NOARGS, "isas() -> the kernel widths this CPU runs, widest first"},
    {"create", create, METH_VARARGS,
     "create(shape, bf16, embed, lm_head, final_norm, layers, cos, sin, threads, cpus, spin_us, isa) -> model"},
    {"forward", forward, METH_VARARGS,
     "forward(model, tokens, positions, item_start, cache_addrs, cached, caps, mask_off, masks, want, out)"},
    {"info", info, METH_VARARGS, "info(model) -> {isa, threads, weights}"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_llama_native", "Native CPU forward of the Llama draft model", -1,
                          methods, nullptr, nullptr, nullptr, nullptr};
}  // namespace

PyMODINIT_FUNC PyInit__llama_native(void) { return PyModule_Create(&module_def); }
