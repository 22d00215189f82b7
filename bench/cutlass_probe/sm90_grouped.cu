// CUTLASS 3.x Hopper grouped GEMM (wgmma + TMA, ptr-array, persistent cooperative), bf16 in/out,
// f32 accumulate: D_g[M_g, N] = A_g[M_g, K] (row-major) x W_g[N, K]^T (W row-major = B column-major).
// Built from the headers in the nvidia-cutlass wheel (cutlass_library/source/include); the kernel
// follows examples/57_hopper_grouped_gemm with host problem shapes = nullptr, so problem sizes
// and pointers are read on the device only and the grid is sm_count persistent CTAs.
// C API for ctypes (all array arguments are device pointers that stay valid for the handle):
//   kg_create(groups, N, K, problem_shapes[G,3] i32, ptr_A[G], ptr_B[G], ptr_D[G], sm_count, stream)
//   kg_run(handle, stream): one launch, nothing else (capturable); kg_destroy(handle).
#include <cstdio>
#include <vector>
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Elt = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutC = cutlass::layout::RowMajor;
constexpr int kAlign = 8;
#ifndef KG_TILE_N
#define KG_TILE_N 128
#endif
using TileShape = Shape<_128, Int<KG_TILE_N>, _64>;
using ClusterShape = Shape<_1, _1, _1>;

using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    Elt, LayoutC*, kAlign, Elt, LayoutC*, kAlign,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<Elt, float>>::CollectiveOp;
using Main = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elt, LayoutA*, kAlign, Elt, LayoutB*, kAlign,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Main, Epi>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideC = typename Kernel::InternalStrideC;

struct Handle {
  Gemm gemm;
  void* dev = nullptr;  // strides + workspace, one allocation
};

extern "C" {

int kg_smem_bytes() { return int(Kernel::SharedStorageSize); }
int kg_params_bytes() { return int(sizeof(typename Kernel::Params)); }
int kg_stages() { return int(Main::DispatchPolicy::Stages); }

void* kg_create(int groups, int n, int k, void* problem_shapes, void* ptr_a, void* ptr_b, void* ptr_d,
                int sm_count, void* stream, int* status) {
  auto* h = new Handle;
  auto sa = cutlass::make_cute_packed_stride(StrideA{}, {1 << 30, k, 1});  // M unused by the stride
  auto sb = cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1});
  auto sc = cutlass::make_cute_packed_stride(StrideC{}, {1 << 30, n, 1});
  size_t sbytes = groups * (sizeof(StrideA) + sizeof(StrideB) + sizeof(StrideC));
  std::vector<char> host(sbytes);
  for (int g = 0; g < groups; ++g) {
    memcpy(host.data() + g * sizeof(StrideA), &sa, sizeof(StrideA));
    memcpy(host.data() + groups * sizeof(StrideA) + g * sizeof(StrideB), &sb, sizeof(StrideB));
    memcpy(host.data() + groups * (sizeof(StrideA) + sizeof(StrideB)) + g * sizeof(StrideC), &sc, sizeof(StrideC));
  }
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sm_count;
  decltype(typename Gemm::Arguments{}.epilogue.thread) fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  auto run_args = [&](char* strides) {
    auto* dsa = reinterpret_cast<StrideA*>(strides);
    auto* dsb = reinterpret_cast<StrideB*>(strides + groups * sizeof(StrideA));
    auto* dsc = reinterpret_cast<StrideC*>(strides + groups * (sizeof(StrideA) + sizeof(StrideB)));
    return typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {groups, reinterpret_cast<Shape<int, int, int>*>(problem_shapes), nullptr},
        {reinterpret_cast<Elt const**>(ptr_a), dsa, reinterpret_cast<Elt const**>(ptr_b), dsb},
        {fusion, reinterpret_cast<Elt const**>(ptr_d), dsc, reinterpret_cast<Elt**>(ptr_d), dsc},
        hw};
  };
  size_t ws = Gemm::get_workspace_size(run_args(nullptr));
  size_t ws_off = (sbytes + 255) / 256 * 256;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (cudaMalloc(&h->dev, ws_off + ws) != cudaSuccess ||
      cudaMemcpyAsync(h->dev, host.data(), sbytes, cudaMemcpyHostToDevice, s) != cudaSuccess) {
    *status = -1;
    return h;
  }
  auto args = run_args(static_cast<char*>(h->dev));
  cutlass::Status st = h->gemm.can_implement(args);
  if (st == cutlass::Status::kSuccess)
    st = h->gemm.initialize(args, static_cast<char*>(h->dev) + ws_off, s);
  cudaStreamSynchronize(s);
  *status = int(st);
  return h;
}

int kg_run(void* h, void* stream) {
  return int(static_cast<Handle*>(h)->gemm.run(reinterpret_cast<cudaStream_t>(stream)));
}

void kg_destroy(void* h) {
  auto* p = static_cast<Handle*>(h);
  cudaFree(p->dev);
  delete p;
}
}
