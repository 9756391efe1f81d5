// Minimal Foundation stub (no GNUstep needed), so that ARC code can be syntax-checked with clang
// on any platform: only what Metal.h and the host code use.
#pragma once
#include <stddef.h>
#include <stdint.h>
typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef signed char BOOL;
#define nil ((id)0)
#define Nil ((Class)0)
#define YES ((BOOL)1)
#define NO ((BOOL)0)
#define NS_ENUM(T, N) enum N : T N; enum N : T
#define NS_OPTIONS(T, N) enum N : T N; enum N : T
#define NS_ASSUME_NONNULL_BEGIN _Pragma("clang assume_nonnull begin")
#define NS_ASSUME_NONNULL_END _Pragma("clang assume_nonnull end")
// The SDK these stubs stand for, as Apple's Availability.h says it (150000: the macOS 15 SDK).
// -D__MAC_OS_X_VERSION_MAX_ALLOWED=140000 makes them the macOS 14 SDK: what that SDK lacks (see
// tools/metal_api/sdk14_availability.txt) is then undeclared, as with Xcode 15.
#ifndef __MAC_OS_X_VERSION_MAX_ALLOWED
#define __MAC_OS_X_VERSION_MAX_ALLOWED 150000
#endif
// API_AVAILABLE(macos(15.0)) as Apple writes it: clang's availability attribute, which
// -Wunguarded-availability-new checks against the deployment target (-target ...-macos14).
#define API_AVAILABLE(platform) KRNL_STUB_AVAILABLE_##platform
#define KRNL_STUB_AVAILABLE_macos(v) __attribute__((availability(macos, introduced = v)))
typedef struct _NSRange { NSUInteger location, length; } NSRange;
@class NSString;
@protocol NSObject
- (BOOL)isEqual:(id)object;
@end
__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
- (instancetype)init;
+ (instancetype)new;
@end
@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)s;
+ (instancetype)stringWithFormat:(NSString*)fmt, ...;
@property (readonly) const char* UTF8String;
@end
@interface NSError : NSObject
@property (readonly, copy) NSString* localizedDescription;
@end
@interface NSURL : NSObject
+ (instancetype)fileURLWithPath:(NSString*)path;
@end
@interface NSArray<ObjectType> : NSObject
@property (readonly) NSUInteger count;
- (ObjectType)objectAtIndex:(NSUInteger)index;
@end
@interface NSDictionary<KeyType, ObjectType> : NSObject
@end
#ifdef __cplusplus
extern "C"
#endif
void NSLog(NSString* fmt, ...);
