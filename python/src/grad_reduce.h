// Data-parallel training (issue 87): each optimizer step's gradients handed to Python between the backward pass and
// the step (ggml_opt_params.grad_reduce, patch 0102), where llamabind.train.distributed averages them over the ranks
// with the process group's all-reduce. train.cpp owns one per training context made with a grad_reduce callable.
#pragma once

#include <ggml.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lb {

struct GradReduce {
    nanobind::object fn;     // fn(grads): grads a float32 numpy array (n,) of every trained tensor's gradient, in place
    std::vector<float> buf;  // the host copy fn sees (valid during the call only)
    std::string error;       // what fn raised (opt_step raises it as a RuntimeError after the step's evals)
    int64_t n_calls = 0;
};

// ggml_opt_grad_reduce with userdata a GradReduce: the gradients (on any backend) copied into one host array, fn
// called on it with the GIL held, the array copied back; false (no step) once fn has raised, the error kept
bool grad_reduce_host(ggml_tensor ** grads, int n_grads, void * userdata);

}  // namespace lb
