// kiln: CUTLASS 3.x grouped GEMM for the MoE expert GEMMs on sm90 (H100/H200): wgmma + TMA,
// ptr-array, persistent cooperative, 128 x KG_TILE_N x 64 tiles, bf16 in/out, f32 accumulate.
//
//   for every group g < G:  D_g [M_g, N] = A_g [M_g, K] (row-major) @ W_g [N, K]^T
//
// W_g row-major [N, K] is B column-major (K x N); A_g and D_g are contiguous row ranges
// (row stride K and N). Problem sizes (M_g, N, K) and the pointers A_g / W_g / D_g are read on
// the device only, from arrays the caller owns and refreshes between launches (host problem
// shapes = nullptr, as in CUTLASS's examples/57_hopper_grouped_gemm): one launch needs no host
// read of the routing and can sit in a CUDA graph. M_g may be 0 (no tiles for that group).
// The grid is sm_count persistent CTAs, whatever the sizes.
//
// C API (ctypes; ops/moe_cutlass.py), every array a device pointer that stays valid as long as
// the handle lives:
//   kg_abi()                                   -> KG_ABI (the loader refuses another version)
//   kg_create(device, G, N, K, shapes [G,3] i32, ptr_a [G] i64, ptr_b [G] i64, ptr_d [G] i64,
//             sm_count, stream, &status)       -> handle (status 0 = ok, > 0 cutlass::Status,
//                                                 < 0 -cudaError_t); not capturable (allocates,
//                                                 synchronizes the stream)
//   kg_run(handle, stream)                     -> cutlass::Status of one launch (capturable)
//   kg_destroy(handle); kg_smem_bytes(); kg_stages(); kg_tile_n()
// Build: nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -O3 -DNDEBUG -Xcompiler=-fPIC
//        -shared -I<cutlass>/include -I<cutlass>/tools/util/include (compiler/cutlass_build.py).
#include <cstring>
#include <vector>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#define KG_ABI 1
#ifndef KG_TILE_N
#define KG_TILE_N 128
#endif

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Elt = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlign = 8;  // elements: 16-byte TMA rows, so N and K must be multiples of 8
using TileShape = Shape<_128, Int<KG_TILE_N>, _64>;
using ClusterShape = Shape<_1, _1, _1>;

using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Elt, LayoutD*, kAlign, Elt, LayoutD*,
    kAlign, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
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
using StrideD = typename Kernel::InternalStrideC;

struct Handle {
  Gemm gemm;
  int device = 0;
  void* dev = nullptr;  // per-group strides, then the workspace: one allocation
};

static void use_device(int device) {
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess || cur != device) cudaSetDevice(device);
}

extern "C" {

int kg_abi() { return KG_ABI; }
int kg_smem_bytes() { return int(Kernel::SharedStorageSize); }
int kg_stages() { return int(Main::DispatchPolicy::Stages); }
int kg_tile_n() { return KG_TILE_N; }

void* kg_create(int device, int groups, int n, int k, void* shapes, void* ptr_a, void* ptr_b, void* ptr_d,
                int sm_count, void* stream, int* status) {
  use_device(device);
  auto* h = new Handle;
  h->device = device;
  // the same packed strides for every group (M does not enter a row-major stride)
  auto sa = cutlass::make_cute_packed_stride(StrideA{}, {1 << 30, k, 1});
  auto sb = cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1});
  auto sd = cutlass::make_cute_packed_stride(StrideD{}, {1 << 30, n, 1});
  size_t off_b = groups * sizeof(StrideA), off_d = off_b + groups * sizeof(StrideB);
  size_t sbytes = off_d + groups * sizeof(StrideD);
  std::vector<char> host(sbytes);
  for (int g = 0; g < groups; ++g) {
    memcpy(host.data() + g * sizeof(StrideA), &sa, sizeof(StrideA));
    memcpy(host.data() + off_b + g * sizeof(StrideB), &sb, sizeof(StrideB));
    memcpy(host.data() + off_d + g * sizeof(StrideD), &sd, sizeof(StrideD));
  }
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  decltype(typename Gemm::Arguments{}.epilogue.thread) fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;  // C = D is never read
  auto make_args = [&](char* strides) {
    auto* dsa = reinterpret_cast<StrideA*>(strides);
    auto* dsb = reinterpret_cast<StrideB*>(strides ? strides + off_b : nullptr);
    auto* dsd = reinterpret_cast<StrideD*>(strides ? strides + off_d : nullptr);
    auto** d = reinterpret_cast<Elt**>(ptr_d);
    return typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {groups, reinterpret_cast<Shape<int, int, int>*>(shapes), nullptr},
        {reinterpret_cast<Elt const**>(ptr_a), dsa, reinterpret_cast<Elt const**>(ptr_b), dsb},
        {fusion, const_cast<Elt const**>(d), dsd, d, dsd},
        hw};
  };
  size_t ws = Gemm::get_workspace_size(make_args(nullptr));
  size_t ws_off = (sbytes + 255) / 256 * 256;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMalloc(&h->dev, ws_off + ws);
  if (err == cudaSuccess) err = cudaMemcpyAsync(h->dev, host.data(), sbytes, cudaMemcpyHostToDevice, s);
  if (err != cudaSuccess) {
    *status = -int(err);
    return h;
  }
  auto args = make_args(static_cast<char*>(h->dev));
  cutlass::Status st = h->gemm.can_implement(args);
  if (st == cutlass::Status::kSuccess) st = h->gemm.initialize(args, static_cast<char*>(h->dev) + ws_off, s);
  err = cudaStreamSynchronize(s);  // the strides are copied from `host` before it goes away
  *status = err != cudaSuccess ? -int(err) : int(st);
  return h;
}

int kg_run(void* handle, void* stream) {
  auto* h = static_cast<Handle*>(handle);
  use_device(h->device);
  return int(h->gemm.run(reinterpret_cast<cudaStream_t>(stream)));
}

void kg_destroy(void* handle) {
  auto* h = static_cast<Handle*>(handle);
  if (h->dev) {
    use_device(h->device);
    cudaFree(h->dev);
  }
  delete h;
}
}
