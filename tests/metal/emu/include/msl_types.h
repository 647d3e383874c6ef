// The Metal Shading Language's scalar, vector and matrix types for running ggml-metal's kernels on the
// CPU (issue 57; tests only, never in a wheel). MSL is C++14-based; what it adds is given its MSL meaning:
//   - half is _Float16 (an arithmetic type: MSL's conversions and promotions); bfloat a 16-bit storage
//     type whose arithmetic runs in float and rounds on store (round to nearest even)
//   - vectors (float4, half2, ...) are vec<T, N>: .x .y .z .w and [i], element-wise operators, a scalar on
//     either side broadcast, explicit conversions between element types ((float4) h, float4(h)),
//     constructors from scalars and vectors (float4(a.x, b, 0, 1)); float3 takes the room of a float4
//     as in MSL (4 elements); vectors are aligned as their elements (kernels cast unaligned pointers)
//   - matrix<T, C, R>: C column vectors of R elements, m[c][r]
// MSL specification 3.2, sections 2.1-2.3.
#pragma once

#include "../../msl/msl_scalars.h"
typedef __INTPTR_TYPE__ intptr_t;

#include <type_traits>

namespace metal {

// float <-> IEEE binary16 / bfloat16, round to nearest even (NaN kept quiet)
constexpr uint16_t f32_to_f16(float f) {
    const uint32_t x = __builtin_bit_cast(uint32_t, f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t) (sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t) (sign | 0x7c00u);  // rounds to >= 65520: infinity
    if (ax < 0x38800000u) {                                      // subnormal half (or zero)
        const float a = __builtin_bit_cast(float, ax) + 0.5f;    // 0.5 = 2^-1: the low bits are the half's
        return (uint16_t) (sign | (__builtin_bit_cast(uint32_t, a) - 0x3f000000u));
    }
    const uint32_t odd = (ax >> 13) & 1u;
    return (uint16_t) (sign | ((ax + 0xc8000fffu + odd) >> 13));  // rebias 127 -> 15, round to even
}
constexpr float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return __builtin_bit_cast(float, sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        const float v = (float) m * (1.0f / 16777216.0f);  // m * 2^-24
        return sign ? -v : v;
    }
    return __builtin_bit_cast(float, sign | ((e + 112u) << 23) | (m << 13));
}
constexpr uint16_t f32_to_bf16(float f) {
    const uint32_t x = __builtin_bit_cast(uint32_t, f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t) ((x >> 16) | 0x40u);
    return (uint16_t) ((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
constexpr float bf16_to_f32(uint16_t b) { return __builtin_bit_cast(float, (uint32_t) b << 16); }

template <typename T> struct is_arith : std::is_arithmetic<T> {};
template <> struct is_arith<_Float16> : std::true_type {};

// a 16-bit float: storage, conversion, float arithmetic rounded when stored back
template <int KIND> struct f16x {
    uint16_t bits;
    f16x() = default;
    constexpr f16x(float f) : bits(KIND == 0 ? f32_to_f16(f) : f32_to_bf16(f)) {}
    template <typename A, typename = std::enable_if_t<std::is_arithmetic_v<A> && !std::is_same_v<A, float>>>
    constexpr f16x(A a) : f16x((float) a) {}
    template <int K2, typename = std::enable_if_t<K2 != KIND>> explicit constexpr f16x(f16x<K2> o) : f16x((float) o) {}
    // to floating types only: a conditional `c ? b : 0` then converts the 0 (one way, not ambiguous)
    template <typename F, typename = std::enable_if_t<std::is_floating_point_v<F> || std::is_same_v<F, _Float16>>>
    constexpr operator F() const { return F(KIND == 0 ? f16_to_f32(bits) : bf16_to_f32(bits)); }
    template <typename A> f16x & operator+=(A a) { return *this = (float) *this + a; }
    template <typename A> f16x & operator-=(A a) { return *this = (float) *this - a; }
    template <typename A> f16x & operator*=(A a) { return *this = (float) *this * a; }
    template <typename A> f16x & operator/=(A a) { return *this = (float) *this / a; }
};
template <int K> struct is_arith<f16x<K>> : std::true_type {};

// MSL's arithmetic: half op half is half, half op float is float, half op int is half
#define LB_F16_OP(OP)                                                                                  \
    template <int K> constexpr f16x<K> operator OP(f16x<K> a, f16x<K> b) { return f16x<K>((float) a OP (float) b); } \
    template <int K, typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>                \
    constexpr auto operator OP(f16x<K> a, T b) {                                                      \
        if constexpr (std::is_floating_point_v<T>) return T(T((float) a) OP b);                       \
        else return f16x<K>((float) a OP (float) b);                                                  \
    }                                                                                                 \
    template <int K, typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>                \
    constexpr auto operator OP(T a, f16x<K> b) {                                                      \
        if constexpr (std::is_floating_point_v<T>) return T(a OP T((float) b));                       \
        else return f16x<K>((float) a OP (float) b);                                                  \
    }
LB_F16_OP(+) LB_F16_OP(-) LB_F16_OP(*) LB_F16_OP(/)
#undef LB_F16_OP
#define LB_F16_CMP(OP)                                                                                 \
    template <int K> constexpr bool operator OP(f16x<K> a, f16x<K> b) { return (float) a OP (float) b; } \
    template <int K, typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>                \
    constexpr bool operator OP(f16x<K> a, T b) { return (float) a OP b; }                             \
    template <int K, typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>                \
    constexpr bool operator OP(T a, f16x<K> b) { return a OP (float) b; }
LB_F16_CMP(<) LB_F16_CMP(>) LB_F16_CMP(<=) LB_F16_CMP(>=) LB_F16_CMP(==) LB_F16_CMP(!=)
#undef LB_F16_CMP
#define LB_F16_CASSIGN(OP)                                                                             \
    template <typename T, int K, typename = std::enable_if_t<std::is_arithmetic_v<T>>>                \
    T & operator OP##=(T & a, f16x<K> b) { return a = T(a OP (float) b); }
LB_F16_CASSIGN(+) LB_F16_CASSIGN(-) LB_F16_CASSIGN(*) LB_F16_CASSIGN(/)
#undef LB_F16_CASSIGN
template <int K> constexpr f16x<K> operator-(f16x<K> a) { f16x<K> r = a; r.bits ^= 0x8000u; return r; }
template <int K> constexpr f16x<K> operator+(f16x<K> a) { return a; }

}  // namespace metal

// half is the compiler's _Float16 (g++ >= 12 on x86-64: software arithmetic rounded per operation, as
// MSL's half); bfloat is the class above (bfloat16 storage, float arithmetic rounded on store)
typedef _Float16 half;
typedef metal::f16x<1> bfloat;

// MSL's half literals (1.0h, 2h)
constexpr half operator""h(long double x) { return half((float) x); }
constexpr half operator""h(unsigned long long x) { return half((float) x); }

namespace metal {

template <typename T, int N> struct vstore;
template <typename T> struct vstore<T, 2> { T x, y; };
template <typename T> struct vstore<T, 3> { T x, y, z, pad_; };
template <typename T> struct vstore<T, 4> { T x, y, z, w; };

template <typename T, int N> struct vec;
template <typename T, int N> struct packed;
template <typename V> struct is_vec : std::false_type {};
template <typename T, int N> struct is_vec<vec<T, N>> : std::true_type {};
template <typename T, int N> struct is_vec<packed<T, N>> : std::true_type {};
template <typename A> constexpr int lanes_of() {
    if constexpr (is_vec<A>::value) return A::lanes; else return 1;
}

// (aligned as its element, not as MSL's vector: kernels cast device pointers at any element offset to
// float4 * and the like, which a GPU reads; an aligned type would let the compiler fault on them)
template <typename T, int N> struct vec : vstore<T, N> {
    static constexpr int lanes = N;
    typedef T elem;
    vec() = default;
    template <typename S, typename = std::enable_if_t<is_arith<S>::value>> constexpr vec(S s) {
        for (int i = 0; i < N; ++i) (*this)[i] = T(s);
    }
    template <typename U, typename = std::enable_if_t<!std::is_same_v<U, T>>> explicit vec(const vec<U, N> & o) {
        for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
    }
    template <typename U> explicit vec(const packed<U, N> & o) {
        for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
    }
    template <typename A, typename B, typename... R> vec(const A & a, const B & b, const R &... r) {
        static_assert(lanes_of<A>() + lanes_of<B>() + (0 + ... + lanes_of<R>()) == N, "MSL vector constructor: wrong count");
        int i = 0;
        put(i, a); put(i, b); (put(i, r), ...);
    }
    T & operator[](int i) { return (&this->x)[i]; }
    const T & operator[](int i) const { return (&this->x)[i]; }
  private:
    template <typename A> void put(int & i, const A & a) {
        if constexpr (is_vec<A>::value) { for (int k = 0; k < A::lanes; ++k) (*this)[i++] = T(a[k]); }
        else (*this)[i++] = T(a);
    }
};

template <typename A, typename B> using arith_t = decltype(std::declval<A>() + std::declval<B>());
// the element type of a vector-scalar operation: the vector's (MSL converts the scalar)
#define LB_VEC_BINOP(OP)                                                                              \
    template <typename T, int N> vec<T, N> operator OP(const vec<T, N> & a, const vec<T, N> & b) {       \
        vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]); return r;                        \
    }                                                                                                 \
    template <typename T, int N, typename S, typename = std::enable_if_t<is_arith<S>::value>>          \
    vec<T, N> operator OP(const vec<T, N> & a, S s) {                                                  \
        vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(a[i] OP T(s)); return r;                        \
    }                                                                                                 \
    template <typename T, int N, typename S, typename = std::enable_if_t<is_arith<S>::value>>          \
    vec<T, N> operator OP(S s, const vec<T, N> & a) {                                                  \
        vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(T(s) OP a[i]); return r;                        \
    }                                                                                                 \
    template <typename T, int N, typename B> vec<T, N> & operator OP##=(vec<T, N> & a, const B & b) {  \
        return a = a OP b;                                                                            \
    }
LB_VEC_BINOP(+) LB_VEC_BINOP(-) LB_VEC_BINOP(*) LB_VEC_BINOP(/) LB_VEC_BINOP(%)
LB_VEC_BINOP(&) LB_VEC_BINOP(|) LB_VEC_BINOP(^) LB_VEC_BINOP(<<) LB_VEC_BINOP(>>)
#undef LB_VEC_BINOP

#define LB_VEC_CMP(OP)                                                                                \
    template <typename T, int N> vec<bool, N> operator OP(const vec<T, N> & a, const vec<T, N> & b) {    \
        vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i]; return r;                        \
    }                                                                                                 \
    template <typename T, int N, typename S, typename = std::enable_if_t<is_arith<S>::value>>          \
    vec<bool, N> operator OP(const vec<T, N> & a, S s) {                                               \
        vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = a[i] OP T(s); return r;                        \
    }
LB_VEC_CMP(<) LB_VEC_CMP(>) LB_VEC_CMP(<=) LB_VEC_CMP(>=) LB_VEC_CMP(==) LB_VEC_CMP(!=)
#undef LB_VEC_CMP

template <typename T, int N> vec<T, N> operator-(const vec<T, N> & a) {
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(-a[i]); return r;
}
template <typename T, int N> vec<T, N> operator~(const vec<T, N> & a) {
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = ~a[i]; return r;
}
template <typename T, int N> vec<bool, N> operator!(const vec<T, N> & a) {
    vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = !a[i]; return r;
}

// matrix<T, C, R>: C columns of R rows
template <typename T, int C, int R> struct matrix {
    vec<T, R> cols[C];
    matrix() = default;
    explicit matrix(T diag) { for (int c = 0; c < C; ++c) { cols[c] = vec<T, R>(T(0)); if (c < R) cols[c][c] = diag; } }
    template <typename... V, typename = std::enable_if_t<sizeof...(V) == C && (is_vec<V>::value && ...)>>
    matrix(const V &... v) : cols{vec<T, R>(v)...} {}
    template <typename U, typename = std::enable_if_t<!std::is_same_v<U, T>>> explicit matrix(const matrix<U, C, R> & o) {
        for (int c = 0; c < C; ++c) cols[c] = vec<T, R>(o.cols[c]);
    }
    vec<T, R> & operator[](int i) { return cols[i]; }
    const vec<T, R> & operator[](int i) const { return cols[i]; }
};
template <typename T, int C, int R, typename S, typename = std::enable_if_t<is_arith<S>::value>>
matrix<T, C, R> operator*(const matrix<T, C, R> & m, S s) {
    matrix<T, C, R> r; for (int c = 0; c < C; ++c) r.cols[c] = m.cols[c] * s; return r;
}
template <typename T, int C, int R> vec<T, R> operator*(const matrix<T, C, R> & m, const vec<T, C> & v) {
    vec<T, R> r(T(0)); for (int c = 0; c < C; ++c) r += m.cols[c] * v[c]; return r;
}
template <typename T, int C, int R> matrix<T, C, R> operator+(const matrix<T, C, R> & a, const matrix<T, C, R> & b) {
    matrix<T, C, R> r; for (int c = 0; c < C; ++c) r.cols[c] = a.cols[c] + b.cols[c]; return r;
}

}  // namespace metal

#define LB_MSL_VECTORS(T)              \
    typedef metal::vec<T, 2> T##2;     \
    typedef metal::vec<T, 3> T##3;     \
    typedef metal::vec<T, 4> T##4;
LB_MSL_VECTOR_ELEMENTS(LB_MSL_VECTORS)
LB_MSL_VECTORS(bool)
#undef LB_MSL_VECTORS

namespace metal {
// packed vectors (MSL 2.2.3): the elements without the vector's alignment
template <typename T, int N> struct packed {
    static constexpr int lanes = N;
    typedef T elem;
    T v[N];
    packed() = default;
    packed(const vec<T, N> & a) { for (int i = 0; i < N; ++i) v[i] = a[i]; }
    operator vec<T, N>() const { vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = v[i]; return r; }
    T & operator[](int i) { return v[i]; }
    const T & operator[](int i) const { return v[i]; }
};
}  // namespace metal
template <typename T, int N> using lb_packed = metal::packed<T, N>;
typedef lb_packed<char, 2> packed_char2;
typedef lb_packed<char, 4> packed_char4;
typedef lb_packed<uchar, 4> packed_uchar4;
typedef lb_packed<short, 4> packed_short4;
typedef lb_packed<float, 2> packed_float2;
typedef lb_packed<float, 3> packed_float3;
typedef lb_packed<float, 4> packed_float4;
typedef lb_packed<half, 4> packed_half4;

typedef metal::matrix<float, 4, 4> float4x4;
typedef metal::matrix<float, 2, 4> float2x4;
typedef metal::matrix<float, 4, 2> float4x2;
typedef metal::matrix<float, 2, 2> float2x2;
typedef metal::matrix<half, 4, 4> half4x4;
typedef metal::matrix<half, 2, 4> half2x4;
typedef metal::matrix<half, 4, 2> half4x2;
typedef metal::matrix<half, 2, 2> half2x2;
