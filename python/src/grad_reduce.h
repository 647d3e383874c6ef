// Data-parallel training (issue 87): each optimizer step's gradients handed to Python between the backward pass and
// the step (ggml_opt_params.grad_reduce, patch 0102), where llamabind.train.distributed averages them over the ranks
// with the process group's all-reduce. train.cpp owns one per training context made with a grad_reduce callable.
#pragma once

#include <ggml.h>
#include <llama.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lb {

struct GradReduce {
    nanobind::object fn;     // fn(grads): grads a list of float32 arrays (DLPack) over the gradients, changed in place
    nanobind::object ready;  // fn.ready(grads), where fn has one and a bucket_bytes > 0: a bucket, during the backward
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

// ggml_opt_params.grad_ready (patch 0104) with userdata a GradReduce: fn.ready called on a bucket's gradients as
// grad_reduce_host calls fn (the same arrays; nothing copied: a bucket with a gradient on a device DLPack does not
// name is not taken, grad_reduce_host gets it); true (taken) unless so; an exception is kept as fn's are
bool grad_ready_host(ggml_tensor ** grads, int n_grads, void * userdata);

// the reduction of a training context's gradients (patch 0102) by the callable fn into p (its grad_reduce, and
// grad_ready with fn.bucket_bytes where fn has a callable fn.ready and a bucket_bytes > 0: patch 0104), owned by r
void grad_reduce_attach(llama_opt_params & p, std::unique_ptr<GradReduce> & r, nanobind::object fn);

}  // namespace lb
