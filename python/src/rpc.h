// The RPC backend's client side, shared by model.cpp (Model(rpc=...)) and backends.cpp (devices).
#pragma once

#include <ggml-backend.h>

#include <string>
#include <vector>

namespace lb {

bool is_rpc_device(ggml_backend_dev_t dev);
// Connects (patch 0011: ConnectionError instead of an abort) and registers the server's devices once.
std::vector<ggml_backend_dev_t> rpc_connect(const std::string & endpoint);
// The devices a model may offload to: the local GPUs, then those of the RPC servers named in `rpc`
// (connected here). Servers that other models connected to stay in ggml's registry, so once any is
// there `explicit_list` is set: pass the list (else llama.cpp takes every GPU-type device, RPC included).
std::vector<ggml_backend_dev_t> offload_devices(const std::vector<std::string> & rpc, bool & explicit_list);

}  // namespace lb
