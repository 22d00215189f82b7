// kiln: CUTLASS 3.x dense FP8 GEMM on sm90 (H100/H200) with row-wise scales, for ops/fp8_linear.py:
//
//   D [M, N] (bf16) = (A [M, K] @ W [N, K]^T) * a_scale[m] * w_scale[n] (+ bias[n])
//
// A (activations) and W (weights) are float8_e4m3fn, both K-major (A row-major, W row-major =
// B column-major), the layout Hopper's FP8 wgmma wants; the accumulator is float32 with the
// tensor cores' fast FP8 accumulation (the ...FP8FastAccum schedules), as fp8_gemm's Triton kernel
// with fast_accum; the epilogue is a CUTLASS epilogue visitor tree: the per-column scale, the
// per-row scale and the optional bias (float32; nullptr = none) applied to the float32 accumulator,
// one rounding to bf16, stored through TMA.
//
// Kernels: warp-specialized (a TMA producer warp feeding a ring of shared-memory stages, consumer
// warpgroups on wgmma), persistent, with thread-block clusters whose CTAs share operand tiles
// through TMA multicast. KF_CONFIGS lists the instantiations; ops/fp8_cutlass.py picks one per
// (M bucket, N, K) from a measured table.
//
// C API (ctypes; ops/fp8_cutlass.py). Pointers are device pointers; N and K must be multiples of 16
// (16-byte TMA rows of FP8 operands), M is any (TMA zero-fills and clips the rows past it):
//   kf_abi()                                   -> KF_ABI
//   kf_num_configs(); kf_config_name(i)        -> the instantiations, e.g. "pp_128x128x128_c2x1"
//   kf_workspace(cfg, m, n, k, sm_count)       -> bytes of device workspace a launch needs
//   kf_run(cfg, a, w, d, a_scale, w_scale, bias, m, n, k, sm_count, workspace, stream)
//                                              -> cutlass::Status (0 = ok); capturable: no host
//                                                 synchronization, no allocation
// Build: as ops/cutlass/sm90_grouped.cu (compiler/cutlass_build.py).
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#define KF_ABI 1

using namespace cute;
namespace fus = cutlass::epilogue::fusion;

using Fp8 = cutlass::float_e4m3_t;
using Out = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 16;  // elements: 16-byte rows
constexpr int kAlignD = 8;

template <class Tile, class Cluster, class MainSched, class EpiSched, class TileSched>
struct Fp8Gemm {
  // D = a_scale[m] * (w_scale[n] * acc) + bias[n]
  using ScaleW = fus::Sm90RowBroadcast<0, Tile, float, float, Stride<_0, _1, _0>>;
  using ScaleA = fus::Sm90ColBroadcast<0, Tile, float, float, Stride<_1, _0, _0>>;
  using Bias = fus::Sm90RowBroadcast<0, Tile, float, float, Stride<_0, _1, _0>>;
  using MulW = fus::Sm90Compute<cutlass::multiplies, float, float, cutlass::FloatRoundStyle::round_to_nearest>;
  using ScaledW = fus::Sm90EVT<MulW, ScaleW, fus::Sm90AccFetch>;
  using Fma = fus::Sm90Compute<cutlass::homogeneous_multiply_add, Out, float,
                               cutlass::FloatRoundStyle::round_to_nearest>;
  using Tree = fus::Sm90EVT<Fma, ScaleA, ScaledW, Bias>;

  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignD, Out, LayoutD,
      kAlignD, EpiSched, Tree>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8, LayoutA, kAlignAB, Fp8, LayoutB, kAlignAB,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      MainSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, TileSched>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments args(const void* a, const void* w, void* d, const float* sa, const float* sw,
                                       const float* bias, int m, int n, int k, int sm_count) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SD = typename Kernel::StrideD;
    auto sa_ = cutlass::make_cute_packed_stride(SA{}, {m, k, 1});
    auto sb_ = cutlass::make_cute_packed_stride(SB{}, {n, k, 1});
    auto sd_ = cutlass::make_cute_packed_stride(SD{}, {m, n, 1});
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = sm_count;
    typename Gemm::Arguments out{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const Fp8*>(a), sa_, static_cast<const Fp8*>(w), sb_},
        {{}, nullptr, sd_, static_cast<Out*>(d), sd_},
        hw};
    // tree arguments: {ScaleA, {ScaleW, Acc, MulW}, Bias, Fma}
    out.epilogue.thread = {{sa}, {{sw}, {}, {}}, {bias}, {}};
    return out;
  }
};

using namespace cutlass::gemm;
using EpiPP = cutlass::epilogue::TmaWarpSpecialized;
using EpiCo = cutlass::epilogue::TmaWarpSpecializedCooperative;
using PP = KernelTmaWarpSpecializedPingpongFP8FastAccum;
using Co = KernelTmaWarpSpecializedCooperativeFP8FastAccum;

// name, tile M N K, cluster M N, mainloop schedule, epilogue schedule, tile scheduler
// The instantiations ops/fp8_cutlass.py's tables use (measured on the H200,
// bench/results/2026-11-29_h200_fp8_cutlass_sweep.json); -DKF_SWEEP adds the ones that won nowhere.
#ifdef KF_SWEEP
#define KF_SWEEP_CONFIGS(X)                                                     \
  X("pp_64x96x128_c2x1", 64, 96, 128, 2, 1, PP, EpiPP, void)                    \
  X("pp_64x192x128_c1x1", 64, 192, 128, 1, 1, PP, EpiPP, void)                  \
  X("co_128x128x128_c2x1", 128, 128, 128, 2, 1, Co, EpiCo, void)                \
  X("co_128x128x128_c1x1_sk", 128, 128, 128, 1, 1, Co, EpiCo, StreamKScheduler)
#else
#define KF_SWEEP_CONFIGS(X)
#endif
#define KF_CONFIGS(X)                                                           \
  X("pp_64x64x128_c1x1", 64, 64, 128, 1, 1, PP, EpiPP, void)                    \
  X("pp_64x96x128_c1x1", 64, 96, 128, 1, 1, PP, EpiPP, void)                    \
  X("pp_64x128x128_c1x1", 64, 128, 128, 1, 1, PP, EpiPP, void)                  \
  X("pp_64x128x128_c2x1", 64, 128, 128, 2, 1, PP, EpiPP, void)                  \
  X("pp_64x256x128_c1x1", 64, 256, 128, 1, 1, PP, EpiPP, void)                  \
  X("pp_128x96x128_c1x1", 128, 96, 128, 1, 1, PP, EpiPP, void)                  \
  X("pp_128x128x128_c2x1", 128, 128, 128, 2, 1, PP, EpiPP, void)                \
  X("co_128x192x128_c2x1", 128, 192, 128, 2, 1, Co, EpiCo, void)                \
  X("co_128x256x128_c2x1", 128, 256, 128, 2, 1, Co, EpiCo, void)                \
  KF_SWEEP_CONFIGS(X)

#define KF_T(tm, tn, tk, cm, cn, ms, es, ts) \
  Fp8Gemm<Shape<Int<tm>, Int<tn>, Int<tk>>, Shape<Int<cm>, Int<cn>, _1>, ms, es, ts>

template <class C>
static long long workspace_of(int m, int n, int k, int sm_count) {
  auto args = C::args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, sm_count);
  return (long long)C::Gemm::get_workspace_size(args);
}

template <class C>
static int run_of(const void* a, const void* w, void* d, const float* a_scale, const float* w_scale,
                  const float* bias, int m, int n, int k, int sm_count, void* workspace, void* stream) {
  typename C::Gemm gemm;
  auto args = C::args(a, w, d, a_scale, w_scale, bias, m, n, k, sm_count);
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) return int(st);
  return int(gemm.run(args, workspace, reinterpret_cast<cudaStream_t>(stream)));
}

#define KF_NAME(name, ...) name,
#define KF_WS(name, ...) &workspace_of<KF_T(__VA_ARGS__)>,
#define KF_RUN(name, ...) &run_of<KF_T(__VA_ARGS__)>,
static const char* kNames[] = {KF_CONFIGS(KF_NAME)};
static long long (*const kWorkspace[])(int, int, int, int) = {KF_CONFIGS(KF_WS)};
static int (*const kRun[])(const void*, const void*, void*, const float*, const float*, const float*, int, int,
                           int, int, void*, void*) = {KF_CONFIGS(KF_RUN)};
constexpr int kNumConfigs = sizeof(kNames) / sizeof(kNames[0]);

extern "C" {

int kf_abi() { return KF_ABI; }
int kf_num_configs() { return kNumConfigs; }
const char* kf_config_name(int i) { return (i >= 0 && i < kNumConfigs) ? kNames[i] : nullptr; }

long long kf_workspace(int cfg, int m, int n, int k, int sm_count) {
  return (cfg >= 0 && cfg < kNumConfigs) ? kWorkspace[cfg](m, n, k, sm_count) : -1;
}

int kf_run(int cfg, const void* a, const void* w, void* d, const float* a_scale, const float* w_scale,
           const float* bias, int m, int n, int k, int sm_count, void* workspace, void* stream) {
  if (cfg < 0 || cfg >= kNumConfigs) return -1;
  return kRun[cfg](a, w, d, a_scale, w_scale, bias, m, n, k, sm_count, workspace, stream);
}
}
