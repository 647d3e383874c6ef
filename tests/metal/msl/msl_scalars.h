// MSL's scalar type names from the compiler's own macros, without a system header (MSL has no C
// library): shared by the parse shim (msl_prelude.h) and the executable one (tests/metal/emu).
#pragma once

typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

// the element types MSL has vectors of (float2 ... ulong4): LB_MSL_VECTOR_ELEMENTS(X) calls X(T) for each
#define LB_MSL_VECTOR_ELEMENTS(X) X(float) X(half) X(bfloat) X(int) X(uint) X(short) X(ushort) X(char) X(uchar) X(long) X(ulong)
