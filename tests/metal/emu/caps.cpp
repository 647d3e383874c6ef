// The registered devices and their capabilities, one line each (issue 57; tests only):
//   lb-caps  ->  NAME | DESCRIPTION | async=0/1 host_buffer=0/1 buffer_from_host_ptr=0/1 events=0/1
#include "ggml-backend.h"

#include <cstdio>

int main() {
    ggml_backend_load_all();
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        ggml_backend_dev_props props;
        ggml_backend_dev_get_props(dev, &props);
        printf("%s | %s | async=%d host_buffer=%d buffer_from_host_ptr=%d events=%d\n", props.name, props.description,
               props.caps.async, props.caps.host_buffer, props.caps.buffer_from_host_ptr, props.caps.events);
    }
    return 0;
}
