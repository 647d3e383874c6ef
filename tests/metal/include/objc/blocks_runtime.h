// The blocks runtime declarations GNUstep's GSVersionMacros.h includes when the compiler has blocks
// (libobjc2's objc/blocks_runtime.h; Apple's <Block.h> declares the same): Debian's gnustep-base headers
// expect it beside gcc's libobjc headers, which lack it. Only what ggml-metal's .m files use.
#pragma once
#ifdef __cplusplus
extern "C" {
#endif
void * _Block_copy(const void * aBlock);
void _Block_release(const void * aBlock);
#ifdef __cplusplus
}
#endif
#define Block_copy(...) ((__typeof(__VA_ARGS__)) _Block_copy((const void *) (__VA_ARGS__)))
#define Block_release(...) _Block_release((const void *) (__VA_ARGS__))
