// llama.cpp and ggml log through one callback (llama_log_set sets ggml's too). Lines at or above
// the threshold go to a Python callable (llamabind._log forwards them to logging.getLogger
// ("llamabind")); lines below it are dropped here without touching the interpreter. The
// threshold follows the logger's effective level, so the default (WARNING, and a NullHandler)
// keeps llama.cpp quiet.
#include "common.h"

#include <llama.h>

#include <Python.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdio>
#include <deque>
#include <utility>
#include <vector>
#include <mutex>

extern "C" void ggml_print_backtrace(void);  // ggml-impl.h (not an installed header): ggml_abort's own default

namespace lb {

static std::atomic<int> g_min_level{ GGML_LOG_LEVEL_WARN };
static std::mutex g_handler_mutex;
static PyObject * g_handler = nullptr;  // strong reference, owned; callable(level: int, text: str)

thread_local std::string t_line;
thread_local int t_level = GGML_LOG_LEVEL_INFO;
thread_local std::deque<std::string> t_recent;  // recent WARN/ERROR lines, for exception messages

static bool is_finalizing() {
#if defined(Py_LIMITED_API)  // the abi3 build: nanobind's own check (no Py_IsFinalizing in the limited API)
    return !nb::is_alive();
#elif PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

// Lines logged on threads that Python does not know (ggml's compute threads, the RPC client's
// dispatcher) wait here and go out with the next line a Python thread logs, or at flush_logs():
// taking the GIL there could deadlock with a Python thread that holds it while it waits for that
// very thread (seen: devices() asking a dead RPC server while its dispatcher logged the failure).
static std::mutex g_pending_mutex;
static std::deque<std::pair<int, std::string>> g_pending;
static std::atomic<bool> g_has_pending{ false };  // flush_logs() runs after every decode: no lock when empty

static void call_handler(int level, const std::string & line);

static void flush_pending_with_gil() {
    std::deque<std::pair<int, std::string>> lines;
    {
        std::lock_guard<std::mutex> lock(g_pending_mutex);
        lines.swap(g_pending);
        g_has_pending = false;
    }
    for (auto & [level, line] : lines) call_handler(level, line);
}

void flush_logs() {
    if (!g_has_pending.load(std::memory_order_acquire)) return;
    if (!Py_IsInitialized() || is_finalizing()) return;
    PyGILState_STATE st = PyGILState_Ensure();
    flush_pending_with_gil();
    PyGILState_Release(st);
}

static void emit(int level, const std::string & line) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        t_recent.push_back(line);
        while (t_recent.size() > 6) t_recent.pop_front();
    }
    if (level < g_min_level.load(std::memory_order_relaxed)) return;
    if (!Py_IsInitialized() || is_finalizing()) return;
    if (PyGILState_GetThisThreadState() == nullptr) {  // a thread Python does not know: never block
        std::lock_guard<std::mutex> lock(g_pending_mutex);
        if (g_pending.size() < 1000) g_pending.emplace_back(level, line);
        g_has_pending = true;
        return;
    }
    PyGILState_STATE st = PyGILState_Ensure();
    flush_pending_with_gil();
    call_handler(level, line);
    PyGILState_Release(st);
}

static void call_handler(int level, const std::string & line) {
    PyObject * handler = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_handler_mutex);
        handler = g_handler;
        Py_XINCREF(handler);
    }
    if (handler) {
        // Keep any exception that is already pending (e.g. KeyboardInterrupt) intact.
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject * lvl = PyLong_FromLong(level);
        PyObject * txt = PyUnicode_DecodeUTF8(line.data(), (Py_ssize_t) line.size(), "replace");
        PyObject * r = (lvl && txt) ? PyObject_CallFunctionObjArgs(handler, lvl, txt, nullptr) : nullptr;
        if (!r) PyErr_Clear();  // a failing log handler must never break a decode
        Py_XDECREF(r);
        Py_XDECREF(lvl);
        Py_XDECREF(txt);
        Py_DECREF(handler);
        PyErr_Restore(et, ev, tb);
    }
}

void log_to_python(enum ggml_log_level level, const char * text, void *) {
    if (!text) return;
    if (level != GGML_LOG_LEVEL_CONT) {
        if (!t_line.empty()) {  // a new record starts: flush an unterminated previous one
            emit(t_level, t_line);
            t_line.clear();
        }
        t_level = level;
    }
    // Drop below-threshold records early, unless they may be needed for error messages.
    if (t_level < g_min_level.load(std::memory_order_relaxed) && t_level < GGML_LOG_LEVEL_WARN) return;
    t_line += text;
    size_t nl;
    while ((nl = t_line.find('\n')) != std::string::npos) {
        std::string line = t_line.substr(0, nl);
        t_line.erase(0, nl + 1);
        if (!line.empty()) emit(t_level, line);
    }
}

// ggml_abort's callback: ggml logs why before it aborts (ggml_cuda_error: "CUDA error: out of memory", the device,
// the call; then GGML_ABORT("CUDA error")), and those lines went to the Python logger, where the default NullHandler
// drops them: the abort said only "ggml-cuda.cu:110: CUDA error". The aborting thread's recent WARN/ERROR lines go
// to stderr first, then the abort's message and ggml's backtrace, as ggml's own default. No GIL, no allocation
// beyond what the lines already hold: the process is about to end.
static void abort_with_recent_lines(const char * message) {
    std::fflush(stdout);
    if (!t_line.empty() && t_level >= GGML_LOG_LEVEL_WARN) t_recent.push_back(t_line);  // an unterminated record
    if (!t_recent.empty()) {
        std::fputs("llamabind: llama.cpp/ggml's last messages before it aborted:\n", stderr);
        for (auto & l : t_recent) std::fprintf(stderr, "  %s\n", l.c_str());
    }
    std::fprintf(stderr, "%s\n", message);
    std::fflush(stderr);
    ggml_print_backtrace();
}

void install_log_callback() {
    llama_log_set(log_to_python, nullptr);
    ggml_set_abort_callback(abort_with_recent_lines);
}

std::string take_recent_errors() {
    std::string out;
    for (auto & l : t_recent) {
        if (!out.empty()) out += "\n";
        out += "  llama.cpp: " + l;
    }
    t_recent.clear();
    return out;
}

void clear_recent_errors() {
    t_recent.clear();
}

void register_logging(nb::module_ & m) {
    m.def(
        "set_log_level", [](int level) { g_min_level.store(level); }, nb::arg("level"),
        "Lowest ggml_log_level forwarded to the handler (1 debug, 2 info, 3 warn, 4 error, 5 none).");
    m.def("get_log_level", []() { return g_min_level.load(); });
    m.def(
        "flush_logs",
        []() {
            nb::gil_scoped_release release;
            flush_logs();
        },
        "Deliver the lines that threads unknown to Python logged since the last delivery.");
    m.def(
        "_test_abort",
        [](const std::vector<std::pair<int, std::string>> & lines, const std::string & message) {
            ggml_log_callback cb = nullptr;  // the installed callback, as ggml_log_internal calls it
            void * ud = nullptr;
            llama_log_get(&cb, &ud);
            for (auto & [level, line] : lines)
                if (cb) cb((ggml_log_level) level, (line + "\n").c_str(), ud);
            ggml_abort("ggml-cuda.cu", 110, "%s", message.c_str());
        },
        nb::arg("lines"), nb::arg("message"),
        "Tests only: log (ggml_log_level, text) lines, then ggml_abort(message), as ggml_cuda_error does. Ends the "
        "process.");
    m.def(
        "set_log_handler",
        [](nb::object handler) {
            PyObject * h = handler.is_none() ? nullptr : handler.ptr();
            Py_XINCREF(h);
            PyObject * old;
            {
                std::lock_guard<std::mutex> lock(g_handler_mutex);
                old = g_handler;
                g_handler = h;
            }
            Py_XDECREF(old);
        },
        nb::arg("handler").none(),
        "Set the callable(level: int, text: str) that receives llama.cpp/ggml log lines, or None.");
}

}  // namespace lb
