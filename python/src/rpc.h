// The RPC backend's client side, shared by model.cpp (Model(rpc=...)) and backends.cpp (devices).
#pragma once

#include <ggml-backend.h>

#include <string>
#include <vector>

namespace lb {

bool is_rpc_device(ggml_backend_dev_t dev);
// Connects (patch 0011: ConnectionError instead of an abort) and registers the server's devices once.
std::vector<ggml_backend_dev_t> rpc_connect(const std::string & endpoint);

}  // namespace lb
