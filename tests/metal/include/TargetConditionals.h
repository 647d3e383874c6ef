// Stub of Apple's TargetConditionals.h (usr/include/TargetConditionals.h of the macOS SDK), for parsing
// ggml-metal's Objective-C on Linux (tests/test_metal_sources.py): macOS, on Apple silicon by default or on
// an Intel Mac (where the discrete AMD/Intel GPUs of patches 0003-0007 live) with -DLB_TARGET_X86_64=1.
#pragma once
#define TARGET_OS_MAC 1
#define TARGET_OS_OSX 1
#define TARGET_OS_IPHONE 0
#define TARGET_OS_IOS 0
#define TARGET_OS_TV 0
#define TARGET_OS_WATCH 0
#define TARGET_OS_VISION 0
#if defined(LB_TARGET_X86_64) && LB_TARGET_X86_64
#define TARGET_CPU_X86_64 1
#define TARGET_CPU_ARM64 0
#else
#define TARGET_CPU_X86_64 0
#define TARGET_CPU_ARM64 1
#endif
// the SDK the parse stands for: macOS 15 (residency sets exist from it on)
#define __MAC_OS_X_VERSION_MAX_ALLOWED 150000
