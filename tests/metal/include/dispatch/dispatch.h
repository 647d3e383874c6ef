// Stub of the Grand Central Dispatch declarations ggml-metal's .m files use, as Apple's libdispatch
// headers (usr/include/dispatch/{queue,group,semaphore,time,object}.h of the macOS SDK; documented at
// developer.apple.com/documentation/dispatch) declare them. On macOS Foundation and Metal bring these in.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <objc/blocks_runtime.h>

typedef struct dispatch_queue_s * dispatch_queue_t;                // dispatch/queue.h
typedef struct dispatch_queue_attr_s * dispatch_queue_attr_t;      // dispatch/queue.h
typedef struct dispatch_group_s * dispatch_group_t;                // dispatch/group.h
typedef struct dispatch_semaphore_s * dispatch_semaphore_t;        // dispatch/semaphore.h
typedef uint64_t dispatch_time_t;                                  // dispatch/time.h
typedef void (^dispatch_block_t)(void);                            // dispatch/block.h
typedef long dispatch_queue_priority_t;                            // dispatch/queue.h
typedef unsigned int dispatch_qos_class_t;

// sys/qos.h
#define QOS_CLASS_USER_INTERACTIVE 0x21
#define QOS_CLASS_USER_INITIATED 0x19
#define QOS_CLASS_DEFAULT 0x15
#define QOS_CLASS_UTILITY 0x11
#define QOS_CLASS_BACKGROUND 0x09

#define DISPATCH_TIME_NOW (0ull)                                   // dispatch/time.h
#define DISPATCH_TIME_FOREVER (~0ull)
#define DISPATCH_QUEUE_SERIAL ((dispatch_queue_attr_t) NULL)       // dispatch/queue.h
extern struct dispatch_queue_attr_s _dispatch_queue_attr_concurrent;
#define DISPATCH_QUEUE_CONCURRENT (&_dispatch_queue_attr_concurrent)
#define DISPATCH_QUEUE_PRIORITY_DEFAULT 0
#define DISPATCH_QUEUE_PRIORITY_HIGH 2

#ifdef __cplusplus
extern "C" {
#endif
dispatch_queue_t dispatch_queue_create(const char * label, dispatch_queue_attr_t attr);
dispatch_queue_t dispatch_get_global_queue(intptr_t identifier, uintptr_t flags);
void dispatch_apply(size_t iterations, dispatch_queue_t queue, void (^block)(size_t iteration));
void dispatch_async(dispatch_queue_t queue, dispatch_block_t block);
void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
dispatch_group_t dispatch_group_create(void);
void dispatch_group_async(dispatch_group_t group, dispatch_queue_t queue, dispatch_block_t block);
intptr_t dispatch_group_wait(dispatch_group_t group, dispatch_time_t timeout);
dispatch_semaphore_t dispatch_semaphore_create(intptr_t value);
intptr_t dispatch_semaphore_wait(dispatch_semaphore_t dsema, dispatch_time_t timeout);
intptr_t dispatch_semaphore_signal(dispatch_semaphore_t dsema);
dispatch_time_t dispatch_time(dispatch_time_t when, int64_t delta);
void dispatch_release(void * object);                              // dispatch/object.h (without ARC)
void dispatch_retain(void * object);
#ifdef __cplusplus
}
#endif
