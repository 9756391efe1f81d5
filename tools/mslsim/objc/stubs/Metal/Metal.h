// Hand-written stub of the Metal API subset a compute host uses (declarations only), so that
// .mm files can be syntax- and type-checked with clang on Linux against ../Foundation.
// Signatures follow Apple's Metal headers. Availability follows Apple's SDK headers where it is
// recent (macOS 13 or later; tests/test_metal_api.py holds it to sdk14_availability.txt), and what
// the macOS 14 SDK lacks sits under the SDK guard Apple's headers imply.
#pragma once
#import <Foundation/Foundation.h>

NS_ASSUME_NONNULL_BEGIN

typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
  MTLResourceCPUCacheModeDefaultCache = 0,
  MTLResourceStorageModeShared = 0 << 4,
  MTLResourceStorageModeManaged = 1 << 4,
  MTLResourceStorageModePrivate = 2 << 4,
  MTLResourceHazardTrackingModeUntracked = 1 << 8,
};
typedef NS_ENUM(NSUInteger, MTLDataType) {
  MTLDataTypeNone = 0, MTLDataTypeFloat = 3, MTLDataTypeHalf = 16, MTLDataTypeInt = 29, MTLDataTypeUInt = 33,
  MTLDataTypeShort = 37, MTLDataTypeUShort = 41, MTLDataTypeBool = 53,
};
typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
  MTLCommandBufferStatusNotEnqueued = 0, MTLCommandBufferStatusEnqueued = 1, MTLCommandBufferStatusCommitted = 2,
  MTLCommandBufferStatusScheduled = 3, MTLCommandBufferStatusCompleted = 4, MTLCommandBufferStatusError = 5,
};
typedef NS_ENUM(NSUInteger, MTLLanguageVersion) {
  MTLLanguageVersion3_0 API_AVAILABLE(macos(13.0)) = (3 << 16),
  MTLLanguageVersion3_1 API_AVAILABLE(macos(14.0)) = (3 << 16) + 1,
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
  MTLLanguageVersion3_2 API_AVAILABLE(macos(15.0)) = (3 << 16) + 2,
#endif
};
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
// Replaces fastMathEnabled from the macOS 15 SDK (which deprecates it from macOS 15).
typedef NS_ENUM(NSInteger, MTLMathMode) { MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2 };
#endif
typedef NS_ENUM(NSInteger, MTLGPUFamily) {
  MTLGPUFamilyApple7 = 1007, MTLGPUFamilyApple8 = 1008, MTLGPUFamilyApple9 = 1009, MTLGPUFamilyMac2 = 2002,
  MTLGPUFamilyMetal3 API_AVAILABLE(macos(13.0)) = 5001,
};
// Serial: each dispatch of an encoder sees the previous one's writes. Concurrent: dispatches may
// overlap; memoryBarrierWithScope: orders them where needed.
typedef NS_ENUM(NSUInteger, MTLDispatchType) { MTLDispatchTypeSerial = 0, MTLDispatchTypeConcurrent = 1 };
typedef NS_OPTIONS(NSUInteger, MTLBarrierScope) {
  MTLBarrierScopeBuffers = 1 << 0, MTLBarrierScopeTextures = 1 << 1, MTLBarrierScopeRenderTargets = 1 << 2,
};

typedef struct { NSUInteger width, height, depth; } MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger w, NSUInteger h, NSUInteger d) { MTLSize s = {w, h, d}; return s; }

@protocol MTLDevice;
@protocol MTLResource <NSObject>
@property (nullable, copy) NSString* label;
@property (readonly) id<MTLDevice> device;
@end
@protocol MTLBuffer <MTLResource>
@property (readonly) NSUInteger length;
- (void*)contents;
- (void)didModifyRange:(NSRange)range;
@end
@interface MTLFunctionConstantValues : NSObject
- (void)setConstantValue:(const void*)value type:(MTLDataType)type atIndex:(NSUInteger)index;
- (void)setConstantValue:(const void*)value type:(MTLDataType)type withName:(NSString*)name;
- (void)setConstantValues:(const void*)values type:(MTLDataType)type withRange:(NSRange)range;
- (void)reset;
@end
@interface MTLCompileOptions : NSObject
@property (readwrite, nonatomic) BOOL fastMathEnabled;
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
@property (readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0));
#endif
@property (readwrite, nonatomic) MTLLanguageVersion languageVersion;
@property (nullable, readwrite, copy, nonatomic) NSDictionary<NSString*, NSObject*>* preprocessorMacros;
@end
@protocol MTLFunction <NSObject>
@property (readonly) NSString* name;
@property (readonly) id<MTLDevice> device;
@end
@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)name
                                 constantValues:(MTLFunctionConstantValues*)constantValues
                                          error:(__autoreleasing NSError**)error;
@property (readonly) NSArray<NSString*>* functionNames;
@end
@protocol MTLComputePipelineState <NSObject>
@property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property (readonly) NSUInteger threadExecutionWidth;
@property (readonly) NSUInteger staticThreadgroupMemoryLength;
@end
@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)dispatchThreads:(MTLSize)threadsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
@end
@protocol MTLCommandBuffer;
// Called once the command buffer has finished (successfully or not), on a Metal thread.
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);
@protocol MTLCommandBuffer <NSObject>
@property (nullable, copy, atomic) NSString* label;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoderWithDispatchType:(MTLDispatchType)dispatchType;
- (void)addCompletedHandler:(MTLCommandBufferHandler)block;
- (void)commit;
- (void)waitUntilCompleted;
@property (readonly) MTLCommandBufferStatus status;
@property (nullable, readonly) NSError* error;
@property (readonly) double GPUStartTime;
@property (readonly) double GPUEndTime;
@end
@protocol MTLCommandQueue <NSObject>
- (nullable id<MTLCommandBuffer>)commandBuffer;
@end
@protocol MTLDevice <NSObject>
@property (readonly) NSString* name;
@property (readonly) uint64_t registryID;
@property (readonly) NSUInteger maxThreadgroupMemoryLength;
@property (readonly) BOOL hasUnifiedMemory;
@property (readonly, getter=isLowPower) BOOL lowPower;
@property (readonly, getter=isRemovable) BOOL removable;
@property (readonly) uint64_t recommendedMaxWorkingSetSize;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
- (nullable id<MTLCommandQueue>)newCommandQueue;
- (nullable id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytes:(const void*)pointer length:(NSUInteger)length options:(MTLResourceOptions)options;
// Wraps existing page-aligned memory without copying; deallocator (may be nil) runs when the
// buffer is released.
- (nullable id<MTLBuffer>)newBufferWithBytesNoCopy:(void*)pointer
                                           length:(NSUInteger)length
                                          options:(MTLResourceOptions)options
                                      deallocator:(void (^_Nullable)(void* pointer, NSUInteger length))deallocator;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source options:(nullable MTLCompileOptions*)options
                                         error:(__autoreleasing NSError**)error;
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(__autoreleasing NSError**)error;
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                                      error:(__autoreleasing NSError**)error;
@end

#ifdef __cplusplus
extern "C" {
#endif
id<MTLDevice> _Nullable MTLCreateSystemDefaultDevice(void);
NSArray<id<MTLDevice>>* MTLCopyAllDevices(void);
#ifdef __cplusplus
}
#endif

NS_ASSUME_NONNULL_END
