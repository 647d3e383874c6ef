// Declarations shared by graph.cpp (the graph engine) and ops.cpp (the op table).
#pragma once

#include "common.h"

#include <ggml.h>

namespace lb {

// Build ggml op `name` on srcs with int/float parameters (see the table in ops.cpp).
ggml_tensor * build_op(ggml_context * ctx, const std::string & name, const std::vector<ggml_tensor *> & srcs,
                       const std::vector<int64_t> & ints, const std::vector<double> & floats);
std::vector<std::string> op_names();

}  // namespace lb
