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
    nanobind::object fn;  // fn(grads): grads a list of float32 arrays (DLPack) over the gradients, changed in place
    std::vector<std::vector<float>> copies;  // host copies of the gradients DLPack cannot name (valid during the call)
    std::string error;  // what fn raised (opt_step raises it as a RuntimeError after the step's evals)
    int64_t n_calls = 0;
};

// ggml_opt_grad_reduce with userdata a GradReduce: fn called with the GIL held on a list of 1-D float32 DLPack
// arrays over the gradients: over the accumulators' own memory (host memory, or a CUDA device's: no copy; the
// backends are synchronized), one array over each run of them that lies one after the other in a buffer (ggml-opt
// allocates them so: typically one array in all; the padding between two, under the buffer's alignment, included),
// or, a gradient on a device DLPack does not name (Vulkan, Metal, RPC), over its host copy written back after fn;
// false (no step) once fn has raised, the error kept
bool grad_reduce_host(ggml_tensor ** grads, int n_grads, void * userdata);

}  // namespace lb
