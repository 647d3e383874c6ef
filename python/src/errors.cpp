// Exceptions raised by llamabind._core. Every ggml/llama.cpp precondition that would abort the
// process is checked before the call and reported with one of these.
#include "common.h"

#include <Python.h>

namespace lb {

void raise_file_not_found(const std::string & msg) {
    PyErr_SetString(PyExc_FileNotFoundError, msg.c_str());
    throw nb::python_error();
}

void raise_value(const std::string & msg) {
    throw nb::value_error(msg.c_str());
}

void raise_type(const std::string & msg) {
    throw nb::type_error(msg.c_str());
}

void raise_keyboard_interrupt() {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw nb::python_error();
}

void register_errors(nb::module_ & m) {
    nb::exception<LlamaError> e(m, "LlamaError", PyExc_RuntimeError);
    nb::setattr(e, "__doc__",
                nb::str("llama.cpp reported a failure it can recover from (a failed decode, no KV cache "
                        "slot, an RPC server gone, a context busy in another thread, ...); the message "
                        "carries llama.cpp's own error lines. A subclass of RuntimeError."));
}

}  // namespace lb
