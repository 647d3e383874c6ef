// What the Metal Shading Language gives every source before its first #include (force-included by
// tests/test_metal_sources.py): the address-space and function qualifiers, and the scalar and vector
// types (MSL specification 2.1-2.2; <metal_stdlib> declares the rest). See metal_stdlib beside it.
#pragma once

#include "msl_scalars.h"

#define kernel
#define device
#define constant
#define threadgroup
#define thread
#define METAL_FUNC inline
#define __METAL_VERSION__ 310

// half is _Float16 and bfloat __bf16 (the parse targets Apple silicon, -target arm64-apple-macos14
// -march=armv8.6-a+bf16, where both exist); clang 14 has no __bf16 arithmetic, so GGML_METAL_HAS_BF16's
// kernels are left out of the parse
typedef _Float16 half;
typedef __bf16 bfloat;

#define LB_MSL_VECTORS(T)                                          \
    typedef T T##2 __attribute__((ext_vector_type(2)));            \
    typedef T T##3 __attribute__((ext_vector_type(3)));            \
    typedef T T##4 __attribute__((ext_vector_type(4)));
LB_MSL_VECTOR_ELEMENTS(LB_MSL_VECTORS)
#undef LB_MSL_VECTORS
// packed vectors (MSL 2.2.3): the element layout without the vector alignment
typedef char packed_char2 __attribute__((ext_vector_type(2)));
typedef char packed_char4 __attribute__((ext_vector_type(4)));
typedef uchar packed_uchar4 __attribute__((ext_vector_type(4)));
typedef short packed_short4 __attribute__((ext_vector_type(4)));
typedef float packed_float2 __attribute__((ext_vector_type(2)));
typedef float packed_float3 __attribute__((ext_vector_type(3)));
typedef float packed_float4 __attribute__((ext_vector_type(4)));
typedef half packed_half4 __attribute__((ext_vector_type(4)));
// bool vectors: clang's vector types take no bool elements; MSL's boolN are the same width of truth values
typedef char bool2 __attribute__((ext_vector_type(2)));
typedef char bool3 __attribute__((ext_vector_type(3)));
typedef char bool4 __attribute__((ext_vector_type(4)));


// MSL's half literals (1.0h, 2h): a literal suffix C++ reserves for itself (-Wno-user-defined-literals)
constexpr half operator""h(long double x) { return (half) x; }
constexpr half operator""h(unsigned long long x) { return (half) x; }

// constants of <metal_math> (MSL 6.2.1)
#define INFINITY __builtin_huge_valf()
#define NAN __builtin_nanf("")
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define HALF_MAX ((half) 65504.0f)
#define MAXHALF HALF_MAX
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_LN2_F 0.69314718055994530941723212145817656f
#define M_SQRT2_F 1.41421356237309504880168872420969808f

// MSL converts vectors element by element, with a C-style cast ((float4) h) or a constructor (float4(h),
// float4(a.xy, b.xy), float4(0)); clang's vector casts are bit casts between vectors of one size. The test
// rewrites `(floatN) e` (and `(name_t) e`, the kernels' type parameters) to `lb_cast<floatN>() ->* e`:
// ->* binds tighter than any binary operator but looser than the prefix and postfix ones, so its operand
// is the cast's; and `floatN(` to `lb_vec<floatN>(`. Both build the vector element by element.
template <typename V, typename = void> struct lb_is_vec { static constexpr bool value = false; };
template <typename V> struct lb_is_vec<V, decltype((void) V{}[0])> { static constexpr bool value = true; };
template <typename V> constexpr int lb_lanes() { return sizeof(V) / sizeof(V{}[0]); }
template <typename V, typename A> void lb_put(V & r, int & i, A a) {
    if constexpr (lb_is_vec<A>::value) {
        for (int k = 0; k < lb_lanes<A>(); ++k) r[i++] = a[k];
    } else {
        r[i++] = a;
    }
}
template <typename V, typename... A> V lb_vec(A... a) {
    if constexpr (!lb_is_vec<V>::value) {
        return V(a...);
    } else {
        V r{};
        int i = 0;
        (lb_put(r, i, a), ...);
        if (i == 1) {
            for (int k = 1; k < lb_lanes<V>(); ++k) r[k] = r[0];
        }
        return r;
    }
}
template <typename V> struct lb_cast {
    template <typename X> friend V operator->*(lb_cast, X x) { return lb_vec<V>(x); }
};
