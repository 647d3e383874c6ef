// A stub of Apple's Metal framework headers (Metal.framework/Headers of the macOS 15 SDK; the API is
// documented at developer.apple.com/documentation/metal) holding only the declarations that ggml-metal's
// Objective-C files (ggml-metal-device.m, ggml-metal-context.m) use, so that clang can parse them on
// Linux against GNUstep's Foundation (tests/test_metal_sources.py). Selector names, argument and result
// types follow Apple's declarations; enum values are Apple's where the code compares or stores them,
// availability attributes and everything unused are left out. It declares, by Apple header:
//   MTLTypes.h          MTLSize, MTLSizeMake
//   MTLResource.h       MTLStorageMode, MTLResourceOptions, MTLResource, MTLAllocation
//   MTLBuffer.h         MTLBuffer
//   MTLArgument.h       MTLDataType
//   MTLLibrary.h        MTLLanguageVersion, MTLMathMode, MTLCompileOptions, MTLFunction, MTLLibrary
//   MTLFunctionConstantValues.h  MTLFunctionConstantValues
//   MTLComputePipeline.h MTLComputePipelineState
//   MTLCommandQueue.h   MTLCommandQueue
//   MTLCommandBuffer.h  MTLCommandBufferStatus, MTLDispatchType, MTLCommandBuffer
//   MTLCommandEncoder.h MTLCommandEncoder, MTLBarrierScope
//   MTLBlitCommandEncoder.h MTLBlitCommandEncoder
//   MTLComputeCommandEncoder.h MTLComputeCommandEncoder
//   MTLEvent.h          MTLEvent, MTLSharedEvent
//   MTLResidencySet.h   MTLResidencySetDescriptor, MTLResidencySet
//   MTLCaptureManager.h MTLCaptureDestination, MTLCaptureDescriptor, MTLCaptureManager
//   MTLCaptureScope.h   MTLCaptureScope
//   MTLDevice.h         MTLGPUFamily, MTLDeviceLocation, MTLDevice, MTLCreateSystemDefaultDevice,
//                       MTLCopyAllDevices
#pragma once

#import <Foundation/Foundation.h>
#include <TargetConditionals.h>
#include <dispatch/dispatch.h>

@protocol MTLDevice;
@protocol MTLCommandQueue;
@protocol MTLCommandBuffer;
@protocol MTLFunction;
@protocol MTLEvent;
@protocol MTLResidencySet;

// MTLTypes.h
typedef struct {
    NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
    MTLSize size = { width, height, depth };
    return size;
}

// MTLResource.h
typedef NS_ENUM(NSUInteger, MTLStorageMode) {
    MTLStorageModeShared = 0,
    MTLStorageModeManaged = 1,
    MTLStorageModePrivate = 2,
    MTLStorageModeMemoryless = 3,
};

typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
    MTLResourceCPUCacheModeDefaultCache = 0,
    MTLResourceCPUCacheModeWriteCombined = 1,
    MTLResourceStorageModeShared = MTLStorageModeShared << 4,
    MTLResourceStorageModeManaged = MTLStorageModeManaged << 4,
    MTLResourceStorageModePrivate = MTLStorageModePrivate << 4,
    MTLResourceHazardTrackingModeDefault = 0 << 8,
    MTLResourceHazardTrackingModeUntracked = 1 << 8,
    MTLResourceHazardTrackingModeTracked = 2 << 8,
};

@protocol MTLAllocation <NSObject>
@property (readonly) NSUInteger allocatedSize;
@end

@protocol MTLResource <MTLAllocation>
@property (copy, atomic) NSString * label;
@property (readonly) id<MTLDevice> device;
@property (readonly) MTLStorageMode storageMode;
@end

// MTLBuffer.h
@protocol MTLBuffer <MTLResource>
@property (readonly) NSUInteger length;
- (void *)contents;
- (void)didModifyRange:(NSRange)range;
@end

// MTLArgument.h
typedef NS_ENUM(NSUInteger, MTLDataType) {
    MTLDataTypeNone = 0,
    MTLDataTypeFloat = 3,
    MTLDataTypeHalf = 16,
    MTLDataTypeInt = 29,
    MTLDataTypeShort = 37,
    MTLDataTypeUInt = 33,
    MTLDataTypeBool = 53,
};

// MTLFunctionConstantValues.h
@interface MTLFunctionConstantValues : NSObject
- (void)setConstantValue:(const void *)value type:(MTLDataType)type atIndex:(NSUInteger)index;
- (void)setConstantValue:(const void *)value type:(MTLDataType)type withName:(NSString *)name;
@end

// MTLLibrary.h
typedef NS_ENUM(NSUInteger, MTLLanguageVersion) {
    MTLLanguageVersion2_4 = (2 << 16) + 4,
    MTLLanguageVersion3_0 = (3 << 16) + 0,
    MTLLanguageVersion3_1 = (3 << 16) + 1,
    MTLLanguageVersion3_2 = (3 << 16) + 2,
    MTLLanguageVersion4_0 = (4 << 16) + 0,
};

typedef NS_ENUM(NSInteger, MTLMathMode) {
    MTLMathModeSafe = 0,
    MTLMathModeRelaxed = 1,
    MTLMathModeFast = 2,
};

@interface MTLCompileOptions : NSObject <NSCopying>
@property (readwrite, copy, nonatomic) NSDictionary<NSString *, NSObject *> * preprocessorMacros;
@property (readwrite, nonatomic) BOOL fastMathEnabled;
@property (readwrite, nonatomic) MTLMathMode mathMode;
@property (readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end

@protocol MTLFunction <NSObject>
@property (copy, atomic) NSString * label;
@property (readonly) id<MTLDevice> device;
@property (readonly) NSString * name;
@end

@protocol MTLLibrary <NSObject>
@property (copy, atomic) NSString * label;
@property (readonly) id<MTLDevice> device;
@property (readonly) NSArray<NSString *> * functionNames;
- (id<MTLFunction>)newFunctionWithName:(NSString *)functionName;
- (id<MTLFunction>)newFunctionWithName:(NSString *)name
                        constantValues:(MTLFunctionConstantValues *)constantValues
                                 error:(NSError **)error;
@end

// MTLComputePipeline.h
@protocol MTLComputePipelineState <NSObject>
@property (readonly) NSString * label;
@property (readonly) id<MTLDevice> device;
@property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property (readonly) NSUInteger threadExecutionWidth;
@property (readonly) NSUInteger staticThreadgroupMemoryLength;
@end

// MTLCommandEncoder.h
typedef NS_OPTIONS(NSUInteger, MTLBarrierScope) {
    MTLBarrierScopeBuffers = 1 << 0,
    MTLBarrierScopeTextures = 1 << 1,
    MTLBarrierScopeRenderTargets = 1 << 2,
};

@protocol MTLCommandEncoder <NSObject>
@property (copy, atomic) NSString * label;
@property (readonly) id<MTLDevice> device;
- (void)endEncoding;
- (void)insertDebugSignpost:(NSString *)string;
- (void)pushDebugGroup:(NSString *)string;
- (void)popDebugGroup;
@end

// MTLBlitCommandEncoder.h
@protocol MTLBlitCommandEncoder <MTLCommandEncoder>
- (void)copyFromBuffer:(id<MTLBuffer>)sourceBuffer
          sourceOffset:(NSUInteger)sourceOffset
              toBuffer:(id<MTLBuffer>)destinationBuffer
     destinationOffset:(NSUInteger)destinationOffset
                  size:(NSUInteger)size;
- (void)fillBuffer:(id<MTLBuffer>)buffer range:(NSRange)range value:(uint8_t)value;
@end

// MTLComputeCommandEncoder.h
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void *)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)dispatchThreads:(MTLSize)threadsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
@end

// MTLEvent.h
@protocol MTLEvent <NSObject>
@property (readonly) id<MTLDevice> device;
@property (copy, atomic) NSString * label;
@end

@protocol MTLSharedEvent <MTLEvent>
@property (readwrite) uint64_t signaledValue;
- (BOOL)waitUntilSignaledValue:(uint64_t)value timeoutMS:(uint64_t)milliseconds;
@end

// MTLCommandBuffer.h
typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
    MTLCommandBufferStatusNotEnqueued = 0,
    MTLCommandBufferStatusEnqueued = 1,
    MTLCommandBufferStatusCommitted = 2,
    MTLCommandBufferStatusScheduled = 3,
    MTLCommandBufferStatusCompleted = 4,
    MTLCommandBufferStatusError = 5,
};

typedef NS_ENUM(NSUInteger, MTLDispatchType) {
    MTLDispatchTypeSerial = 0,
    MTLDispatchTypeConcurrent = 1,
};

typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

@protocol MTLCommandBuffer <NSObject>
@property (readonly) id<MTLDevice> device;
@property (readonly) id<MTLCommandQueue> commandQueue;
@property (copy, atomic) NSString * label;
@property (readonly) MTLCommandBufferStatus status;
@property (readonly) NSError * error;
- (void)enqueue;
- (void)commit;
- (void)waitUntilScheduled;
- (void)waitUntilCompleted;
- (void)addCompletedHandler:(MTLCommandBufferHandler)block;
- (id<MTLBlitCommandEncoder>)blitCommandEncoder;
- (id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (id<MTLComputeCommandEncoder>)computeCommandEncoderWithDispatchType:(MTLDispatchType)dispatchType;
- (void)encodeWaitForEvent:(id<MTLEvent>)event value:(uint64_t)value;
- (void)encodeSignalEvent:(id<MTLEvent>)event value:(uint64_t)value;
- (void)pushDebugGroup:(NSString *)string;
- (void)popDebugGroup;
- (void)useResidencySet:(id<MTLResidencySet>)residencySet;
@end

// MTLCommandQueue.h
@protocol MTLCommandQueue <NSObject>
@property (copy, atomic) NSString * label;
@property (readonly) id<MTLDevice> device;
- (id<MTLCommandBuffer>)commandBuffer;
- (id<MTLCommandBuffer>)commandBufferWithUnretainedReferences;
- (void)addResidencySet:(id<MTLResidencySet>)residencySet;
- (void)removeResidencySet:(id<MTLResidencySet>)residencySet;
@end

// MTLResidencySet.h
@interface MTLResidencySetDescriptor : NSObject <NSCopying>
@property (copy, atomic) NSString * label;
@property (readwrite, nonatomic) NSUInteger initialCapacity;
@end

@protocol MTLResidencySet <NSObject>
@property (readonly) id<MTLDevice> device;
@property (readonly) NSString * label;
@property (readonly) uint64_t allocatedSize;
- (void)requestResidency;
- (void)endResidency;
- (void)addAllocation:(id<MTLAllocation>)allocation;
- (void)removeAllocation:(id<MTLAllocation>)allocation;
- (void)removeAllAllocations;
- (void)commit;
@end

// MTLCaptureScope.h
@protocol MTLCaptureScope <NSObject>
- (void)beginScope;
- (void)endScope;
@property (copy, atomic) NSString * label;
@end

// MTLCaptureManager.h
typedef NS_ENUM(NSInteger, MTLCaptureDestination) {
    MTLCaptureDestinationDeveloperTools = 1,
    MTLCaptureDestinationGPUTraceDocument = 2,
};

@interface MTLCaptureDescriptor : NSObject <NSCopying>
@property (nonatomic, strong) id captureObject;
@property (nonatomic, assign) MTLCaptureDestination destination;
@property (nonatomic, copy) NSURL * outputURL;
@end

@interface MTLCaptureManager : NSObject
+ (MTLCaptureManager *)sharedCaptureManager;
- (id<MTLCaptureScope>)newCaptureScopeWithDevice:(id<MTLDevice>)device;
- (id<MTLCaptureScope>)newCaptureScopeWithCommandQueue:(id<MTLCommandQueue>)commandQueue;
- (BOOL)startCaptureWithDescriptor:(MTLCaptureDescriptor *)descriptor error:(NSError **)error;
- (void)stopCapture;
@property (readonly) BOOL isCapturing;
@end

// MTLDevice.h
typedef NS_ENUM(NSInteger, MTLGPUFamily) {
    MTLGPUFamilyApple1 = 1001,
    MTLGPUFamilyApple2 = 1002,
    MTLGPUFamilyApple3 = 1003,
    MTLGPUFamilyApple4 = 1004,
    MTLGPUFamilyApple5 = 1005,
    MTLGPUFamilyApple6 = 1006,
    MTLGPUFamilyApple7 = 1007,
    MTLGPUFamilyApple8 = 1008,
    MTLGPUFamilyApple9 = 1009,
    MTLGPUFamilyMac1 = 2001,
    MTLGPUFamilyMac2 = 2002,
    MTLGPUFamilyCommon1 = 3001,
    MTLGPUFamilyCommon2 = 3002,
    MTLGPUFamilyCommon3 = 3003,
    MTLGPUFamilyMetal3 = 5001,
};

typedef NS_ENUM(NSUInteger, MTLDeviceLocation) {
    MTLDeviceLocationBuiltIn = 0,
    MTLDeviceLocationSlot = 1,
    MTLDeviceLocationExternal = 2,
    MTLDeviceLocationUnspecified = NSUIntegerMax,
};

@protocol MTLDevice <NSObject>
@property (readonly) NSString * name;
@property (readonly) uint64_t registryID;
@property (readonly) BOOL hasUnifiedMemory;
@property (readonly) BOOL isLowPower;
@property (readonly) BOOL isRemovable;
@property (readonly) MTLDeviceLocation location;
@property (readonly) NSUInteger maxBufferLength;
@property (readonly) NSUInteger maxThreadgroupMemoryLength;
@property (readonly) uint64_t recommendedMaxWorkingSetSize;
@property (readonly) NSUInteger currentAllocatedSize;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
- (id<MTLCommandQueue>)newCommandQueue;
- (id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (id<MTLBuffer>)newBufferWithBytes:(const void *)pointer length:(NSUInteger)length options:(MTLResourceOptions)options;
- (id<MTLBuffer>)newBufferWithBytesNoCopy:(void *)pointer
                                   length:(NSUInteger)length
                                  options:(MTLResourceOptions)options
                              deallocator:(void (^)(void * pointer, NSUInteger length))deallocator;
- (id<MTLLibrary>)newLibraryWithSource:(NSString *)source options:(MTLCompileOptions *)options error:(NSError **)error;
- (id<MTLLibrary>)newLibraryWithURL:(NSURL *)url error:(NSError **)error;
- (id<MTLLibrary>)newDefaultLibrary;
- (id<MTLLibrary>)newDefaultLibraryWithBundle:(NSBundle *)bundle error:(NSError **)error;
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                              error:(NSError **)error;
- (id<MTLSharedEvent>)newSharedEvent;
- (id<MTLResidencySet>)newResidencySetWithDescriptor:(MTLResidencySetDescriptor *)desc error:(NSError **)error;
@end

#ifdef __cplusplus
extern "C" {
#endif
id<MTLDevice> MTLCreateSystemDefaultDevice(void);
NSArray<id<MTLDevice>> * MTLCopyAllDevices(void);
#ifdef __cplusplus
}
#endif
