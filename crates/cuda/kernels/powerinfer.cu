// GPU kernels of powerinfer-rs: one decode token at a time, f32 activations, weights in their
// file type (F32, F16, Q4_0, Q4_1, Q8_0, ggml's block layouts). Quantized weights read their
// input as int8 blocks (quantize_q8), rounded exactly as the CPU's integer kernels round it,
// so the GPU and the CPU compute the same function. Compiled to PTX by
// scripts/gen_ptx.sh and committed as powerinfer.ptx; the Rust side loads the PTX through the
// driver, so users need no CUDA toolkit. Every kernel has a scalar CPU twin in src/twin.rs,
// and tests/gpu compares the two.
//
// No cuda_fp16.h: half to float goes through one PTX instruction, so the file compiles with
// nvcc alone (no CCCL headers).

typedef unsigned char u8;
typedef unsigned short u16;

enum : int { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 };
enum : int { ACT_SWIGLU = 0, ACT_REGLU = 1, ACT_DREGLU = 2, ACT_RELU = 3, ACT_GELU = 4 };

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u16 load_u16(const u8* p) {
    // block-quant rows are only 2-byte aligned (18-, 20- and 34-byte blocks)
    return *reinterpret_cast<const u16*>(p);
}

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

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v, float* red /* [32] shared */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // red may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nwarps ? red[lane] : 0.0f;
    return warp_sum(v);
}

__device__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nwarps ? red[lane] : -INFINITY;
    return warp_max(v);
}

// ---- int8 activation blocks -------------------------------------------------------------------
// The CPU's `BlockQ8Act` (40 bytes): d = max|x| / 127, s = d * sum(q), q = round(x / d) half
// away from zero. Quantized weights are dotted with these, as on the CPU: same rounding, integer
// products, then the same scale arithmetic.
struct Q8Act {
    float d, s;
    int qs[8];  // 32 int8, four per int (4-aligned: the block is 40 bytes)
};
static_assert(sizeof(Q8Act) == 40, "BlockQ8Act layout");

// One warp per block of 32 values; n_blocks blocks of x into out.
extern "C" __global__ void quantize_q8(const float* x, Q8Act* out, int n_blocks) {
    const int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= n_blocks) return;
    const int lane = threadIdx.x & 31;
    const float v = x[b * 32 + lane];
    const float d = warp_max(fabsf(v)) / 127.0f;  // IEEE division, as on the CPU (no fast math)
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = (int)fminf(fmaxf(roundf(v * id), -128.0f), 127.0f);  // Rust's saturating `as i8`
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    reinterpret_cast<signed char*>(out[b].qs)[lane] = (signed char)q;
    if (lane == 0) {
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

// 4 weight bytes at a 2-byte-aligned address as one int.
__device__ __forceinline__ int load_i32_a2(const u8* p) {
    return (int)load_u16(p) | ((int)load_u16(p + 2) << 16);
}

// ---- one row . x, computed by one warp; every lane gets the dot ----------------------------
// x: f32 input (float weights); xq: its int8 blocks (quantized weights).

template <int T>
__device__ float warp_dot(const u8* row, const float* x, const Q8Act* xq, int cols) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    if (T == T_F32) {
        const float* w = reinterpret_cast<const float*>(row);
        if ((cols & 3) == 0) {
            const float4* w4 = reinterpret_cast<const float4*>(w);
            const float4* x4 = reinterpret_cast<const float4*>(x);
            for (int i = lane; i < cols / 4; i += 32) {
                float4 a = w4[i], b = x4[i];
                acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        } else {
            for (int i = lane; i < cols; i += 32) acc += w[i] * x[i];
        }
    } else if (T == T_F16) {
        const u16* w = reinterpret_cast<const u16*>(row);
        if ((cols & 7) == 0) {
            // 16-byte loads: 8 halves per lane, 512 bytes per warp step
            const uint4* w8 = reinterpret_cast<const uint4*>(w);
            for (int i = lane; i < cols / 8; i += 32) {
                uint4 p = w8[i];
                const float4 xa = reinterpret_cast<const float4*>(x)[2 * i];
                const float4 xb = reinterpret_cast<const float4*>(x)[2 * i + 1];
                acc += h2f(p.x & 0xffff) * xa.x + h2f(p.x >> 16) * xa.y + h2f(p.y & 0xffff) * xa.z +
                       h2f(p.y >> 16) * xa.w + h2f(p.z & 0xffff) * xb.x + h2f(p.z >> 16) * xb.y +
                       h2f(p.w & 0xffff) * xb.z + h2f(p.w >> 16) * xb.w;
            }
        } else {
            for (int i = lane; i < cols; i += 32) acc += h2f(w[i]) * x[i];
        }
    } else {
        // block formats: 32 values per block; lane handles whole blocks lane, lane + 32, ...
        const int nb = cols / 32;
        const int bytes = T == T_Q4_0 ? 18 : T == T_Q4_1 ? 20 : 34;
        for (int b = lane; b < nb; b += 32) {
            const u8* blk = row + (size_t)b * bytes;
            const Q8Act& a = xq[b];
            const float d = h2f(load_u16(blk));
            int isum = 0;
            if (T == T_Q8_0) {
#pragma unroll
                for (int k = 0; k < 8; k++) isum = __dp4a(load_i32_a2(blk + 2 + 4 * k), a.qs[k], isum);
                acc += d * a.d * (float)isum;
            } else {
                // element i < 16 is the low nibble of qs[i], element i + 16 its high nibble
                const u8* qs = blk + (T == T_Q4_0 ? 2 : 4);
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const int w = load_i32_a2(qs + 4 * k);
                    isum = __dp4a(w & 0x0F0F0F0F, a.qs[k], isum);
                    isum = __dp4a((w >> 4) & 0x0F0F0F0F, a.qs[4 + k], isum);
                }
                if (T == T_Q4_0) {
                    // sum((q - 8) * a) = sum(q * a) - 8 * sum(a)
                    acc += d * (a.d * (float)isum) - 8.0f * d * a.s;
                } else {
                    acc += d * a.d * (float)isum + h2f(load_u16(blk + 2)) * a.s;
                }
            }
        }
    }
    return warp_sum(acc);
}

// Element `c` of a row (one thread per column in the down projection).
template <int T>
__device__ __forceinline__ float row_elem(const u8* row, int c) {
    if (T == T_F32) return reinterpret_cast<const float*>(row)[c];
    if (T == T_F16) return h2f(reinterpret_cast<const u16*>(row)[c]);
    const int b = c >> 5, i = c & 31;
    if (T == T_Q8_0) {
        const u8* blk = row + (size_t)b * 34;
        return h2f(load_u16(blk)) * (float)reinterpret_cast<const signed char*>(blk + 2)[i];
    }
    const u8* blk = row + (size_t)b * (T == T_Q4_0 ? 18 : 20);
    const u8 q = blk[(T == T_Q4_0 ? 2 : 4) + (i & 15)];
    const int v = i < 16 ? (q & 15) : (q >> 4);
    if (T == T_Q4_0) return h2f(load_u16(blk)) * (float)(v - 8);
    return h2f(load_u16(blk)) * (float)v + h2f(load_u16(blk + 2));
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float gelu(float x) {
    const float k = 0.7978845608f;  // sqrt(2 / pi), tanh approximation as in ggml
    return 0.5f * x * (1.0f + tanhf(k * x * (1.0f + 0.044715f * x * x)));
}

__device__ __forceinline__ float activate(int act, float g, float u) {
    switch (act) {
        case ACT_SWIGLU: return silu(g) * u;
        case ACT_REGLU: return fmaxf(g, 0.0f) * u;
        case ACT_DREGLU: return fmaxf(g, 0.0f) * fmaxf(u, 0.0f);
        case ACT_RELU: return fmaxf(u, 0.0f);
        default: return gelu(u);
    }
}

// ---- dense matrix-vector product -------------------------------------------------------------
// y[r] = W[r] . x (+ bias[r]) for r < rows, optionally relu'd; one warp per row, 4 rows per block.

template <int T>
__device__ void matvec(const u8* w, unsigned long long row_bytes, const float* x, const Q8Act* xq,
                       const float* bias, float* y, int rows, int cols, int relu) {
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    float v = warp_dot<T>(w + (size_t)r * row_bytes, x, xq, cols);
    if ((threadIdx.x & 31) == 0) {
        if (bias) v += bias[r];
        y[r] = relu ? fmaxf(v, 0.0f) : v;
    }
}

#define MATVEC(NAME, T)                                                                           \
    extern "C" __global__ void NAME(const u8* w, unsigned long long row_bytes, const float* x,     \
                                    const Q8Act* xq, const float* bias, float* y, int rows, int cols, \
                                    int relu) {                                                    \
        matvec<T>(w, row_bytes, x, xq, bias, y, rows, cols, relu);                                 \
    }
MATVEC(matvec_f32, T_F32)
MATVEC(matvec_f16, T_F16)
MATVEC(matvec_q4_0, T_Q4_0)
MATVEC(matvec_q4_1, T_Q4_1)
MATVEC(matvec_q8_0, T_Q8_0)

// ---- hot neurons: sparse row matvec over the GPU-resident rows ---------------------------------
// The GPU holds n_hot rows of gate, up and down_t, packed; row i is neuron bucket[i] of the
// layer. h[i] = act(gate_i . x, up_i . x + up_bias[neuron]) when the predictor selects the
// neuron (pred_logits[neuron] >= threshold, or no predictor), else 0 without reading the row:
// the predictor's early exit. One warp per row.

template <int T>
__device__ void ffn_hot(const u8* gate, const u8* up, unsigned long long row_bytes, const int* bucket,
                        const float* x, const Q8Act* xq, const float* up_bias, const float* pred_logits,
                        float threshold, unsigned int* selected, float* h, int n_hot, int cols, int act) {
    const int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n_hot) return;
    const int j = bucket[i];
    if (pred_logits && !(pred_logits[j] >= threshold)) {
        if ((threadIdx.x & 31) == 0) h[i] = 0.0f;
        return;
    }
    // the layer's count of selected neurons, for the stats of a layer the host never sees
    if (selected && (threadIdx.x & 31) == 0) atomicAdd(selected, 1u);
    const float g = gate ? warp_dot<T>(gate + (size_t)i * row_bytes, x, xq, cols) : 0.0f;
    float u = warp_dot<T>(up + (size_t)i * row_bytes, x, xq, cols);
    if (up_bias) u += up_bias[j];
    if ((threadIdx.x & 31) == 0) h[i] = activate(act, g, u);
}

#define FFN_HOT(NAME, T)                                                                              \
    extern "C" __global__ void NAME(const u8* gate, const u8* up, unsigned long long row_bytes,       \
                                    const int* bucket, const float* x, const Q8Act* xq,               \
                                    const float* up_bias, const float* pred_logits, float threshold,  \
                                    unsigned int* selected, float* h, int n_hot, int cols, int act) { \
        ffn_hot<T>(gate, up, row_bytes, bucket, x, xq, up_bias, pred_logits, threshold, selected, h,  \
                   n_hot, cols, act);                                                                 \
    }
FFN_HOT(ffn_hot_f32, T_F32)
FFN_HOT(ffn_hot_f16, T_F16)
FFN_HOT(ffn_hot_q4_0, T_Q4_0)
FFN_HOT(ffn_hot_q4_1, T_Q4_1)
FFN_HOT(ffn_hot_q8_0, T_Q8_0)

// ---- sparse axpy of the down projection --------------------------------------------------------
// partial[chunk, c] = sum over rows i of the chunk with h[i] != 0 of h[i] * down_t[i, c].
// grid (ceil(cols / blockDim.x), n_chunks). Each output element has exactly one writer, so no
// atomics and the same order of additions on every run; ffn_merge sums the chunks.

template <int T>
__device__ void down_partial(const u8* down_t, unsigned long long row_bytes, const float* h, int n_hot,
                             int cols, int rows_per_chunk, float* partial) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int chunk = blockIdx.y;
    if (c >= cols) return;
    const int i0 = chunk * rows_per_chunk;
    const int i1 = min(n_hot, i0 + rows_per_chunk);
    float acc = 0.0f;
    for (int i = i0; i < i1; i++) {
        const float a = h[i];  // the same address for the whole block: one broadcast load
        if (a != 0.0f) acc += a * row_elem<T>(down_t + (size_t)i * row_bytes, c);
    }
    partial[(size_t)chunk * cols + c] = acc;
}

#define DOWN_PARTIAL(NAME, T)                                                                      \
    extern "C" __global__ void NAME(const u8* down_t, unsigned long long row_bytes, const float* h, \
                                    int n_hot, int cols, int rows_per_chunk, float* partial) {     \
        down_partial<T>(down_t, row_bytes, h, n_hot, cols, rows_per_chunk, partial);               \
    }
DOWN_PARTIAL(down_partial_f32, T_F32)
DOWN_PARTIAL(down_partial_f16, T_F16)
DOWN_PARTIAL(down_partial_q4_0, T_Q4_0)
DOWN_PARTIAL(down_partial_q4_1, T_Q4_1)
DOWN_PARTIAL(down_partial_q8_0, T_Q8_0)

// x[c] += sum_k partial[k, c] + cpu_part[c] + bias[c]: the GPU's hot-neuron chunks, the CPU's
// cold neurons and the bias merged into the residual. cpu_part and bias may be null.
extern "C" __global__ void ffn_merge(float* x, const float* partial, int n_chunks, const float* cpu_part,
                                     const float* bias, int cols) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float v = 0.0f;
    for (int k = 0; k < n_chunks; k++) v += partial[(size_t)k * cols + c];
    if (cpu_part) v += cpu_part[c];
    if (bias) v += bias[c];
    x[c] += v;
}

// ---- dense layer ops ---------------------------------------------------------------------------

// out = x / sqrt(mean(x^2) + eps) * w; one block.
extern "C" __global__ void rmsnorm(const float* x, const float* w, float* out, int n, float eps) {
    __shared__ float red[32];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, red);
    const float scale = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i] * scale * w[i];
}

// x[i] += y[i] (+ bias[i])
extern "C" __global__ void add_into(float* x, const float* y, const float* bias, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i] + (bias ? bias[i] : 0.0f);
}

// x[i] += bias[i]
extern "C" __global__ void add_bias(float* x, const float* bias, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i];
}

// Rotary embedding of every head of x (n_heads * head_dim) at one position, from that position's
// cos/sin (rope_dim / 2). neox = 0 rotates (x[2i], x[2i+1]); neox = 1 rotates (x[i], x[i + rope_dim/2]).
extern "C" __global__ void rope(float* x, const float* cos_t, const float* sin_t, int n_heads, int head_dim,
                                int rope_dim, int neox) {
    const int half = rope_dim / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_heads * half) return;
    const int h = idx / half, i = idx % half;
    float* xh = x + (size_t)h * head_dim;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = xh[a], x1 = xh[b], c = cos_t[i], s = sin_t[i];
    xh[a] = x0 * c - x1 * s;
    xh[b] = x0 * s + x1 * c;
}

// Stores one position's k and v (kv_dim each) in the caches, as f32 or f16.
extern "C" __global__ void kv_store(const float* k, const float* v, void* k_cache, void* v_cache, int pos,
                                    int kv_dim, int f16) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= kv_dim) return;
    const size_t o = (size_t)pos * kv_dim + i;
    if (f16) {
        reinterpret_cast<u16*>(k_cache)[o] = f2h(k[i]);
        reinterpret_cast<u16*>(v_cache)[o] = f2h(v[i]);
    } else {
        reinterpret_cast<float*>(k_cache)[o] = k[i];
        reinterpret_cast<float*>(v_cache)[o] = v[i];
    }
}

__device__ __forceinline__ float cache_at(const void* cache, size_t o, int f16) {
    return f16 ? h2f(reinterpret_cast<const u16*>(cache)[o]) : reinterpret_cast<const float*>(cache)[o];
}

// Causal attention of one token over positions 0..len-1; one block per query head. Query head h
// reads kv head h / (n_head / n_head_kv). scores (n_head, n_ctx) is scratch in global memory,
// so the context length is not bounded by shared memory.
extern "C" __global__ void attention(const float* q, const void* k_cache, const void* v_cache, float* scores,
                                     float* out, int len, int n_ctx, int n_head, int n_head_kv, int head_dim,
                                     float scale, int f16) {
    __shared__ float red[32];
    const int h = blockIdx.x;
    const int g = h / (n_head / n_head_kv);
    const int kv_dim = n_head_kv * head_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const float* qh = q + (size_t)h * head_dim;
    float* sh = scores + (size_t)h * n_ctx;

    // scores: one warp per position, lanes across the head
    for (int t = warp; t < len; t += nwarps) {
        const size_t base = (size_t)t * kv_dim + (size_t)g * head_dim;
        float s = 0.0f;
        for (int d = lane; d < head_dim; d += 32) s += qh[d] * cache_at(k_cache, base + d, f16);
        s = warp_sum(s);
        if (lane == 0) sh[t] = s * scale;
    }
    __syncthreads();

    // softmax over the scores
    float m = -INFINITY;
    for (int t = threadIdx.x; t < len; t += blockDim.x) m = fmaxf(m, sh[t]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        const float e = expf(sh[t] - m);
        sh[t] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // its barriers also make every sh[t] visible below
    const float inv = 1.0f / sum;

    // out[d] = sum_t p[t] v[t, d]; one thread per head dimension
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < len; t++) acc += sh[t] * cache_at(v_cache, (size_t)t * kv_dim + (size_t)g * head_dim + d, f16);
        out[(size_t)h * head_dim + d] = acc * inv;
    }
}
