// What Apple's <Foundation/Foundation.h> brings into ggml-metal's .m files transitively and GNUstep's does
// not (force-included by tests/test_metal_sources.py before each .m file): the POSIX <unistd.h> and
// <stdlib.h>, and the Mach VM calls of <mach/mach.h> (mach/kern_return.h, mach/vm_types.h,
// mach/vm_statistics.h, mach/vm_map.h and mach/mach_init.h of the macOS SDK) that ggml-metal's host
// buffers use. Declarations as the SDK's headers give them.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

typedef int kern_return_t;            // mach/kern_return.h
#define KERN_SUCCESS 0
typedef unsigned int mach_port_t;     // mach/port.h
typedef mach_port_t vm_map_t;         // mach/mach_types.h
typedef uintptr_t vm_address_t;       // mach/vm_types.h
typedef uintptr_t vm_size_t;
#define VM_FLAGS_ANYWHERE 0x0001      // mach/vm_statistics.h

#ifdef __cplusplus
extern "C" {
#endif
mach_port_t mach_task_self(void);     // mach/mach_init.h
kern_return_t vm_allocate(vm_map_t target_task, vm_address_t * address, vm_size_t size, int flags);  // mach/vm_map.h
kern_return_t vm_deallocate(vm_map_t target_task, vm_address_t address, vm_size_t size);
#ifdef __cplusplus
}
#endif
