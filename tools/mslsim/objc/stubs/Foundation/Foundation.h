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
