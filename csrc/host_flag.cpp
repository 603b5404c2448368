// specdec._host_flag: a 32-bit sequence word in pinned host memory that a CUDA stream waits on
// (cuStreamWaitValue32, GEQ) and a watchdog thread that releases the word if its owner does not.
//
// Schedule mode's device wait: the runner enqueues "wait until word >= seq" ahead of the host-to-device copy
// of a step's drafts, goes on preparing the step, and stores seq once the drafts are in the pinned buffer. If
// that store never comes (a bug, a host blocked on the stream before it, e.g. loading a kernel lazily), the GPU
// would wait forever and the engine with it; the watchdog stores seq instead (the step then verifies whatever
// the buffer holds: any token id is lossless). The watchdog runs without the GIL, so a Python thread blocked in a
// CUDA call holding the GIL cannot keep it from releasing the stream.
//
// Two deadlines per armed value: a long one from arming (the stall bound), and, with a second word ("reached",
// which the stream itself writes with seq right before it starts waiting: cuStreamWriteValue32), a short one
// (grace) from the moment the watchdog sees the GPU waiting. So drafting gets `grace` of GPU idle time however
// long the previous step ran; the watchdog polls the reached word every kPollUs while armed and not reached.
//
// Values compare cyclically, as the driver's GEQ does: a >= b iff (int32_t)(a - b) >= 0.
// Plain CPython C API.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kPollUs = 200;  // watchdog: how often it looks at the reached word while the GPU has not arrived

bool cyclic_less(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) < 0; }

struct State {
    std::atomic<uint32_t>* word = nullptr;
    std::atomic<uint32_t>* reached = nullptr;  // written by the stream as it starts waiting (optional)
    std::mutex mu;
    std::condition_variable cv;
    uint32_t armed = 0;  // value the watchdog stores at the deadline
    Clock::time_point deadline{};  // the long deadline (from arming)
    int64_t grace_us = 0;  // the short deadline, from the GPU's arrival at the wait (0: none)
    bool pending = false;  // a deadline is set
    bool closing = false;
    uint64_t fired = 0;  // deadlines that had to store their value
    uint64_t stalled = 0;  // of those, the long ones: a value never released in time (not the GPU's grace)
    std::thread thread;

    // Store max(word, v) (cyclic); true if this call raised the word.
    bool store_max(uint32_t v) {
        uint32_t cur = word->load(std::memory_order_acquire);
        while (cyclic_less(cur, v)) {
            if (word->compare_exchange_weak(cur, v, std::memory_order_seq_cst)) return true;
        }
        return false;
    }

    void run() {
        std::unique_lock<std::mutex> lock(mu);
        Clock::time_point arrived{};  // when the GPU was first seen at the armed wait
        uint32_t arrived_for = 0;
        bool seen = false;
        while (!closing) {
            if (!pending) {
                seen = false;
                cv.wait(lock);
                continue;
            }
            if (!cyclic_less(word->load(std::memory_order_acquire), armed)) {  // the owner released it: idle
                pending = false;
                continue;
            }
            const auto now = Clock::now();
            if (grace_us > 0 && reached != nullptr && (!seen || arrived_for != armed) &&
                !cyclic_less(reached->load(std::memory_order_acquire), armed)) {
                seen = true;
                arrived_for = armed;
                arrived = now;
            }
            auto until = deadline;
            if (seen && arrived_for == armed) until = std::min(until, arrived + std::chrono::microseconds(grace_us));
            if (now >= until) {
                pending = false;
                if (store_max(armed)) {
                    ++fired;
                    if (until == deadline) ++stalled;  // not the grace: the owner never came
                }
                continue;
            }
            if (grace_us > 0 && reached != nullptr && !(seen && arrived_for == armed)) {
                until = std::min(until, now + std::chrono::microseconds(kPollUs));  // poll for the arrival
            }
            cv.wait_until(lock, until);
        }
    }
};

struct Flag {
    PyObject_HEAD
    State* state;
};

bool aligned_word(unsigned long long address) {
    return address != 0 && address % alignof(std::atomic<uint32_t>) == 0;
}

int Flag_init(Flag* self, PyObject* args, PyObject*) {
    unsigned long long address = 0, reached = 0;
    if (!PyArg_ParseTuple(args, "K|K", &address, &reached)) return -1;
    if (!aligned_word(address) || (reached != 0 && !aligned_word(reached))) {
        PyErr_Format(PyExc_ValueError, "Flag(address, reached=0): %llu / %llu is not a 4-byte aligned address",
                     address, reached);
        return -1;
    }
    if (self->state != nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "Flag is already initialised");
        return -1;
    }
    auto* st = new State();
    st->word = reinterpret_cast<std::atomic<uint32_t>*>(static_cast<uintptr_t>(address));
    if (reached != 0) st->reached = reinterpret_cast<std::atomic<uint32_t>*>(static_cast<uintptr_t>(reached));
    st->thread = std::thread([st] { st->run(); });
    self->state = st;
    return 0;
}

void close_state(Flag* self) {
    State* st = self->state;
    if (st == nullptr) return;
    {
        std::lock_guard<std::mutex> lock(st->mu);
        st->closing = true;
    }
    st->cv.notify_all();
    if (st->thread.joinable()) st->thread.join();
    delete st;
    self->state = nullptr;
}

void Flag_dealloc(Flag* self) {
    Py_BEGIN_ALLOW_THREADS
    close_state(self);
    Py_END_ALLOW_THREADS
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

State* live(Flag* self) {
    if (self->state == nullptr) PyErr_SetString(PyExc_RuntimeError, "Flag is closed");
    return self->state;
}

PyObject* Flag_release(Flag* self, PyObject* args) {
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "k", &value)) return nullptr;
    State* st = live(self);
    if (st == nullptr) return nullptr;
    const bool raised = st->store_max(static_cast<uint32_t>(value));
    return PyBool_FromLong(raised);
}

PyObject* Flag_arm(Flag* self, PyObject* args) {
    unsigned long value = 0;
    double timeout_us = 0.0, grace_us = 0.0;
    if (!PyArg_ParseTuple(args, "kd|d", &value, &timeout_us, &grace_us)) return nullptr;
    if (!(timeout_us > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "arm(value, timeout_us): timeout_us must be > 0");
        return nullptr;
    }
    State* st = live(self);
    if (st == nullptr) return nullptr;
    {
        std::lock_guard<std::mutex> lock(st->mu);
        if (st->pending && cyclic_less(st->armed, static_cast<uint32_t>(value)) && st->store_max(st->armed)) {
            ++st->fired;  // the previous step was never released: do it now (counted like a deadline, a stall)
            ++st->stalled;
        }
        st->armed = static_cast<uint32_t>(value);
        st->deadline = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_us));
        st->grace_us = grace_us > 0.0 ? static_cast<int64_t>(grace_us) : 0;
        st->pending = true;
    }
    st->cv.notify_all();
    Py_RETURN_NONE;
}

PyObject* Flag_value(Flag* self, PyObject*) {
    State* st = live(self);
    if (st == nullptr) return nullptr;
    return PyLong_FromUnsignedLong(st->word->load(std::memory_order_acquire));
}

PyObject* Flag_fired(Flag* self, PyObject*) {
    State* st = live(self);
    if (st == nullptr) return nullptr;
    std::lock_guard<std::mutex> lock(st->mu);
    return PyLong_FromUnsignedLongLong(st->fired);
}

PyObject* Flag_stalls(Flag* self, PyObject*) {
    State* st = live(self);
    if (st == nullptr) return nullptr;
    std::lock_guard<std::mutex> lock(st->mu);
    return PyLong_FromUnsignedLongLong(st->stalled);
}

PyObject* Flag_close(Flag* self, PyObject*) {
    Py_BEGIN_ALLOW_THREADS
    close_state(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef Flag_methods[] = {
    {"release", reinterpret_cast<PyCFunction>(Flag_release), METH_VARARGS,
     "release(value) -> bool: store max(word, value) (cyclic); True if the word rose"},
    {"arm", reinterpret_cast<PyCFunction>(Flag_arm), METH_VARARGS,
     "arm(value, timeout_us, grace_us=0): the watchdog stores value timeout_us from now, or grace_us after the "
     "reached word (if any) shows value, unless the word reached it first (an earlier armed value still pending "
     "is stored at once)"},
    {"value", reinterpret_cast<PyCFunction>(Flag_value), METH_NOARGS, "the word"},
    {"fired", reinterpret_cast<PyCFunction>(Flag_fired), METH_NOARGS, "deadlines that stored their value"},
    {"stalls", reinterpret_cast<PyCFunction>(Flag_stalls), METH_NOARGS,
     "of those, the long deadlines (a value never released), not the grace after the reached word"},
    {"close", reinterpret_cast<PyCFunction>(Flag_close), METH_NOARGS, "stop the watchdog thread"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject FlagType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_host_flag", "Pinned sequence word with a watchdog", -1,
                          nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__host_flag(void) {
    FlagType.tp_name = "specdec._host_flag.Flag";
    FlagType.tp_basicsize = sizeof(Flag);
    FlagType.tp_flags = Py_TPFLAGS_DEFAULT;
    FlagType.tp_doc = "Flag(address, reached=0): the uint32 word at address (pinned host memory), its watchdog, and "
                      "optionally the word the stream writes when it starts waiting";
    FlagType.tp_new = PyType_GenericNew;
    FlagType.tp_init = reinterpret_cast<initproc>(Flag_init);
    FlagType.tp_dealloc = reinterpret_cast<destructor>(Flag_dealloc);
    FlagType.tp_methods = Flag_methods;
    if (PyType_Ready(&FlagType) < 0) return nullptr;
    PyObject* m = PyModule_Create(&module_def);
    if (m == nullptr) return nullptr;
    Py_INCREF(&FlagType);
    if (PyModule_AddObject(m, "Flag", reinterpret_cast<PyObject*>(&FlagType)) < 0) {
        Py_DECREF(&FlagType);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
