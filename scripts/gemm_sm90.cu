// Hopper (sm_90a) GEMMs for the decode step's projections: y = x @ w.T with x [M, K] the
// step's tokens (M up to a few hundred) and w [N, K] a bf16 weight. An experiment, timed
// against cuBLAS by scripts/sweep_sm90_gemm.py; the engine does not use it (it was slower,
// docs/benchmarks.md, ninth session).
//
// Why try: at decode batch sizes cuBLAS runs q/k/v, o and the down projection well below
// the tensor cores' rate, and SiLU(gate) * up is one more pass over the gate/up product.
// Here one CTA owns 128 weight rows and a tile of 128 or 256 tokens, the inner dimension
// can be split over CTAs into float32 partial products that the next RMSNorm sums
// (minisparse.engine.layers.fused_ops.add_rms_norm), and the gate/up kernel applies
// SiLU(gate) * up before anything leaves the SM.
//
// Structure: warpgroup 0 is the producer (one thread issues bulk tensor copies, TMA, into
// a ring of shared-memory stages guarded by mbarriers); warpgroups 1 and 2 each multiply
// 64 weight rows by the token tile with wgmma, accumulators in registers. Weights are the
// A operand (the instruction's M = weight rows), tokens the B operand (its N), both K-major
// in 128-byte-swizzled tiles of 64 inner elements. Under NVRTC (__CUDACC_RTC__) only the
// device code compiles, which is enough for a register and spill check without nvcc.
#ifdef __CUDACC_RTC__
typedef unsigned long long uint64_t;
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef unsigned long long uintptr_t;
typedef unsigned char uint8_t;
struct alignas(64) CUtensorMap { uint64_t opaque[16]; };
#else
#include <cstdint>
#include <cuda.h>
#include <dlfcn.h>
#include <torch/extension.h>
#endif

namespace msgemm {

constexpr int kBlockK = 64;     // inner elements per stage: one 128-byte swizzle row of bf16
constexpr int kRows = 128;      // weight rows per CTA (two consumer warpgroups of 64)
constexpr int kThreads = 384;   // producer warpgroup + two consumer warpgroups

enum Mode : int { kBf16 = 0, kPartials = 1, kSiluGateUp = 2 };

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n"
               ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  } while (!done);
}

// One box of a 2-D tensor map (inner coordinate first) into shared memory; completion is
// counted in bytes on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const void* map, uint64_t* bar, int inner,
                                         int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)),
      "r"(inner), "r"(outer) : "memory");
}

// wgmma shared-memory descriptor of a K-major tile with 128-byte swizzle: rows of 128 bytes
// in 8-row atoms of 1,024 bytes (the stride byte offset); the leading offset is unused.
__device__ __forceinline__ uint64_t smem_desc(const void* tile) {
  uint64_t d = (smem_addr(tile) & 0x3FFFF) >> 4;
  d |= uint64_t(1) << 16;
  d |= uint64_t(1024 >> 4) << 32;
  d |= uint64_t(1) << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ uint16_t to_bf16(float f) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ float from_bf16(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// The accumulator operands of one wgmma: "%0".."%63" name d[0..63] in the first block of
// 64 and "%64".."%127" the second (n256 only); the descriptors and the scale-d flag follow.
#define MSGEMM_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MSGEMM_F64(i) MSGEMM_F8(i), MSGEMM_F8(i + 8), MSGEMM_F8(i + 16), MSGEMM_F8(i + 24), \
    MSGEMM_F8(i + 32), MSGEMM_F8(i + 40), MSGEMM_F8(i + 48), MSGEMM_F8(i + 56)
#define MSGEMM_REGS_0_63 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MSGEMM_REGS_64_127 \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

__device__ __forceinline__ void wgmma_n128(float (&d)[64], uint64_t da, uint64_t db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
               "{" MSGEMM_REGS_0_63 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : MSGEMM_F64(0)
               : "l"(da), "l"(db), "n"(1));
}

__device__ __forceinline__ void wgmma_n256(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
               "{" MSGEMM_REGS_0_63 ", " MSGEMM_REGS_64_127 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
               : MSGEMM_F64(0), MSGEMM_F64(64)
               : "l"(da), "l"(db), "n"(1));
}

template <int NT>
__device__ __forceinline__ void wgmma_tile(float (&d)[NT / 2], uint64_t da, uint64_t db) {
  if constexpr (NT == 256) wgmma_n256(d, da, db);
  else wgmma_n128(d, da, db);
}

// Stage bytes: 128 weight rows and NT token rows of kBlockK bf16 each.
template <int NT>
constexpr int stage_bytes() { return (kRows + NT) * kBlockK * 2; }

template <int NT>
constexpr int num_stages() { return NT == 256 ? 4 : 7; }

template <int NT>
constexpr int smem_bytes() { return num_stages<NT>() * stage_bytes<NT>() + 2 * num_stages<NT>() * 8 + 1024; }

// Copy NT staged rows (`pitch` bytes apart in shared memory, row_bytes each) to token rows
// tok0... of out (ld_bytes apart, starting col_bytes in), 16 bytes per thread and step, so
// that a warp writes whole 128-byte lines; tokens >= M are left out.
template <int NT>
__device__ __forceinline__ void store_rows(const uint8_t* staged, int pitch, int row_bytes,
                                           uint8_t* out, size_t ld_bytes, size_t col_bytes,
                                           int tok0, int M, int tid) {
  const int chunks = row_bytes / 16;
  for (int idx = tid; idx < NT * chunks; idx += 128) {
    const int t = idx / chunks, ch = idx % chunks;
    if (tok0 + t < M)
      *reinterpret_cast<uint4*>(out + size_t(tok0 + t) * ld_bytes + col_bytes + ch * 16) =
          *reinterpret_cast<const uint4*>(staged + t * pitch + ch * 16);
  }
}

// grid: (token tiles, weight-row tiles, inner splits). kBf16: out [M, N] bf16 (+ bias);
// kPartials: out [splits, M, N] float32; kSiluGateUp: w = [gate; up] (up_rows = its half),
// out [M, up_rows] bf16 = silu(x gate.T) * (x up.T), each product rounded to bf16 first.
template <int NT, int MODE>
__global__ void __launch_bounds__(kThreads, 1)
gemm_kernel(const __grid_constant__ CUtensorMap wmap,
            const __grid_constant__ CUtensorMap xmap, void* __restrict__ out,
            const uint16_t* __restrict__ bias, int M, int N, int K, int up_rows,
            int kblocks_per_split) {
  constexpr int S = num_stages<NT>();
  constexpr int kStage = stage_bytes<NT>();
  constexpr int kHalfW = 64 * kBlockK * 2;  // one consumer's 64 weight rows
  constexpr int R = NT / 2;                 // accumulators per thread
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * kStage);
  uint64_t* empty = full + S;

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int tile = blockIdx.y;  // weight-row tile; token tiles vary fastest (shared weights in L2)
  const int tok0 = blockIdx.x * NT;
  const int kb0 = blockIdx.z * kblocks_per_split;
  const int nkb = min(K / kBlockK - kb0, kblocks_per_split);
  const int row0 = MODE == kSiluGateUp ? tile * 64 : tile * kRows;
  const int row1 = MODE == kSiluGateUp ? up_rows + tile * 64 : row0 + 64;

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&wmap)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&xmap)) : "memory");
      for (int i = 0; i < nkb; ++i) {
        const int s = i % S;
        if (i >= S) mbar_wait(&empty[s], ((i / S) - 1) & 1);
        uint8_t* st = smem + s * kStage;
        const int k = (kb0 + i) * kBlockK;
        mbar_expect_tx(&full[s], kStage);
        tma_load(st, &wmap, &full[s], k, row0);
        tma_load(st + kHalfW, &wmap, &full[s], k, row1);
#pragma unroll
        for (int h = 0; h < NT / 128; ++h)
          tma_load(st + 2 * kHalfW + h * 128 * kBlockK * 2, &xmap, &full[s], k, tok0 + h * 128);
      }
    }
    return;
  }

  const int c = wg - 1;  // consumer: weight rows [row_c, row_c + 64)
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = 0.f;
  for (int i = 0; i < nkb; ++i) {
    const int s = i % S;
    mbar_wait(&full[s], (i / S) & 1);
    uint8_t* st = smem + s * kStage;
    const uint64_t da = smem_desc(st + c * kHalfW), db = smem_desc(st + 2 * kHalfW);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) wgmma_tile<NT>(acc, da + 2 * kk, db + 2 * kk);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(acc);
    if (i > 0 && tid == 0) mbar_arrive(&empty[(i - 1) % S]);
  }
  wgmma_wait<0>();
  fence_regs(acc);

  // Accumulator i of thread (warp w, lane l): weight row w*16 + l/4 (+8 for i%4 >= 2),
  // token 8*(i/4) + 2*(l%4) (+1 for odd i). Results go to shared memory as [token][64]
  // rows first and leave in 16-byte pieces of whole rows: written straight from the
  // fragments, each store would move 2- or 4-byte scraps of four tokens.
  const int w = tid / 32, l = tid % 32;
  const int r_lo = w * 16 + l / 4, t_lo = 2 * (l % 4);
  constexpr int kPitch16 = 64 * 2 + 16, kPitch32 = 64 * 4 + 16;  // padded: no bank conflicts
  asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers are done with the stages
  if constexpr (MODE == kSiluGateUp) {
    float* up = reinterpret_cast<float*>(smem);
    uint8_t* staged = smem + 128 * R * 4;
    if (c == 1) {
#pragma unroll
      for (int i = 0; i < R; ++i) up[i * 128 + tid] = acc[i];
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (c == 1) return;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int tok = t_lo + 8 * (i / 4) + (i & 1), row = r_lo + ((i & 2) ? 8 : 0);
      const float g = from_bf16(to_bf16(acc[i]));
      const float u = from_bf16(to_bf16(up[i * 128 + tid]));
      const float act = from_bf16(to_bf16(g / (1.0f + expf(-g))));
      *reinterpret_cast<uint16_t*>(staged + tok * kPitch16 + row * 2) = to_bf16(act * u);
    }
    asm volatile("bar.sync 2, 128;" ::: "memory");
    store_rows<NT>(staged, kPitch16, 128, reinterpret_cast<uint8_t*>(out), size_t(up_rows) * 2,
                   size_t(tile) * 64 * 2, tok0, M, tid);
  } else if constexpr (MODE == kPartials) {
    uint8_t* staged = smem + c * NT * kPitch32;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int tok = t_lo + 8 * (i / 4) + (i & 1), row = r_lo + ((i & 2) ? 8 : 0);
      *reinterpret_cast<float*>(staged + tok * kPitch32 + row * 4) = acc[i];
    }
    asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
    store_rows<NT>(staged, kPitch32, 256,
                   reinterpret_cast<uint8_t*>(out) + size_t(blockIdx.z) * M * N * 4,
                   size_t(N) * 4, size_t(row0 + c * 64) * 4, tok0, M, tid);
  } else {
    uint8_t* staged = smem + c * NT * kPitch16;
    const int rbase = row0 + c * 64;
    const float b_lo = bias ? from_bf16(bias[rbase + r_lo]) : 0.f;
    const float b_hi = bias ? from_bf16(bias[rbase + r_lo + 8]) : 0.f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int tok = t_lo + 8 * (i / 4) + (i & 1), row = r_lo + ((i & 2) ? 8 : 0);
      *reinterpret_cast<uint16_t*>(staged + tok * kPitch16 + row * 2) =
          to_bf16(acc[i] + ((i & 2) ? b_hi : b_lo));
    }
    asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
    store_rows<NT>(staged, kPitch16, 128, reinterpret_cast<uint8_t*>(out), size_t(N) * 2,
                   size_t(rbase) * 2, tok0, M, tid);
  }
}

}  // namespace msgemm

#ifndef __CUDACC_RTC__
namespace msgemm {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder, found at run time so that the extension links against
// no libcuda stub.
EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib, "gemm_sm90: cannot open libcuda.so.1");
    auto f = reinterpret_cast<EncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled"));
    TORCH_CHECK(f, "gemm_sm90: libcuda.so.1 has no cuTensorMapEncodeTiled");
    return f;
  }();
  return fn;
}

// A [rows, K] bf16 matrix read in boxes of box_rows x 64 with the 128-byte swizzle.
CUtensorMap tensor_map(const torch::Tensor& t, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(t.size(1)), cuuint64_t(t.size(0))};
  const cuuint64_t strides[1] = {cuuint64_t(t.stride(0)) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kBlockK), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(), dims, strides, box, elem,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "gemm_sm90: cuTensorMapEncodeTiled failed with ", int(r));
  return map;
}

template <int NT, int MODE>
void launch(const torch::Tensor& x, const torch::Tensor& w, const uint16_t* bias, void* out,
            int splits, cudaStream_t stream) {
  auto kernel = gemm_kernel<NT, MODE>;
  static bool configured = false;
  if (!configured) {
    TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     smem_bytes<NT>()) == cudaSuccess,
                "gemm_sm90: cannot raise the shared-memory limit");
    configured = true;
  }
  const int M = x.size(0), K = x.size(1), N = w.size(0);
  const int kblocks = K / kBlockK, per = (kblocks + splits - 1) / splits;
  TORCH_CHECK((splits - 1) * per < kblocks, "gemm_sm90: ", splits, " splits of ", kblocks,
              " inner blocks leave one empty");
  const int up_rows = N / 2;
  const dim3 grid((M + NT - 1) / NT, MODE == kSiluGateUp ? up_rows / 64 : N / kRows, splits);
  kernel<<<grid, kThreads, smem_bytes<NT>(), stream>>>(
      tensor_map(w, 64), tensor_map(x, 128), out, bias, M, N, K, up_rows, per);
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "gemm_sm90: launch failed: ", cudaGetErrorString(err));
}

// out = x @ w.T in one of the three modes (see gemm_kernel); token_tile 128 or 256.
void gemm(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, torch::Tensor out,
          int64_t mode, int64_t splits, int64_t token_tile, int64_t stream) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && out.is_cuda(), "gemm_sm90: tensors must be on CUDA");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16,
              "gemm_sm90: x and w must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemm_sm90: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(),
              "gemm_sm90: x, w and out must be contiguous");
  TORCH_CHECK(x.size(1) % kBlockK == 0, "gemm_sm90: K must be a multiple of 64");
  TORCH_CHECK(w.size(0) % kRows == 0, "gemm_sm90: N must be a multiple of 128");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "gemm_sm90: x and w must be 16-byte aligned");
  TORCH_CHECK(splits >= 1 && (mode == kPartials || splits == 1),
              "gemm_sm90: only the partials mode splits the inner dimension");
  const int64_t M = x.size(0), N = w.size(0);
  if (mode == kBf16) {
    TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.numel() == M * N, "gemm_sm90: out must be [M, N] bf16");
  } else if (mode == kPartials) {
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.numel() == splits * M * N,
                "gemm_sm90: out must be [splits, M, N] float32");
  } else {
    TORCH_CHECK(mode == kSiluGateUp, "gemm_sm90: unknown mode ", mode);
    TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.numel() == M * N / 2,
                "gemm_sm90: out must be [M, N / 2] bf16");
  }
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(mode == kBf16 && bias->scalar_type() == torch::kBFloat16 && bias->numel() == N &&
                bias->is_contiguous(), "gemm_sm90: bias must be [N] bf16, in the bf16 mode");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  if (M == 0) return;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  void* o = out.data_ptr();
  TORCH_CHECK(token_tile == 128 || token_tile == 256, "gemm_sm90: token_tile must be 128 or 256");
  const int sp = int(splits);
#define MSGEMM_CASE(NT, MODE) \
  if (token_tile == NT && mode == MODE) return launch<NT, MODE>(x, w, b, o, sp, s);
  MSGEMM_CASE(128, kBf16) MSGEMM_CASE(128, kPartials) MSGEMM_CASE(128, kSiluGateUp)
  MSGEMM_CASE(256, kBf16) MSGEMM_CASE(256, kPartials) MSGEMM_CASE(256, kSiluGateUp)
#undef MSGEMM_CASE
}

}  // namespace msgemm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &msgemm::gemm, "y = x @ w.T on Hopper (see gemm_sm90.cu)");
}
#endif
