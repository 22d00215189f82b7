// A persistent, warp-specialized decode "megakernel" probe at Qwen3-30B-A3B batch-1 shapes
// (bench/gpu/mk_probe.py builds, checks and times it; docs/decode_budget.md says why).
//
// One launch runs L MoE decoder layers for one token. One CTA per SM (132 on the H200), 9 warps:
//  * warp 0, the producer: walks this CTA's instruction list and streams every weight chunk it
//    names (and the attention tasks' K/V tiles) into a ring of NS 33 KB shared-memory slots with
//    1D bulk copies (cp.async.bulk, completion on an mbarrier). It never waits for activations,
//    only for free slots and, before expert weights, for the layer's top-k (the expert ids);
//    one bulk copy per weight row, each row padded by PAD bytes in the slot (conflict-free
//    tensor-core fragments);
//  * warps 1-8, the consumers: walk the same list; per instruction they wait for its input
//    (a global arrival counter), load the input vector into shared memory, consume the
//    instruction's chunks from the ring, write the outputs, and bump the instruction's counter.
// So the weight stream keeps going while the consumers wait on the layer's small dependent
// stages; that is the point being measured.
//
// A layer (no norms' weights, no RoPE, contiguous KV: the probe measures the engine):
//   qkv = bf16(Wqkv x)                                  [5120]     640 chunks of 8 rows
//   split attention over 544 cached keys + the new one, 4 KV heads x 17 splits of 32 keys (GQA 8)
//   merge -> attn bf16 [4096]
//   h = bf16(x + bf16(Wo attn))                         [2048]     512 chunks of 4 rows
//   hn = bf16(h * rsqrt(mean(h^2) + eps)); logits = Wr hn [128]    16 chunks of 8 rows
//   top-8 of softmax(logits), renormalized (ties: lower index)
//   act_j = bf16(bf16(silu(bf16(W13[e_j, :I] hn))) * bf16(W13[e_j, I:] hn))   1536 chunks
//   x' = bf16(h + bf16(sum_j tw_j * bf16(W2[e_j] act_j)))                      128 x 8 chunks
// Every wait has a watchdog (TIMEOUT_NS): on expiry it prints where and traps. Results and what
// they mean: bench/results/2026-12-01_h200_s11c_mk_probe.json, docs/decode_budget.md.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

namespace {

constexpr int H = 2048, QKV = 5120, NQ = 32, NKV = 4, D = 128, E = 128, TOPK = 8, I = 768;
constexpr int CTX = 544;  // cached keys; the new key comes from the qkv row
constexpr int SPLIT = 32, NSPLIT = 17, NATT = NKV * NSPLIT;
constexpr int PAD = 64;  // bytes after each weight row in a slot: conflict-free B fragments
constexpr int NS = 6, SLOT = 8 * (2 * H + PAD), NCONS = 8, NTHREADS = 32 * (NCONS + 1);
constexpr int XS_FLOATS = TOPK * I;  // the largest input vector (w2's activations)
constexpr int ACC = 128;
constexpr int SMEM = NS * SLOT + XS_FLOATS * 4 + (NCONS + 1) * ACC * 4 + 64 + 2 * NS * 8;
constexpr unsigned long long TIMEOUT_NS = 2000000000ull;

enum Op { QKV_OP = 0, ATTN = 1, MERGE = 2, O_OP = 3, ROUTER = 4, TOPK_OP = 5, W13 = 6, W2_OP = 7 };
enum Ctr { C_QKV, C_SPLIT, C_MERGE, C_O, C_ROUTER, C_TOPK, C_W13, C_W2, NCTR };

struct LayerW {  // one layer's weights and KV cache (bf16, row-major)
  const __nv_bfloat16 *wqkv, *wo, *wr, *w13, *w2, *kc, *vc;  // kc, vc: [NKV, CTX, D]
};

struct Bufs {  // per-layer activations ([L] leading dimension each; x has L + 1 rows)
  __nv_bfloat16 *x, *qkv, *att, *h, *act;
  float *logits, *tw, *po, *pml;
  int *ids, *cnt;
  unsigned long long* trace;  // [grid, max_instr, 3] globaltimer ns: wait start, input ready, done
  unsigned long long* ctrace;  // [4, CT_MAX] for CTA CT_CTA: chunk issued, seen full, consumed; clock64 at seen full
  int tracing;                 // 0: no timestamps at all
};
constexpr int CT_CTA = 1, CT_MAX = 4096;

struct Instr {  // 8 int32: what a CTA does next (mk_probe.py builds the lists)
  int op, layer, c0, nc, task, wait, target, signal;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __noinline__ void watchdog(const char* what, int a, int b) {
  printf("mk_probe watchdog: CTA %d warp %d stuck in %s (%d, %d)\n", blockIdx.x, threadIdx.x / 32, what, a, b);
  __trap();
}

__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ bool bar_try(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}

__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity, const char* what, int a) {
  if (bar_try(bar, parity)) return;
  unsigned long long t0 = now_ns();
  while (!bar_try(bar, parity))
    if (now_ns() - t0 > TIMEOUT_NS) watchdog(what, a, parity);
}

__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void wait_counter(const int* cnt, int idx, int target, const char* what) {
  if (idx < 0) return;
  const int* p = cnt + idx;
  if (ld_acquire(p) >= target) return;
  unsigned long long t0 = now_ns();
  while (ld_acquire(p) < target)
    if (now_ns() - t0 > TIMEOUT_NS) watchdog(what, idx, target);
}

__device__ __forceinline__ void cons_sync() { asm volatile("bar.sync 1, %0;" ::"n"(32 * NCONS) : "memory"); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float rbf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  // A rows 8-15 (a1, a3) never reach D's row 0, the only row read: pass a0 / a2 again
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a0), "r"(a2), "r"(a2), "r"(b0), "r"(b1));
}

// Tensor-core GEMV of up to 8 slot rows (row n at slot + n * rs bytes) over the warp's k range
// [k0, k0 + 32 * STEPS) against x (bf16, shared): D = A B with A's row 0 = x and B's column n =
// row n. Each lane loads 16 bytes of its row (n = lane / 4) and 16 bytes of x per step, which feed
// two m16n8k16 products (k permuted alike in A and B; the sum does not care). Only D's row 0 and
// its first ROWS columns are read, so no lane zeroes anything (columns past ROWS repeat rows). NCH independent accumulator chains: one chain of dependent mma.sync is what
// limited the consumers before. Lanes 0-3 end with the dots of rows 2 * lane, 2 * lane + 1 in
// d[0], d[1].
template <int STEPS, int ROWS = 8>
__device__ __forceinline__ void mma_rows(float (&d)[4], const uint8_t* slot, int rs, const __nv_bfloat16* x, int k0,
                                         int lane) {
  constexpr int NCH = 4;
  const int n = (lane >> 2) & (ROWS - 1), tig = lane & 3;  // ROWS < 8: columns past it repeat rows
  const uint8_t* wrow = slot + n * rs;
  float c[NCH][4] = {};
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    const int k = k0 + 32 * st + tig * 8;
    const uint4 w = *reinterpret_cast<const uint4*>(wrow + 2 * k);
    const uint4 xv = *reinterpret_cast<const uint4*>(x + k);
    mma_bf16(c[(2 * st) % NCH], xv.x, xv.y, w.x, w.y);
    mma_bf16(c[(2 * st + 1) % NCH], xv.z, xv.w, w.z, w.w);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    d[h] = 0.f;
#pragma unroll
    for (int q = 0; q < NCH; ++q) d[h] += c[q][h];
  }
}

// a warp's partial dots into its own row of acc (plain stores: a float atomicAdd to shared memory
// is a compare-and-swap loop, and eight warps on the same words serialized it)
__device__ __forceinline__ void acc_rows(float* acc, const float (&d)[4], int nrows, int lane) {
  if (lane < 4) {
    if (2 * lane < nrows) acc[2 * lane] = d[0];
    if (2 * lane + 1 < nrows) acc[2 * lane + 1] = d[1];
  }
}

__device__ __forceinline__ float acc_sum(const float* acc, int i) {  // the consumer warps' partials
  float v = 0.f;
#pragma unroll
  for (int w = 0; w < NCONS; ++w) v += acc[w * ACC + i];
  return v;
}

struct Chunk {  // up to two groups of rows for one slot, a bulk copy per row
  const uint8_t *src0, *src1;  // first row of each group
  int rows0, rows1;            // rows per group (0: none)
  uint32_t row_bytes;          // bytes per row
  int gstride, sstride;        // bytes between rows in global memory / in the slot
  int off1;                    // slot offset of group 1
};

__device__ __forceinline__ int att_keys(int task) {  // cached keys of an attention split
  const int s = task % NSPLIT;
  return min(SPLIT, CTX - s * SPLIT);
}

__device__ Chunk chunk_of(const Instr& in, int c, const LayerW& w, const int* ids) {
  Chunk k{nullptr, nullptr, 0, 0, 0, 0, 0, 0};
  const int q = in.c0 + c;
  const auto u8 = [](const __nv_bfloat16* p) { return reinterpret_cast<const uint8_t*>(p); };
  switch (in.op) {
    case QKV_OP:
    case ROUTER:
      k.src0 = u8((in.op == QKV_OP ? w.wqkv : w.wr) + (size_t)q * 8 * H);
      k.rows0 = 8; k.row_bytes = 2 * H; k.gstride = 2 * H; k.sstride = 2 * H + PAD;
      break;
    case O_OP:
      k.src0 = u8(w.wo + (size_t)q * 4 * (NQ * D));
      k.rows0 = 4; k.row_bytes = 2 * NQ * D; k.gstride = 2 * NQ * D; k.sstride = 2 * NQ * D + PAD;
      break;
    case ATTN: {  // K then V tile, each one copy, unpadded
      const int g = in.task / NSPLIT, s = in.task % NSPLIT, n = att_keys(in.task);
      const size_t base = ((size_t)g * CTX + s * SPLIT) * D;
      k.src0 = u8(w.kc + base); k.src1 = u8(w.vc + base);
      k.rows0 = k.rows1 = 1; k.row_bytes = n * D * 2; k.off1 = SLOT / 2;
      break;
    }
    case W13: {  // slot rows 0-3: gate rows i0.., rows 4-7: the up rows
      const int j = q / (I / 4), i0 = (q % (I / 4)) * 4;
      const __nv_bfloat16* ex = w.w13 + (size_t)ids[j] * (2 * I) * H;
      k.src0 = u8(ex + (size_t)i0 * H); k.src1 = u8(ex + (size_t)(I + i0) * H);
      k.rows0 = k.rows1 = 4; k.row_bytes = 2 * H; k.gstride = 2 * H; k.sstride = 2 * H + PAD;
      k.off1 = 4 * k.sstride;
      break;
    }
    case W2_OP: {  // chunk c = expert slot j; task = the 16-row output group
      const __nv_bfloat16* ex = w.w2 + (size_t)ids[c] * H * I;
      k.src0 = u8(ex + (size_t)in.task * 16 * I);
      k.rows0 = 16; k.row_bytes = 2 * I; k.gstride = 2 * I; k.sstride = 2 * I + PAD;
      break;
    }
    default: break;
  }
  return k;
}

__device__ __forceinline__ int chunks_of(const Instr& in) {
  return (in.op == MERGE || in.op == TOPK_OP) ? 0 : in.nc;
}

template <bool PREFETCH>
__device__ void producer(const Instr* list, int n, const LayerW* layers, const Bufs& b, uint8_t* ring,
                         uint64_t* full, uint64_t* empty) {
  uint32_t seq = 0;
  __shared__ int ids_s[TOPK];
  int ids_layer = -1;
  for (int i = 0; i < n; ++i) {
    const Instr in = list[i];
    const int nch = chunks_of(in);
    if (nch == 0) continue;
    if (!PREFETCH) wait_counter(b.cnt, in.wait, in.target, "producer input (no prefetch)");
    if ((in.op == W13 || in.op == W2_OP) && ids_layer != in.layer) {  // expert ids: wait for the top-k
      wait_counter(b.cnt, in.layer * NCTR + C_TOPK, 1, "producer top-k");
      for (int j = 0; j < TOPK; ++j) ids_s[j] = __ldcg(b.ids + in.layer * TOPK + j);
      ids_layer = in.layer;
    }
    const LayerW w = layers[in.layer];
    for (int c = 0; c < nch; ++c, ++seq) {
      const int slot = seq % NS;
      bar_wait(&empty[slot], ((seq / NS) & 1) ^ 1, "producer empty slot", slot);
      const Chunk k = chunk_of(in, c, w, ids_s);
      uint8_t* dst = ring + slot * SLOT;
      if (b.tracing && blockIdx.x == CT_CTA && seq < CT_MAX) b.ctrace[seq] = now_ns();
      bar_expect(&full[slot], k.row_bytes * (k.rows0 + k.rows1));
      for (int r = 0; r < k.rows0; ++r)
        bulk_load(dst + r * k.sstride, k.src0 + (size_t)r * k.gstride, k.row_bytes, &full[slot]);
      for (int r = 0; r < k.rows1; ++r)
        bulk_load(dst + k.off1 + r * k.sstride, k.src1 + (size_t)r * k.gstride, k.row_bytes, &full[slot]);
    }
  }
}

// consumers' per-instruction input, raw bf16 in xs (16-byte copies); normalized where the op
// wants hn (the sum of squares in float32, hn rounded to bf16)
__device__ void load_input(const Instr& in, const Bufs& b, float* xs, float* aux, float* red, int t) {
  const int L = in.layer;
  uint4* xv = reinterpret_cast<uint4*>(xs);
  constexpr int V = 8, NT = 32 * NCONS;  // bf16 per uint4; consumer threads
  switch (in.op) {
    case QKV_OP:
      for (int e = t; e < H / V; e += NT) xv[e] = __ldcg(reinterpret_cast<const uint4*>(b.x + (size_t)L * H) + e);
      break;
    case O_OP:
      for (int e = t; e < NQ * D / V; e += NT)
        xv[e] = __ldcg(reinterpret_cast<const uint4*>(b.att + (size_t)L * NQ * D) + e);
      if (t < in.nc * 4) aux[t] = __bfloat162float(__ldcg(b.x + (size_t)L * H + in.c0 * 4 + t));
      break;
    case ROUTER:
    case W13: {  // H / V == NT: one uint4 per thread
      uint4 v = __ldcg(reinterpret_cast<const uint4*>(b.h + (size_t)L * H) + t);
      __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
      float f[8], ss = 0.f;
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const float2 a = __bfloat1622float2(p[h]);
        f[2 * h] = a.x; f[2 * h + 1] = a.y;
        ss += a.x * a.x + a.y * a.y;
      }
      ss = warp_sum(ss);
      if ((t & 31) == 0) red[t / 32] = ss;
      cons_sync();
      float tot = 0.f;
#pragma unroll
      for (int wi = 0; wi < NCONS; ++wi) tot += red[wi];
      const float r = rsqrtf(tot / H + 1e-6f);
#pragma unroll
      for (int h = 0; h < 4; ++h) p[h] = __floats2bfloat162_rn(f[2 * h] * r, f[2 * h + 1] * r);
      xv[t] = v;
      break;
    }
    case W2_OP:
      for (int e = t; e < TOPK * I / V; e += NT)
        xv[e] = __ldcg(reinterpret_cast<const uint4*>(b.act + (size_t)L * TOPK * I) + e);
      if (t < TOPK) aux[t] = __ldcg(b.tw + L * TOPK + t);
      if (t >= 32 && t < 48) aux[TOPK + t - 32] = __bfloat162float(__ldcg(b.h + (size_t)L * H + in.task * 16 + t - 32));
      break;
    case ATTN: {  // q of the group's 8 heads [8, D], then the new k and v rows
      const int g = in.task / NSPLIT;
      const uint4* row = reinterpret_cast<const uint4*>(b.qkv + (size_t)L * QKV);
      if (t < 8 * D / V) xv[t] = __ldcg(row + (g * 8 * D) / V + t);
      if (t < D / V && in.task % NSPLIT == NSPLIT - 1) {  // the split that holds the new key
        xv[8 * D / V + t] = __ldcg(row + (NQ * D + g * D) / V + t);
        xv[9 * D / V + t] = __ldcg(row + (NQ * D + NKV * D + g * D) / V + t);
      }
      break;
    }
    default: break;
  }
}

// one attention split (kv head g, keys of split s): warp w is q head g * 8 + w; lane n scores keys
// n and n + 32, reading their rows in 16-byte chunks rotated by lane (no shared-memory bank
// conflicts between the lanes' rows, 256 bytes apart)
__device__ __forceinline__ float dot_row_rot(const __nv_bfloat16* k, const __nv_bfloat16* q, int lane) {
  float s = 0.f, u = 0.f;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int c = ((i + lane) & (D / 8 - 1)) * 8;
    const uint4 kv = *reinterpret_cast<const uint4*>(k + c);
    const uint4 qv = *reinterpret_cast<const uint4*>(q + c);
    const __nv_bfloat162* kp = reinterpret_cast<const __nv_bfloat162*>(&kv);
    const __nv_bfloat162* qp = reinterpret_cast<const __nv_bfloat162*>(&qv);
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const float2 a = __bfloat1622float2(kp[h]), b = __bfloat1622float2(qp[h]);
      s = fmaf(a.x, b.x, s);
      u = fmaf(a.y, b.y, u);
    }
  }
  return s + u;
}

__device__ void attn_split(const Instr& in, const Bufs& b, const uint8_t* slot, const float* xs, int warp, int lane) {
  const int nc = att_keys(in.task);
  const bool last = in.task % NSPLIT == NSPLIT - 1;
  const int nk = nc + (last ? 1 : 0);
  const __nv_bfloat16* kt = reinterpret_cast<const __nv_bfloat16*>(slot);
  const __nv_bfloat16* vt = reinterpret_cast<const __nv_bfloat16*>(slot + SLOT / 2);
  const __nv_bfloat16* qb = reinterpret_cast<const __nv_bfloat16*>(xs);
  const __nv_bfloat16* q = qb + warp * D;
  const float scale = rsqrtf((float)D);
  float s[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int n = lane + 32 * r;
    s[r] = n < nk ? dot_row_rot(n < nc ? kt + n * D : qb + 8 * D, q, lane) * scale : -INFINITY;
  }
  const float m = warp_max(fmaxf(s[0], s[1]));
  const float p0 = s[0] == -INFINITY ? 0.f : __expf(s[0] - m);
  const float p1 = s[1] == -INFINITY ? 0.f : __expf(s[1] - m);
  const float l = warp_sum(p0 + p1);
  float o[4] = {0.f, 0.f, 0.f, 0.f};
  for (int n = 0; n < nk; ++n) {
    const float p = __shfl_sync(0xffffffffu, n < 32 ? p0 : p1, n & 31);
    const __nv_bfloat16* vr = n < nc ? vt + n * D : qb + 9 * D;
    const uint2 vv = *reinterpret_cast<const uint2*>(vr + lane * 4);
    const __nv_bfloat162* pv = reinterpret_cast<const __nv_bfloat162*>(&vv);
    const float2 a = __bfloat1622float2(pv[0]), c = __bfloat1622float2(pv[1]);
    o[0] = fmaf(p, a.x, o[0]); o[1] = fmaf(p, a.y, o[1]); o[2] = fmaf(p, c.x, o[2]); o[3] = fmaf(p, c.y, o[3]);
  }
  const size_t base = ((size_t)in.layer * NATT + in.task) * 8 + warp;
  *reinterpret_cast<float4*>(b.po + base * D + lane * 4) = make_float4(o[0], o[1], o[2], o[3]);
  if (lane == 0) {
    b.pml[base * 2] = m;
    b.pml[base * 2 + 1] = l;
  }
}

__device__ void attn_merge(const Instr& in, const Bufs& b, int t) {
  const int g = in.task, hw = t / 32, lane = t & 31;  // head g * 8 + hw, dims lane * 4 ..
  float2 ml[NSPLIT];
  float4 pv[NSPLIT];
  float mx = -INFINITY;
#pragma unroll
  for (int s = 0; s < NSPLIT; ++s) {  // every load first: one round trip
    const size_t base = ((size_t)in.layer * NATT + g * NSPLIT + s) * 8 + hw;
    ml[s] = __ldcg(reinterpret_cast<const float2*>(b.pml) + base);
    pv[s] = __ldcg(reinterpret_cast<const float4*>(b.po + base * D + lane * 4));
  }
#pragma unroll
  for (int s = 0; s < NSPLIT; ++s) mx = fmaxf(mx, ml[s].x);
  float o[4] = {0.f, 0.f, 0.f, 0.f}, l = 0.f;
#pragma unroll
  for (int s = 0; s < NSPLIT; ++s) {
    const float f = __expf(ml[s].x - mx);
    l += f * ml[s].y;
    o[0] += f * pv[s].x; o[1] += f * pv[s].y; o[2] += f * pv[s].z; o[3] += f * pv[s].w;
  }
  __nv_bfloat16* dst = b.att + (size_t)in.layer * NQ * D + (g * 8 + hw) * D + lane * 4;
#pragma unroll
  for (int u = 0; u < 4; ++u) dst[u] = __float2bfloat16_rn(o[u] / l);
}

__device__ void topk(const Instr& in, const Bufs& b, int lane) {  // one warp
  const float* lg = b.logits + in.layer * E;
  float p[4], mx = -INFINITY;
#pragma unroll
  for (int u = 0; u < 4; ++u) { p[u] = __ldcg(lg + lane * 4 + u); mx = fmaxf(mx, p[u]); }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) { p[u] = __expf(p[u] - mx); sum += p[u]; }
  sum = warp_sum(sum);
  float picked = 0.f, vals[TOPK];
  int idx[TOPK];
#pragma unroll
  for (int j = 0; j < TOPK; ++j) {
    float bv = -1.f;
    int bi = 1 << 30;
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (p[u] > bv) { bv = p[u]; bi = lane * 4 + u; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    vals[j] = bv / sum;
    idx[j] = bi;
    picked += vals[j];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (bi == lane * 4 + u) p[u] = -2.f;  // taken
  }
  if (lane < TOPK) {
    float v = vals[0];
    int e = idx[0];
#pragma unroll
    for (int j = 1; j < TOPK; ++j) if (lane == j) { v = vals[j]; e = idx[j]; }
    b.tw[in.layer * TOPK + lane] = v / picked;
    b.ids[in.layer * TOPK + lane] = e;
  }
}

template <bool PREFETCH>
__global__ void __launch_bounds__(NTHREADS, 1)
    mk_kernel(const LayerW* __restrict__ layers, Bufs b, const Instr* __restrict__ lists, int max_instr) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* ring = smem;
  float* xs = reinterpret_cast<float*>(smem + NS * SLOT);
  float* acc = xs + XS_FLOATS;  // [NCONS, ACC]: each consumer warp's partial dots (no atomics)
  float* aux = acc + NCONS * ACC;  // per instruction: tw (w2), the residual rows (o, w2)
  float* red = aux + ACC;
  uint64_t* full = reinterpret_cast<uint64_t*>(red + 16);
  uint64_t* empty = full + NS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) { bar_init(&full[s], 1); bar_init(&empty[s], NCONS); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const Instr* list = lists + (size_t)blockIdx.x * max_instr;
  int n = 0;
  while (n < max_instr && list[n].op >= 0) ++n;
  if (warp == 0) {
    if (lane == 0) producer<PREFETCH>(list, n, layers, b, ring, full, empty);
    return;
  }
  const int t = threadIdx.x - 32, cw = warp - 1;  // consumer thread / warp index
  uint32_t seq = 0;
  for (int i = 0; i < n; ++i) {
    const Instr in = list[i];
    unsigned long long* tr = b.trace + ((size_t)blockIdx.x * max_instr + i) * 3;
    if (t == 0) {
      if (b.tracing) tr[0] = now_ns();
      wait_counter(b.cnt, in.wait, in.target, "consumer input");
      __threadfence();
      if (b.tracing) tr[1] = now_ns();
    }
    cons_sync();
    load_input(in, b, xs, aux, red, t);
    cons_sync();
    const int L = in.layer;
    const int nch = chunks_of(in);
    const __nv_bfloat16* xb = reinterpret_cast<const __nv_bfloat16*>(xs);
    for (int c = 0; c < nch; ++c, ++seq) {
      const int slot = seq % NS;
      bar_wait(&full[slot], (seq / NS) & 1, "consumer full slot", slot);
      const bool ct = b.tracing && blockIdx.x == CT_CTA && cw == 0 && lane == 0 && seq < CT_MAX;
      if (ct) {
        b.ctrace[CT_MAX + seq] = now_ns();
        b.ctrace[3 * CT_MAX + seq] = clock64();
      }
      const uint8_t* sl = ring + slot * SLOT;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      switch (in.op) {  // warp cw takes the k range [cw * K / 8, (cw + 1) * K / 8) of every row
        case QKV_OP:
        case ROUTER:
        case W13:  // 8 rows of H (W13: gate rows, then up rows)
          mma_rows<H / 8 / 32>(d, sl, 2 * H + PAD, xb, cw * (H / 8), lane);
          acc_rows(acc + cw * ACC + c * 8, d, 8, lane);
          break;
        case O_OP:  // 4 rows of NQ * D
          mma_rows<NQ * D / 8 / 32, 4>(d, sl, 2 * NQ * D + PAD, xb, cw * (NQ * D / 8), lane);
          acc_rows(acc + cw * ACC + c * 4, d, 4, lane);
          break;
        case W2_OP: {  // 16 rows of I for expert slot c: two tiles of 8 rows
          float e[4] = {0.f, 0.f, 0.f, 0.f};
          mma_rows<I / 8 / 32>(d, sl, 2 * I + PAD, xb + c * I, cw * (I / 8), lane);
          mma_rows<I / 8 / 32>(e, sl + 8 * (2 * I + PAD), 2 * I + PAD, xb + c * I, cw * (I / 8), lane);
          acc_rows(acc + cw * ACC + c * 16, d, 8, lane);
          acc_rows(acc + cw * ACC + c * 16 + 8, e, 8, lane);
          break;
        }
        case ATTN:
          attn_split(in, b, ring + slot * SLOT, xs, cw, lane);
          break;
        default: break;
      }
      __syncwarp();
      if (lane == 0) bar_arrive(&empty[slot]);
      if (ct) b.ctrace[2 * CT_MAX + seq] = now_ns();
    }
    cons_sync();
    switch (in.op) {  // epilogues: acc holds each row's full dot
      case QKV_OP:
        for (int r = t; r < in.nc * 8; r += 32 * NCONS) b.qkv[(size_t)L * QKV + in.c0 * 8 + r] = __float2bfloat16_rn(acc_sum(acc, r));
        break;
      case ROUTER:
        if (t < 8) b.logits[L * E + in.c0 * 8 + t] = acc_sum(acc, t);
        break;
      case O_OP:
        for (int r = t; r < in.nc * 4; r += 32 * NCONS) {
          b.h[(size_t)L * H + in.c0 * 4 + r] = __float2bfloat16_rn(aux[r] + rbf(acc_sum(acc, r)));
        }
        break;
      case W13:
        for (int p = t; p < in.nc * 4; p += 32 * NCONS) {
          const int pair = in.c0 * 4 + p, j = pair / I, i = pair % I;
          const float g = rbf(acc_sum(acc, (p / 4) * 8 + p % 4)), u = rbf(acc_sum(acc, (p / 4) * 8 + 4 + p % 4));
          b.act[((size_t)L * TOPK + j) * I + i] = __float2bfloat16_rn(rbf(g / (1.f + __expf(-g))) * u);
        }
        break;
      case W2_OP:
        if (t < 16) {
          float y = 0.f;
#pragma unroll
          for (int j = 0; j < TOPK; ++j) y += aux[j] * rbf(acc_sum(acc, j * 16 + t));
          b.x[(size_t)(L + 1) * H + in.task * 16 + t] = __float2bfloat16_rn(aux[TOPK + t] + rbf(y));
        }
        break;
      case MERGE:
        attn_merge(in, b, t);
        break;
      case TOPK_OP:
        if (cw == 0) topk(in, b, lane);
        break;
      default: break;
    }
    cons_sync();
    if (t == 0 && in.signal >= 0) {
      __threadfence();
      atomicAdd(b.cnt + in.signal, 1);
      if (b.tracing) tr[2] = now_ns();
    }
  }
}

}  // namespace

extern "C" int mk_smem_bytes() { return SMEM; }

extern "C" const char* mk_error(int e) { return cudaGetErrorString(static_cast<cudaError_t>(e)); }

// layers: device array of LayerW; b: host struct of device pointers; lists: [grid, max_instr] Instr
extern "C" int mk_launch(const void* layers, const void* bufs, const void* lists, int max_instr, int grid,
                         int prefetch, void* stream) {
  Bufs b = *static_cast<const Bufs*>(bufs);
  auto kern = prefetch ? mk_kernel<true> : mk_kernel<false>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  if (e != cudaSuccess) return e;
  const LayerW* l = static_cast<const LayerW*>(layers);
  const Instr* s = static_cast<const Instr*>(lists);
  void* args[] = {&l, &b, &s, &max_instr};
  e = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kern), dim3(grid), dim3(NTHREADS), args, SMEM,
                                  static_cast<cudaStream_t>(stream));
  return e;
}
