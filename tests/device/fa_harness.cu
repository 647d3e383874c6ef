// The flash-attention training kernels of the patched tree (ggml-cuda/fattn-back.cu) outside llamabind: a shared
// library that launches them on device buffers the caller owns (PyTorch tensors in fa_harness.py), so that a kernel
// change is checked against PyTorch and timed beside SDPA in one short call on the GPU machine, without the
// 5-minute build of llamabind. fa_harness.py builds it there:
//   nvcc -O3 -std=c++17 -arch=sm_90 -shared -Xcompiler -fPIC -I<ggml>/include -I<ggml>/src -I<ggml>/src/ggml-cuda
// The kernels and their launch geometry are fattn-back.cu's own (this file includes it); what it adds is the
// argument plumbing. Every entry point returns a cudaError_t (0: launched).
#include "fattn-back.cu"

#include <cstdarg>
#include <cstdio>

// what fattn-back.cu's host entry points (never called here) reference from the rest of ggml
const ggml_cuda_device_info & ggml_cuda_info() { abort(); }
void ggml_cuda_error(const char * stmt, const char * func, const char * file, int line, const char * msg) {
    fprintf(stderr, "fa_harness: CUDA error %s at %s:%d (%s): %s\n", msg, file, line, func, stmt);
    abort();
}
int ggml_cuda_get_device() { abort(); }
void ggml_cuda_set_device(int) { abort(); }
std::unique_ptr<ggml_cuda_pool> ggml_backend_cuda_context::new_pool_for_device(int, int) { abort(); }
extern "C" {
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fa_harness: ggml_abort at %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    abort();
}
ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t) { abort(); }
ggml_backend_buffer_type_t ggml_backend_cuda_buffer_type(int) { abort(); }
bool ggml_flash_attn_ext_get_keep_stats(const struct ggml_tensor *) { abort(); }
size_t ggml_nbytes(const struct ggml_tensor *) { abort(); }
const char * ggml_type_name(enum ggml_type) { abort(); }
size_t ggml_type_size(enum ggml_type) { abort(); }
void ggml_log_internal(enum ggml_log_level, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}
}

// the kernels' view of an F16 mask [ne3, ne2, rows, M] (byte strides nb1..nb3; data nullptr: none) with its tile
// classes in tiles, as ggml_cuda_flash_attn_back builds it
static fab_mask fah_mask(const void * data, int64_t nb1, int64_t nb2, int64_t nb3, int ne2, int ne3, const void * tiles,
        int N, int M) {
    ggml_tensor t = {};
    t.data  = (void *) data;
    t.ne[2] = ne2;
    t.ne[3] = ne3;
    t.nb[1] = nb1;
    t.nb[2] = nb2;
    t.nb[3] = nb3;
    return fab_mask_view(data ? &t : nullptr, (const uint8_t *) tiles, N, M);
}

template <typename K>
static cudaError_t fah_smem(K kernel, size_t bytes) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

extern "C" {

// fa_back_tiles over the mask: the class of each 64 x 64 tile, n_slices x nqb x nkb bytes
int fah_tiles(const void * mask, void * tiles, int N, int M, int64_t nb1, int64_t nb2, int64_t nb3, int ne2, int ne3) {
    const fab_mask m = fah_mask(mask, nb1, nb2, nb3, ne2, ne3, tiles, N, M);
    fa_back_tiles<<<dim3(m.nkb, m.nqb, ne2*ne3), 256>>>((const char *) mask, (uint8_t *) tiles, N, M, nb1, nb2, nb3,
        ne2, m.nqb, m.nkb);
    return cudaGetLastError();
}

// the training forward: out [S, N, H, D] F32, lse [S, H, N] (log2 units), Q, K, V BF16; variant 0: fa_fwd_mma<D,
// D == 64> (64 query rows a block, 16 a warp, mma.sync; pipelined at D = 64, as ggml-cuda runs it); 1: fa_fwd_wgmma<D>
// (sm_90a: the block's 4 warps as one warpgroup, Q read from shared memory by each product); 2: the same, Q in
// registers (patch 0099's). (A variant 3 that overlapped a tile's softmax with the last tile's P V was no faster and,
// once ptxas stopped serializing it, wrong at D = 128: bench/results/h200-2026-12-04-wgmma84; dropped. A version of
// variant 0 with 128 rows a block, 32 a warp, ran slower: 0.457 ms against 0.393 at 4 x 32 heads x 2048 x 64 on an
// H200, 0.408 with registers for 3 blocks an SM.)
} // extern "C"

template <int D>
static cudaError_t fah_fwd_d(int variant, const void * Qb, const void * Kb, const void * Vb, const fab_mask & m,
        float * out, float * lse, int N, int M, int H, int Hk, int S, int Sk, float scale) {
    const dim3 grid(H, S, (N + FAB_B - 1)/FAB_B);
    const fab_qf32 qf = { nullptr, 0, 0, 0, nullptr };
    cudaError_t err = cudaErrorInvalidValue;
    if (variant == 0) {
        constexpr bool pipe = D == 64;
        constexpr size_t smem = fab_smem_fwd(D, pipe);
        err = fah_smem(fa_fwd_mma<D, pipe, false>, smem);
        if (err == cudaSuccess) {
            fa_fwd_mma<D, pipe, false><<<grid, FAB_NT, smem>>>(Qb, qf, Kb, Vb, m, out, lse, N, M, H, Hk, S, Sk, scale);
        }
    } else if (variant == 1 || variant == 2) {
        constexpr size_t smem = fab_smem_fwd_wgmma(D);
        auto kernel = variant == 1 ? fa_fwd_wgmma<D, false, false> : fa_fwd_wgmma<D, false, true>;
        err = fah_smem(kernel, smem);
        if (err == cudaSuccess) {
            kernel<<<grid, FAB_NT, smem>>>(Qb, qf, Kb, Vb, m, out, lse, N, M, H, Hk, S, Sk, scale);
        }
    }
    return err != cudaSuccess ? err : cudaGetLastError();
}

extern "C" {

int fah_fwd(int variant, int D, const void * Qb, const void * Kb, const void * Vb, const void * mask, int64_t nb1,
        int64_t nb2, int64_t nb3, int ne2, int ne3, const void * tiles, float * out, float * lse, int N, int M, int H,
        int Hk, int S, int Sk, float scale) {
    const fab_mask m = fah_mask(mask, nb1, nb2, nb3, ne2, ne3, tiles, N, M);
    switch (D) {
        case 64:  return fah_fwd_d<64>(variant, Qb, Kb, Vb, m, out, lse, N, M, H, Hk, S, Sk, scale);
        case 128: return fah_fwd_d<128>(variant, Qb, Kb, Vb, m, out, lse, N, M, H, Hk, S, Sk, scale);
        default:  return cudaErrorInvalidValue;
    }
}

// the dK/dV kernel at D = 64 with its dQ (dq zeroed first; dk and dv too where hparts > 1, as fa_back_launch does):
// variant 0: fa_back_mma_dkdv<64, true, true> (64 keys a block, 16 a warp); 1: fa_back_mma_dkdv2<64> (128 keys a
// block, 32 a warp); 2: fa_back_mma_dkdv<64, true, false> (no dQ: what dQ costs; hparts must be 1); kb_chunk > 0: the
// blocks dispatched in chunks of kb_chunk key blocks (fab_kv_chunk, GGML_CUDA_FA_BACK_KB_CHUNK)
int fah_dkdv(int variant, const void * Qb, const void * Kb, const void * Vb, const void * dOb, const void * mask,
        int64_t nb1, int64_t nb2, int64_t nb3, int ne2, int ne3, const void * tiles, float * dq, float * dk, float * dv,
        const float * lse, const float * dsum, int N, int M, int H, int Hk, int S, int Sk, float scale, int hparts,
        int kb_chunk) {
    const fab_mask m = fah_mask(mask, nb1, nb2, nb3, ne2, ne3, tiles, N, M);
    const uint3 rh_fd = init_fastdiv_values(H/(Hk*hparts));
    const int nkb  = (M + FAB_B - 1)/FAB_B;
    const int nkb2 = (M + FAB_B2 - 1)/FAB_B2;
    const int kc   = fab_kv_chunk(kb_chunk, Hk*hparts, Sk, nkb);
    const int kc2  = fab_kv_chunk(kb_chunk, Hk*hparts, Sk, nkb2);
    const dim3 grid  = fab_grid_kv(Hk*hparts, Sk, nkb, kc);
    const dim3 grid2 = fab_grid_kv(Hk*hparts, Sk, nkb2, kc2);
    cudaError_t err = cudaMemsetAsync(dq, 0, int64_t(N)*H*S*64*sizeof(float));
    if (err == cudaSuccess && hparts > 1) {
        err = cudaMemsetAsync(dk, 0, int64_t(M)*Hk*Sk*64*sizeof(float));
        if (err == cudaSuccess) {
            err = cudaMemsetAsync(dv, 0, int64_t(M)*Hk*Sk*64*sizeof(float));
        }
    }
    if (err != cudaSuccess) {
        return err;
    }
    switch (variant) {
        case 0: {
            constexpr size_t smem = fab_smem_mma(64, true, true);
            err = fah_smem(fa_back_mma_dkdv<64, true, true>, smem);
            if (err == cudaSuccess) {
                fa_back_mma_dkdv<64, true, true><<<grid, FAB_NT, smem>>>(Qb, Kb, Vb, dOb, m, dq, dk, dv, lse, dsum, N,
                    M, H, Hk, S, Sk, scale, hparts, rh_fd, kc);
            }
            break;
        }
        case 1: {
            constexpr size_t smem = fab_smem_dkdv2(64);
            err = fah_smem(fa_back_mma_dkdv2<64>, smem);
            if (err == cudaSuccess) {
                fa_back_mma_dkdv2<64><<<grid2, FAB_NT, smem>>>(Qb, Kb, Vb, dOb, m, dq, dk, dv, lse, dsum, N, M, H, Hk,
                    S, Sk, scale, hparts, rh_fd, kc2);
            }
            break;
        }
        case 2: {
            constexpr size_t smem = fab_smem_mma(64, true, false);
            err = fah_smem(fa_back_mma_dkdv<64, true, false>, smem);
            if (err == cudaSuccess) {
                fa_back_mma_dkdv<64, true, false><<<grid, FAB_NT, smem>>>(Qb, Kb, Vb, dOb, m, dq, dk, dv, lse, dsum, N,
                    M, H, Hk, S, Sk, scale, hparts, rh_fd, kc);
            }
            break;
        }
        default:
            return cudaErrorInvalidValue;
    }
    return err != cudaSuccess ? err : cudaGetLastError();
}

} // extern "C"

// the dK/dV kernel with its dQ at head size D (dq zeroed first; dk and dv too where hparts > 1): variant 0:
// fa_back_mma_dkdv<D, true, true> (mma.sync, 64 keys a block, 16 a warp, as ggml-cuda runs it at D = 128); 3:
// fa_back_wgmma_dkdv<D> (sm_90a: the block's 4 warps as one warpgroup); kb_chunk as fah_dkdv's
template <int D>
static cudaError_t fah_dkdv_d(int variant, const void * Qb, const void * Kb, const void * Vb, const void * dOb,
        const fab_mask & m, float * dq, float * dk, float * dv, const float * lse, const float * dsum, int N, int M,
        int H, int Hk, int S, int Sk, float scale, int hparts, int kb_chunk) {
    const uint3 rh_fd = init_fastdiv_values(H/(Hk*hparts));
    const int kc = fab_kv_chunk(kb_chunk, Hk*hparts, Sk, (M + FAB_B - 1)/FAB_B);
    const dim3 grid = fab_grid_kv(Hk*hparts, Sk, (M + FAB_B - 1)/FAB_B, kc);
    cudaError_t err = cudaMemsetAsync(dq, 0, int64_t(N)*H*S*D*sizeof(float));
    if (err == cudaSuccess && hparts > 1) {
        err = cudaMemsetAsync(dk, 0, int64_t(M)*Hk*Sk*D*sizeof(float));
        if (err == cudaSuccess) {
            err = cudaMemsetAsync(dv, 0, int64_t(M)*Hk*Sk*D*sizeof(float));
        }
    }
    if (err != cudaSuccess) {
        return err;
    }
    if (variant == 0) {
        constexpr size_t smem = fab_smem_mma(D, true, true);
        err = fah_smem(fa_back_mma_dkdv<D, true, true>, smem);
        if (err == cudaSuccess) {
            fa_back_mma_dkdv<D, true, true><<<grid, FAB_NT, smem>>>(Qb, Kb, Vb, dOb, m, dq, dk, dv, lse, dsum, N, M, H,
                Hk, S, Sk, scale, hparts, rh_fd, kc);
        }
    } else if (variant == 3) {
        constexpr size_t smem = fab_smem_dkdv_wgmma(D);
        err = fah_smem(fa_back_wgmma_dkdv<D>, smem);
        if (err == cudaSuccess) {
            fa_back_wgmma_dkdv<D><<<grid, FAB_NT, smem>>>(Qb, Kb, Vb, dOb, m, dq, dk, dv, lse, dsum, N, M, H, Hk, S,
                Sk, scale, hparts, rh_fd, kc);
        }
    } else if (variant == 4) { // variant 3 with dQ added by the TMA unit's bulk reductions (BULK_DQ)
        constexpr size_t smem = fab_smem_dkdv_wgmma(D);
        err = fah_smem(fa_back_wgmma_dkdv<D, true>, smem);
        if (err == cudaSuccess) {
            fa_back_wgmma_dkdv<D, true><<<grid, FAB_NT, smem>>>(Qb, Kb, Vb, dOb, m, dq, dk, dv, lse, dsum, N, M, H, Hk,
                S, Sk, scale, hparts, rh_fd, kc);
        }
    } else {
        return cudaErrorInvalidValue;
    }
    return err != cudaSuccess ? err : cudaGetLastError();
}

extern "C" {

int fah_dkdv_d(int variant, int D, const void * Qb, const void * Kb, const void * Vb, const void * dOb,
        const void * mask, int64_t nb1, int64_t nb2, int64_t nb3, int ne2, int ne3, const void * tiles, float * dq,
        float * dk, float * dv, const float * lse, const float * dsum, int N, int M, int H, int Hk, int S, int Sk,
        float scale, int hparts, int kb_chunk) {
    const fab_mask m = fah_mask(mask, nb1, nb2, nb3, ne2, ne3, tiles, N, M);
    switch (D) {
        case 64:  return fah_dkdv_d<64>(variant, Qb, Kb, Vb, dOb, m, dq, dk, dv, lse, dsum, N, M, H, Hk, S, Sk, scale,
                      hparts, kb_chunk);
        case 128: return fah_dkdv_d<128>(variant, Qb, Kb, Vb, dOb, m, dq, dk, dv, lse, dsum, N, M, H, Hk, S, Sk, scale,
                      hparts, kb_chunk);
        default:  return cudaErrorInvalidValue;
    }
}
} // extern "C"
