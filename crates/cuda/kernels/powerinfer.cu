// GPU kernels of powerinfer-rs: f32 activations, weights in their
// file type (F32, F16, and ggml's block layouts: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4 in
// blocks of 32; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS in super-blocks of 256). Quantized weights read
// their input as int8 blocks of 32 (quantize_q8), rounded exactly as the CPU's integer kernels
// round it for Q4_0, Q4_1 and Q8_0, so the GPU and the CPU compute the same function there;
// the other types read the same blocks (the CPU reads 256-value blocks for the K-quants: the
// two differ by that rounding). Compiled to PTX by scripts/gen_ptx.sh and committed as
// powerinfer.ptx; the Rust side loads the PTX through the driver, so users need no CUDA
// toolkit. Every kernel has a scalar CPU twin in src/twin.rs, and tests/gpu compares the two.
//
// Rows: the per-token kernels also take a batch of m consecutive tokens of one sequence (a
// prompt), one per blockIdx.y (rmsnorm: blockIdx.x), their activations row after row; with
// m = 1 they are the one-token kernels.
//
// No cuda_fp16.h: half to float goes through one PTX instruction, so the file compiles with
// nvcc alone (no CCCL headers).

typedef unsigned char u8;
typedef unsigned short u16;

// ggml's type ids
enum : int {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23,
    T_MXFP4 = 39
};

// Values per block and bytes per block of the block formats.
__host__ __device__ constexpr int block_len(int t) {
    return t == T_Q2_K || t == T_Q3_K || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K || t == T_IQ4_XS ? 256 : 32;
}
__host__ __device__ constexpr int block_bytes(int t) {
    return t == T_Q4_0 ? 18 : t == T_Q4_1 ? 20 : t == T_Q5_0 ? 22 : t == T_Q5_1 ? 24 : t == T_Q8_0 ? 34
         : t == T_Q2_K ? 84 : t == T_Q3_K ? 110 : t == T_Q4_K ? 144 : t == T_Q5_K ? 176
         : t == T_Q6_K ? 210 : t == T_IQ4_NL ? 18 : t == T_MXFP4 ? 17 : 136;
}
enum : int {
    ACT_SWIGLU = 0, ACT_REGLU = 1, ACT_DREGLU = 2, ACT_RELU = 3, ACT_GELU = 4, ACT_GEGLU = 5, ACT_SWIGLU_OAI = 6
};

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

// One block of 32 values, one per lane of a warp (v: this lane's), into `out`.
__device__ __forceinline__ void quantize_block(float v, int lane, Q8Act& out) {
    const float d = warp_max(fabsf(v)) / 127.0f;  // IEEE division, as on the CPU (no fast math)
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = (int)fminf(fmaxf(roundf(v * id), -128.0f), 127.0f);  // Rust's saturating `as i8`
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    reinterpret_cast<signed char*>(out.qs)[lane] = (signed char)q;
    if (lane == 0) {
        out.d = d;
        out.s = d * (float)sum;
    }
}

// One warp per block of 32 values; n_blocks blocks of x into out.
extern "C" __global__ void quantize_q8(const float* x, Q8Act* out, int n_blocks) {
    const int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= n_blocks) return;
    const int lane = threadIdx.x & 31;
    quantize_block(x[b * 32 + lane], lane, out[b]);
}

// 4 weight bytes at a 2-byte-aligned address as one int.
__device__ __forceinline__ int load_i32_a2(const u8* p) {
    return (int)load_u16(p) | ((int)load_u16(p + 2) << 16);
}

// 4 weight bytes at any address as one int (MXFP4's 17-byte blocks).
__device__ __forceinline__ int load_i32_a1(const u8* p) {
    return (int)p[0] | ((int)p[1] << 8) | ((int)p[2] << 16) | ((int)p[3] << 24);
}

// MXFP4's block scale, halved to go with mxfp4_lookup's doubled values: 2^(e - 128) (ggml's
// GGML_E8M0_TO_FP32_HALF; e = 0 and 1 are subnormal).
__device__ __forceinline__ float e8m0_half(u8 e) {
    const unsigned bits = e < 2 ? 0x00200000u << e : (unsigned)(e - 1) << 23;
    return __uint_as_float(bits);
}

// ---- the block formats, 32 values ("a unit") at a time ----------------------------------------
// Unit u of a row is values 32u .. 32u + 31: a whole block of the 32-value formats, an eighth of
// a super-block of the K-quants. unit_dot is that unit's part of the row's dot with the input's
// int8 block u; unit_elem one value of it. Layouts are ggml's (ggml-quants.c).

// Bit i of b (i < 4) as bit 0 of byte i.
__device__ __forceinline__ int spread4(int b) {
    return (b & 1) | ((b & 2) << 7) | ((b & 4) << 14) | ((b & 8) << 21);
}

// IQ4_NL / IQ4_XS: a 4-bit index selects one of 16 int8 values, ggml's kvalues_iq4nl:
// -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113. Four indices (one
// per byte, 0..15) become their four values by byte permutes of the table held as four words
// (t0 = values 0..3, little-endian), with no per-lane memory lookups.
__device__ __forceinline__ int iq4_lookup(int idx) {
    const unsigned t0 = 0xBFAD9881u, t1 = 0xF6EADDCFu, t2 = 0x26190D01u, t3 = 0x71594535u;
    const unsigned lo3 = (unsigned)idx & 0x07070707u;
    const unsigned sel = (lo3 & 0x7u) | ((lo3 >> 4) & 0x70u) | ((lo3 >> 8) & 0x700u) | ((lo3 >> 12) & 0x7000u);
    const unsigned low = __byte_perm(t0, t1, sel), high = __byte_perm(t2, t3, sel);
    const unsigned upper = (((unsigned)idx >> 3) & 0x01010101u) * 0xFFu;  // bytes whose index is 8..15
    return (int)((low & ~upper) | (high & upper));
}

// MXFP4: a 4-bit index selects an E2M1 value, doubled to an integer (ggml's kvalues_mxfp4):
// 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12; four indices at once as iq4_lookup.
__device__ __forceinline__ int mxfp4_lookup(int idx) {
    const unsigned t0 = 0x03020100u, t1 = 0x0C080604u, t2 = 0xFDFEFF00u, t3 = 0xF4F8FAFCu;
    const unsigned lo3 = (unsigned)idx & 0x07070707u;
    const unsigned sel = (lo3 & 0x7u) | ((lo3 >> 4) & 0x70u) | ((lo3 >> 8) & 0x700u) | ((lo3 >> 12) & 0x7000u);
    const unsigned low = __byte_perm(t0, t1, sel), high = __byte_perm(t2, t3, sel);
    const unsigned upper = (((unsigned)idx >> 3) & 0x01010101u) * 0xFFu;
    return (int)((low & ~upper) | (high & upper));
}

// K-quant 6-bit scale and min j (0..7) of Q4_K / Q5_K (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(const u8* q, int j, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q3_K's 16 6-bit scales packed in 12 bytes; scale i, minus 32.
__device__ __forceinline__ int q3k_scale(const u8* s, int i) {
    const int lo = i < 8 ? (s[i] & 15) : (s[i - 8] >> 4);
    const int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// IQ4_XS sub-block ib's scale, minus 32.
__device__ __forceinline__ int iq4xs_scale(const u8* blk, int ib) {
    const int lo = (blk[4 + ib / 2] >> (4 * (ib & 1))) & 0xF;
    const int hi = (load_u16(blk + 2) >> (2 * ib)) & 3;
    return (lo | (hi << 4)) - 32;
}

// Integer dot of 32 int8 weights, four per int in w[0..8], with the input block's int8 values;
// the two halves (values 0..15, 16..31) apart, for formats with a scale per 16 values.
__device__ __forceinline__ void idot_halves(const int* w, const Q8Act& a, int& lo, int& hi) {
    lo = 0;
    hi = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) lo = __dp4a(w[k], a.qs[k], lo);
#pragma unroll
    for (int k = 4; k < 8; k++) hi = __dp4a(w[k], a.qs[k], hi);
}

// The 32 unit values as int8 (four per int), without their scales and offsets, for every
// format but Q8_0: 4-bit values come from nibbles, Q5's fifth bit from qh, Q6_K's and Q3_K's
// values are offset to signed, IQ4's looked up.
template <int T>
__device__ __forceinline__ void unit_ints(const u8* row, int u, int* w) {
    if (T == T_MXFP4) {
        // the exponent byte, then Q4_0's nibble order, at any byte address
        const u8* qs = row + (size_t)u * 17 + 1;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int q = load_i32_a1(qs + 4 * k);
            w[k] = mxfp4_lookup(q & 0x0F0F0F0F);
            w[4 + k] = mxfp4_lookup((q >> 4) & 0x0F0F0F0F);
        }
    } else if (T == T_Q4_0 || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1 || T == T_IQ4_NL) {
        // value i < 16 is the low nibble of qs[i], value i + 16 its high nibble
        const u8* blk = row + (size_t)u * block_bytes(T);
        const int qs_at = T == T_Q4_0 || T == T_IQ4_NL ? 2 : T == T_Q4_1 ? 4 : T == T_Q5_0 ? 6 : 8;
        const int qh = T == T_Q5_0 ? load_i32_a2(blk + 2) : T == T_Q5_1 ? load_i32_a2(blk + 4) : 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int q = load_i32_a2(blk + qs_at + 4 * k);
            w[k] = q & 0x0F0F0F0F;
            w[4 + k] = (q >> 4) & 0x0F0F0F0F;
            if (T == T_Q5_0 || T == T_Q5_1) {
                w[k] |= spread4(qh >> (4 * k)) << 4;
                w[4 + k] |= spread4(qh >> (16 + 4 * k)) << 4;
            }
            if (T == T_IQ4_NL) {
                w[k] = iq4_lookup(w[k]);
                w[4 + k] = iq4_lookup(w[4 + k]);
            }
        }
    } else {
        const int sb = u >> 3, j = u & 7;  // super-block, unit within it
        const u8* blk = row + (size_t)sb * block_bytes(T);
        if (T == T_Q4_K || T == T_Q5_K) {
            // units 2p and 2p + 1 are the low and high nibbles of qs[32p .. 32p + 32]
            const u8* qs = blk + (T == T_Q4_K ? 16 : 48) + 32 * (j >> 1);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int q = load_i32_a2(qs + 4 * k);
                w[k] = (j & 1 ? q >> 4 : q) & 0x0F0F0F0F;
                if (T == T_Q5_K) w[k] |= ((load_i32_a2(blk + 16 + 4 * k) >> j) & 0x01010101) << 4;
            }
        } else if (T == T_Q6_K) {
            // half n of the super-block: ql[64n ..], qh[32n ..]; unit k of the half takes the
            // low (k < 2) or high nibbles of ql[l] (k even) or ql[l + 32], and bits 2k of qh[l]
            const int n = j >> 2, k4 = j & 3;
            const u8* ql = blk + 64 * n + 32 * (k4 & 1);
            const u8* qh = blk + 128 + 32 * n;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int lo = (k4 >= 2 ? load_i32_a2(ql + 4 * k) >> 4 : load_i32_a2(ql + 4 * k)) & 0x0F0F0F0F;
                const int hi = ((load_i32_a2(qh + 4 * k) >> (2 * k4)) & 0x03030303) << 4;
                w[k] = __vsub4(lo | hi, 0x20202020);  // q - 32, bytewise
            }
        } else if (T == T_Q2_K || T == T_Q3_K) {
            // half n: qs[32n .. 32n + 32], bits 2k4 of each byte; Q3_K: minus 4 where bit
            // 4n + k4 of hmask[l] is clear
            const int n = j >> 2, k4 = j & 3;
            const u8* qs = blk + (T == T_Q2_K ? 16 : 32) + 32 * n;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                w[k] = (load_i32_a2(qs + 4 * k) >> (2 * k4)) & 0x03030303;
                if (T == T_Q3_K) {
                    const int h = (load_i32_a2(blk + 4 * k) >> (4 * n + k4)) & 0x01010101;
                    w[k] = __vsub4(w[k] | (h << 2), 0x04040404);
                }
            }
        } else {  // IQ4_XS: sub-block j's 16 bytes, low nibbles then high
            const u8* qs = blk + 8 + 16 * j;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int q = load_i32_a2(qs + 4 * k);
                w[k] = iq4_lookup(q & 0x0F0F0F0F);
                w[4 + k] = iq4_lookup((q >> 4) & 0x0F0F0F0F);
            }
        }
    }
}

// Unit u of the row . the input's int8 block u (= a).
template <int T>
__device__ __forceinline__ float unit_dot(const u8* row, int u, const Q8Act& a) {
    if (T == T_Q8_0) {
        const u8* blk = row + (size_t)u * 34;
        int isum = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) isum = __dp4a(load_i32_a2(blk + 2 + 4 * k), a.qs[k], isum);
        return h2f(load_u16(blk)) * a.d * (float)isum;
    }
    int w[8], lo, hi;
    unit_ints<T>(row, u, w);
    idot_halves(w, a, lo, hi);
    const int isum = lo + hi;
    if (T == T_MXFP4) return e8m0_half(row[(size_t)u * 17]) * (a.d * (float)isum);
    if (T == T_Q4_0 || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1 || T == T_IQ4_NL) {
        const u8* blk = row + (size_t)u * block_bytes(T);
        const float d = h2f(load_u16(blk));
        // sum((q - 8) * a) = sum(q * a) - 8 * sum(a); Q5_0 likewise with 16
        if (T == T_Q4_0) return d * (a.d * (float)isum) - 8.0f * d * a.s;
        if (T == T_Q5_0) return d * (a.d * (float)isum) - 16.0f * d * a.s;
        if (T == T_IQ4_NL) return d * (a.d * (float)isum);
        return d * a.d * (float)isum + h2f(load_u16(blk + 2)) * a.s;  // Q4_1, Q5_1: + min * sum(a)
    }
    const int sb = u >> 3, j = u & 7;
    const u8* blk = row + (size_t)sb * block_bytes(T);
    if (T == T_Q4_K || T == T_Q5_K) {
        int sc, m;
        scale_min_k4(blk + 4, j, sc, m);
        // value = d * sc * q - dmin * m
        return h2f(load_u16(blk)) * (float)sc * (a.d * (float)isum) - h2f(load_u16(blk + 2)) * (float)m * a.s;
    }
    if (T == T_Q6_K) {
        const signed char* sc = reinterpret_cast<const signed char*>(blk + 192 + 8 * (j >> 2) + 2 * (j & 3));
        return h2f(load_u16(blk + 208)) * a.d * (float)(sc[0] * lo + sc[1] * hi);
    }
    if (T == T_Q3_K) {
        const int is = 8 * (j >> 2) + 2 * (j & 3);
        return h2f(load_u16(blk + 108)) * a.d * (float)(q3k_scale(blk + 96, is) * lo + q3k_scale(blk + 96, is + 1) * hi);
    }
    if (T == T_Q2_K) {
        // scale byte per 16 values: low nibble scale, high nibble min; value = d * sc * q - dmin * m
        const u8* s = blk + 8 * (j >> 2) + 2 * (j & 3);
        int asum_lo = 0, asum_hi = 0;  // the input's integer sums over each half
#pragma unroll
        for (int k = 0; k < 4; k++) asum_lo = __dp4a(0x01010101, a.qs[k], asum_lo);
#pragma unroll
        for (int k = 4; k < 8; k++) asum_hi = __dp4a(0x01010101, a.qs[k], asum_hi);
        const float d = h2f(load_u16(blk + 80)), dmin = h2f(load_u16(blk + 82));
        return a.d * (d * (float)((s[0] & 15) * lo + (s[1] & 15) * hi) - dmin * (float)((s[0] >> 4) * asum_lo + (s[1] >> 4) * asum_hi));
    }
    // IQ4_XS
    return h2f(load_u16(blk)) * (float)iq4xs_scale(blk, j) * (a.d * (float)isum);
}

// Value i (< 32) of unit u as unit_ints has it (one value, without decoding the unit).
template <int T>
__device__ __forceinline__ int unit_int(const u8* row, int u, int i) {
    const int nib = i >> 4;  // 32-value blocks and IQ4_XS: low nibbles, then high
    if (T == T_MXFP4) return (signed char)mxfp4_lookup((row[(size_t)u * 17 + 1 + (i & 15)] >> (4 * nib)) & 15);
    if (T == T_Q4_0 || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1 || T == T_IQ4_NL) {
        const u8* blk = row + (size_t)u * block_bytes(T);
        const int qs_at = T == T_Q4_0 || T == T_IQ4_NL ? 2 : T == T_Q4_1 ? 4 : T == T_Q5_0 ? 6 : 8;
        int q = (blk[qs_at + (i & 15)] >> (4 * nib)) & 15;
        if (T == T_Q5_0 || T == T_Q5_1) q |= ((load_i32_a2(blk + (T == T_Q5_0 ? 2 : 4)) >> i) & 1) << 4;
        if (T == T_IQ4_NL) q = (signed char)iq4_lookup(q);
        return q;
    }
    const int sb = u >> 3, j = u & 7, n = j >> 2, k4 = j & 3;
    const u8* blk = row + (size_t)sb * block_bytes(T);
    if (T == T_Q4_K || T == T_Q5_K) {
        int q = (blk[(T == T_Q4_K ? 16 : 48) + 32 * (j >> 1) + i] >> (4 * (j & 1))) & 15;
        if (T == T_Q5_K) q |= ((blk[16 + i] >> j) & 1) << 4;
        return q;
    }
    if (T == T_Q6_K) {
        const int lo = (blk[64 * n + 32 * (k4 & 1) + i] >> (k4 >= 2 ? 4 : 0)) & 15;
        return (lo | (((blk[128 + 32 * n + i] >> (2 * k4)) & 3) << 4)) - 32;
    }
    if (T == T_Q2_K || T == T_Q3_K) {
        const int q = (blk[(T == T_Q2_K ? 16 : 32) + 32 * n + i] >> (2 * k4)) & 3;
        return T == T_Q2_K ? q : q - ((blk[i] >> (4 * n + k4)) & 1 ? 0 : 4);
    }
    return (signed char)iq4_lookup((blk[8 + 16 * j + (i & 15)] >> (4 * nib)) & 15);  // IQ4_XS
}

// Value i (< 32) of unit u, dequantized.
template <int T>
__device__ __forceinline__ float unit_elem(const u8* row, int u, int i) {
    if (T == T_Q8_0) {
        const u8* blk = row + (size_t)u * 34;
        return h2f(load_u16(blk)) * (float)reinterpret_cast<const signed char*>(blk + 2)[i];
    }
    const int q = unit_int<T>(row, u, i);
    if (T == T_MXFP4) return e8m0_half(row[(size_t)u * 17]) * (float)q;
    if (T == T_Q4_0 || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1 || T == T_IQ4_NL) {
        const u8* blk = row + (size_t)u * block_bytes(T);
        const float d = h2f(load_u16(blk));
        if (T == T_Q4_0) return d * (float)(q - 8);
        if (T == T_Q5_0) return d * (float)(q - 16);
        if (T == T_IQ4_NL) return d * (float)q;
        return d * (float)q + h2f(load_u16(blk + 2));
    }
    const int sb = u >> 3, j = u & 7, half = i >> 4;
    const u8* blk = row + (size_t)sb * block_bytes(T);
    if (T == T_Q4_K || T == T_Q5_K) {
        int sc, m;
        scale_min_k4(blk + 4, j, sc, m);
        return h2f(load_u16(blk)) * (float)sc * (float)q - h2f(load_u16(blk + 2)) * (float)m;
    }
    if (T == T_Q6_K) {
        const signed char* sc = reinterpret_cast<const signed char*>(blk + 192 + 8 * (j >> 2) + 2 * (j & 3));
        return h2f(load_u16(blk + 208)) * (float)(sc[half] * q);
    }
    if (T == T_Q3_K) return h2f(load_u16(blk + 108)) * (float)(q3k_scale(blk + 96, 8 * (j >> 2) + 2 * (j & 3) + half) * q);
    if (T == T_Q2_K) {
        const int s = blk[8 * (j >> 2) + 2 * (j & 3) + half];
        return h2f(load_u16(blk + 80)) * (float)((s & 15) * q) - h2f(load_u16(blk + 82)) * (float)(s >> 4);
    }
    return h2f(load_u16(blk)) * (float)(iq4xs_scale(blk, j) * q);
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
        // block formats: lane handles whole units lane, lane + 32, ...
        for (int u = lane; u < cols / 32; u += 32) acc += unit_dot<T>(row, u, xq[u]);
    }
    return warp_sum(acc);
}

// Element `c` of a row (one thread per column in the down projection).
template <int T>
__device__ __forceinline__ float row_elem(const u8* row, int c) {
    if (T == T_F32) return reinterpret_cast<const float*>(row)[c];
    if (T == T_F16) return h2f(reinterpret_cast<const u16*>(row)[c]);
    return unit_elem<T>(row, c >> 5, c & 31);
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
        case ACT_GEGLU: return gelu(g) * u;
        case ACT_SWIGLU_OAI: {
            // gpt-oss: the gate clamped above at 7, up into [-7, 7], slope 1.702, up + 1
            const float x = fminf(g, 7.0f);
            return x / (1.0f + expf(-1.702f * x)) * (fminf(fmaxf(u, -7.0f), 7.0f) + 1.0f);
        }
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
    const int t = blockIdx.y;  // the batch row
    float v = warp_dot<T>(w + (size_t)r * row_bytes, x + (size_t)t * cols, xq + (size_t)t * (cols / 32), cols);
    if ((threadIdx.x & 31) == 0) {
        if (bias) v += bias[r];
        y[(size_t)t * rows + r] = relu ? fmaxf(v, 0.0f) : v;
    }
}

#define MATVEC(NAME, T)                                                                           \
    extern "C" __global__ void NAME(const u8* w, unsigned long long row_bytes, const float* x,     \
                                    const Q8Act* xq, const float* bias, float* y, int rows, int cols, \
                                    int relu) {                                                    \
        matvec<T>(w, row_bytes, x, xq, bias, y, rows, cols, relu);                                 \
    }
// Three matrices of one type and width on one input in one launch (q, k and v): rows0 + rows1
// + rows2 warps, each finding its matrix.
template <int T>
__device__ void matvec3(const u8* w0, const u8* w1, const u8* w2, unsigned long long row_bytes, const float* x,
                        const Q8Act* xq, const float* b0, const float* b1, const float* b2, float* y0, float* y1,
                        float* y2, int rows0, int rows1, int rows2, int cols) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u8* w = w0;
    const float* b = b0;
    float* y = y0;
    int rows = rows0;
    if (r >= rows0) {
        r -= rows0;
        w = w1, b = b1, y = y1, rows = rows1;
        if (r >= rows1) {
            r -= rows1;
            w = w2, b = b2, y = y2, rows = rows2;
            if (r >= rows2) return;
        }
    }
    const int t = blockIdx.y;  // the batch row
    const float v = warp_dot<T>(w + (size_t)r * row_bytes, x + (size_t)t * cols, xq + (size_t)t * (cols / 32), cols);
    if ((threadIdx.x & 31) == 0) y[(size_t)t * rows + r] = b ? v + b[r] : v;
}

#define MATVEC3(NAME, T)                                                                                 \
    extern "C" __global__ void NAME(const u8* w0, const u8* w1, const u8* w2, unsigned long long row_bytes, \
                                    const float* x, const Q8Act* xq, const float* b0, const float* b1,    \
                                    const float* b2, float* y0, float* y1, float* y2, int rows0, int rows1, \
                                    int rows2, int cols) {                                                \
        matvec3<T>(w0, w1, w2, row_bytes, x, xq, b0, b1, b2, y0, y1, y2, rows0, rows1, rows2, cols);       \
    }

MATVEC(matvec_f32, T_F32)
MATVEC(matvec_f16, T_F16)
MATVEC(matvec_q4_0, T_Q4_0)
MATVEC(matvec_q4_1, T_Q4_1)
MATVEC(matvec_q8_0, T_Q8_0)
MATVEC(matvec_q5_0, T_Q5_0)
MATVEC(matvec_q5_1, T_Q5_1)
MATVEC(matvec_q2_k, T_Q2_K)
MATVEC(matvec_q3_k, T_Q3_K)
MATVEC(matvec_q4_k, T_Q4_K)
MATVEC(matvec_q5_k, T_Q5_K)
MATVEC(matvec_q6_k, T_Q6_K)
MATVEC(matvec_iq4_nl, T_IQ4_NL)
MATVEC(matvec_iq4_xs, T_IQ4_XS)
MATVEC(matvec_mxfp4, T_MXFP4)
MATVEC3(matvec3_f32, T_F32)
MATVEC3(matvec3_f16, T_F16)
MATVEC3(matvec3_q4_0, T_Q4_0)
MATVEC3(matvec3_q4_1, T_Q4_1)
MATVEC3(matvec3_q8_0, T_Q8_0)
MATVEC3(matvec3_q5_0, T_Q5_0)
MATVEC3(matvec3_q5_1, T_Q5_1)
MATVEC3(matvec3_q2_k, T_Q2_K)
MATVEC3(matvec3_q3_k, T_Q3_K)
MATVEC3(matvec3_q4_k, T_Q4_K)
MATVEC3(matvec3_q5_k, T_Q5_K)
MATVEC3(matvec3_q6_k, T_Q6_K)
MATVEC3(matvec3_iq4_nl, T_IQ4_NL)
MATVEC3(matvec3_iq4_xs, T_IQ4_XS)
MATVEC3(matvec3_mxfp4, T_MXFP4)

// ---- hot neurons: sparse row matvec over the GPU-resident rows ---------------------------------
// The GPU holds n_hot rows of gate, up and down_t, packed; row i is neuron bucket[i] of the
// layer. h[i] = act(gate_i . x + gate_bias[neuron], up_i . x + up_bias[neuron]) when the predictor selects the
// neuron (pred_logits[neuron] >= threshold, or no predictor), else 0 without reading the row:
// the predictor's early exit. One warp per row; grid.y the batch rows, whose predictor logits lie
// pred_stride apart.

template <int T>
__device__ void ffn_hot(const u8* gate, const u8* up, unsigned long long row_bytes, const int* bucket,
                        const float* x, const Q8Act* xq, const float* gate_bias, const float* up_bias,
                        const float* pred_logits, float threshold, unsigned int* selected, float* h,
                        int n_hot, int cols, int act, int pred_stride) {
    const int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n_hot) return;
    const int t = blockIdx.y;
    x += (size_t)t * cols;
    xq += (size_t)t * (cols / 32);
    h += (size_t)t * n_hot;
    if (pred_logits) pred_logits += (size_t)t * pred_stride;
    const int j = bucket[i];
    if (pred_logits && !(pred_logits[j] >= threshold)) {
        if ((threadIdx.x & 31) == 0) h[i] = 0.0f;
        return;
    }
    // the layer's count of selected neurons, for the stats of a layer the host never sees
    if (selected && (threadIdx.x & 31) == 0) atomicAdd(selected, 1u);
    float g = gate ? warp_dot<T>(gate + (size_t)i * row_bytes, x, xq, cols) : 0.0f;
    float u = warp_dot<T>(up + (size_t)i * row_bytes, x, xq, cols);
    if (gate_bias) g += gate_bias[j];
    if (up_bias) u += up_bias[j];
    if ((threadIdx.x & 31) == 0) h[i] = activate(act, g, u);
}

#define FFN_HOT(NAME, T)                                                                              \
    extern "C" __global__ void NAME(const u8* gate, const u8* up, unsigned long long row_bytes,       \
                                    const int* bucket, const float* x, const Q8Act* xq,               \
                                    const float* gate_bias, const float* up_bias,                     \
                                    const float* pred_logits, float threshold, unsigned int* selected, \
                                    float* h, int n_hot, int cols, int act, int pred_stride) {        \
        ffn_hot<T>(gate, up, row_bytes, bucket, x, xq, gate_bias, up_bias, pred_logits, threshold,    \
                   selected, h, n_hot, cols, act, pred_stride);                                       \
    }
FFN_HOT(ffn_hot_f32, T_F32)
FFN_HOT(ffn_hot_f16, T_F16)
FFN_HOT(ffn_hot_q4_0, T_Q4_0)
FFN_HOT(ffn_hot_q4_1, T_Q4_1)
FFN_HOT(ffn_hot_q8_0, T_Q8_0)
FFN_HOT(ffn_hot_q5_0, T_Q5_0)
FFN_HOT(ffn_hot_q5_1, T_Q5_1)
FFN_HOT(ffn_hot_q2_k, T_Q2_K)
FFN_HOT(ffn_hot_q3_k, T_Q3_K)
FFN_HOT(ffn_hot_q4_k, T_Q4_K)
FFN_HOT(ffn_hot_q5_k, T_Q5_K)
FFN_HOT(ffn_hot_q6_k, T_Q6_K)
FFN_HOT(ffn_hot_iq4_nl, T_IQ4_NL)
FFN_HOT(ffn_hot_iq4_xs, T_IQ4_XS)
FFN_HOT(ffn_hot_mxfp4, T_MXFP4)

// ---- a token's experts on the device, all in one launch each -----------------------------------
// table: n_slots gate matrices' addresses, then n_slots up, then n_slots down (one expert a
// slot, all of one type and shape), then each slot's first output element in y. experts_hot:
// grid (n_rows / warps, n_slots), h[s, i] = act(gate_s[i] . x, up_s[i] . x) over one row x, as
// ffn_hot computes an expert's row without a predictor or biases. experts_down: grid
// (n_embd / warps, n_slots), y[at_s + r] = down_s[r] . h[s], as matvec computes it.

template <int T>
__device__ void experts_hot(const unsigned long long* table, int n_slots, unsigned long long row_bytes,
                            const float* x, const Q8Act* xq, float* h, int n_rows, int cols, int act) {
    const int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n_rows) return;
    const int s = blockIdx.y;
    const u8* gate = (const u8*)table[s];
    const u8* up = (const u8*)table[n_slots + s];
    float g = warp_dot<T>(gate + (size_t)i * row_bytes, x, xq, cols);
    float u = warp_dot<T>(up + (size_t)i * row_bytes, x, xq, cols);
    if ((threadIdx.x & 31) == 0) h[(size_t)s * n_rows + i] = activate(act, g, u);
}

template <int T>
__device__ void experts_down(const unsigned long long* table, int n_slots, unsigned long long row_bytes,
                             const float* h, const Q8Act* hq, float* y, int rows, int cols) {
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int s = blockIdx.y;
    const u8* w = (const u8*)table[2 * n_slots + s];
    float v = warp_dot<T>(w + (size_t)r * row_bytes, h + (size_t)s * cols, hq + (size_t)s * (cols / 32), cols);
    if ((threadIdx.x & 31) == 0) y[table[3 * n_slots + s] + r] = v;
}

#define EXPERTS(HOT, DOWN, T)                                                                         \
    extern "C" __global__ void HOT(const unsigned long long* table, int n_slots,                      \
                                   unsigned long long row_bytes, const float* x, const Q8Act* xq,     \
                                   float* h, int n_rows, int cols, int act) {                         \
        experts_hot<T>(table, n_slots, row_bytes, x, xq, h, n_rows, cols, act);                       \
    }                                                                                                 \
    extern "C" __global__ void DOWN(const unsigned long long* table, int n_slots,                     \
                                    unsigned long long row_bytes, const float* h, const Q8Act* hq,    \
                                    float* y, int rows, int cols) {                                   \
        experts_down<T>(table, n_slots, row_bytes, h, hq, y, rows, cols);                             \
    }
EXPERTS(experts_hot_f32, experts_down_f32, T_F32)
EXPERTS(experts_hot_f16, experts_down_f16, T_F16)
EXPERTS(experts_hot_q4_0, experts_down_q4_0, T_Q4_0)
EXPERTS(experts_hot_q4_1, experts_down_q4_1, T_Q4_1)
EXPERTS(experts_hot_q8_0, experts_down_q8_0, T_Q8_0)
EXPERTS(experts_hot_q5_0, experts_down_q5_0, T_Q5_0)
EXPERTS(experts_hot_q5_1, experts_down_q5_1, T_Q5_1)
EXPERTS(experts_hot_q2_k, experts_down_q2_k, T_Q2_K)
EXPERTS(experts_hot_q3_k, experts_down_q3_k, T_Q3_K)
EXPERTS(experts_hot_q4_k, experts_down_q4_k, T_Q4_K)
EXPERTS(experts_hot_q5_k, experts_down_q5_k, T_Q5_K)
EXPERTS(experts_hot_q6_k, experts_down_q6_k, T_Q6_K)
EXPERTS(experts_hot_iq4_nl, experts_down_iq4_nl, T_IQ4_NL)
EXPERTS(experts_hot_iq4_xs, experts_down_iq4_xs, T_IQ4_XS)
EXPERTS(experts_hot_mxfp4, experts_down_mxfp4, T_MXFP4)

// ---- sparse axpy of the down projection --------------------------------------------------------
// partial[chunk, c] = sum over rows i of the chunk with h[i] != 0 of h[i] * down_t[i, c].
// grid (ceil(cols / blockDim.x), n_chunks, batch rows): row t reads h[t] (n_hot) and writes
// partial[t] (n_chunks, cols). Each output element has exactly one writer, so no atomics and the
// same order of additions on every run; ffn_merge sums the chunks.

template <int T>
__device__ void down_partial(const u8* down_t, unsigned long long row_bytes, const float* h, int n_hot,
                             int cols, int rows_per_chunk, float* partial) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int chunk = blockIdx.y;
    if (c >= cols) return;
    h += (size_t)blockIdx.z * n_hot;
    partial += (size_t)blockIdx.z * gridDim.y * cols;
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
DOWN_PARTIAL(down_partial_q5_0, T_Q5_0)
DOWN_PARTIAL(down_partial_q5_1, T_Q5_1)
DOWN_PARTIAL(down_partial_q2_k, T_Q2_K)
DOWN_PARTIAL(down_partial_q3_k, T_Q3_K)
DOWN_PARTIAL(down_partial_q4_k, T_Q4_K)
DOWN_PARTIAL(down_partial_q5_k, T_Q5_K)
DOWN_PARTIAL(down_partial_q6_k, T_Q6_K)
DOWN_PARTIAL(down_partial_iq4_nl, T_IQ4_NL)
DOWN_PARTIAL(down_partial_iq4_xs, T_IQ4_XS)
DOWN_PARTIAL(down_partial_mxfp4, T_MXFP4)

// x[c] += sum_k partial[k, c] + cpu_part[c] + bias[c]: the GPU's hot-neuron chunks, the CPU's
// cold neurons and the bias merged into the residual. cpu_part and bias may be null. grid.y the
// batch rows: row t's x, partial (n_chunks, cols) and cpu_part.
extern "C" __global__ void ffn_merge(float* x, const float* partial, int n_chunks, const float* cpu_part,
                                     const float* bias, int cols) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const size_t t = blockIdx.y;
    x += t * cols;
    partial += t * n_chunks * cols;
    if (cpu_part) cpu_part += t * cols;
    float v = 0.0f;
    for (int k = 0; k < n_chunks; k++) v += partial[(size_t)k * cols + c];
    if (cpu_part) v += cpu_part[c];
    if (bias) v += bias[c];
    x[c] += v;
}

// ---- dense layer ops ---------------------------------------------------------------------------

// out = x / sqrt(mean(x^2) + eps) * w; one block. With y, first x += y (the residual add before
// the next norm, as add_into computes it). With q8 (n a multiple of 32), out is also rounded to
// int8 blocks there, as quantize_q8 rounds it: the norm's readers are quantized.
extern "C" __global__ void rmsnorm(float* x, const float* y, const float* w, float* out, Q8Act* q8, int n, float eps) {
    __shared__ float red[32];
    // one block per batch row
    x += (size_t)blockIdx.x * n;
    out += (size_t)blockIdx.x * n;
    if (y) y += (size_t)blockIdx.x * n;
    if (q8) q8 += (size_t)blockIdx.x * (n / 32);
    if (y) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] += y[i] + 0.0f;  // add_into's bits
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, red);
    const float scale = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i] * scale * w[i];
    if (q8) {
        __syncthreads();  // every out[i] written, and visible to the block
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
        for (int b = warp; b < n / 32; b += nwarps) quantize_block(out[b * 32 + lane], lane, q8[b]);
    }
}

// Per-head RMSNorm in place (the q/k norms of Qwen 3 and Gemma 3): head h of x
// (n_heads * head_dim) times 1 / sqrt(mean(x_h^2) + eps), times w (head_dim). One warp per head.
extern "C" __global__ void head_rmsnorm(float* x, const float* w, int n_heads, int head_dim, float eps) {
    const int h = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (h >= n_heads) return;
    const int lane = threadIdx.x & 31;
    float* xh = x + (size_t)h * head_dim;
    float ss = 0.0f;
    for (int d = lane; d < head_dim; d += 32) ss += xh[d] * xh[d];
    const float scale = rsqrtf(warp_sum(ss) / (float)head_dim + eps);
    for (int d = lane; d < head_dim; d += 32) xh[d] = xh[d] * scale * w[d];
}

// x[i] += y[i] (+ bias[i])
extern "C" __global__ void add_into(float* x, const float* y, const float* bias, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i] + (bias ? bias[i] : 0.0f);
}

// Rotary embedding of every head of q (n_head heads of head_dim) and k (n_head_kv) at one
// position, from that position's cos/sin (rope_dim / 2), in one launch. neox = 0 rotates
// (x[2i], x[2i+1]); neox = 1 rotates (x[i], x[i + rope_dim/2]).
extern "C" __global__ void rope(float* q, float* k, const float* cos_t, const float* sin_t, int n_head, int n_head_kv,
                                int head_dim, int rope_dim, int neox) {
    const int half = rope_dim / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (n_head + n_head_kv) * half) return;
    const int t = blockIdx.y;  // the batch row, at its own position's angles
    q += (size_t)t * n_head * head_dim;
    k += (size_t)t * n_head_kv * head_dim;
    cos_t += (size_t)t * half;
    sin_t += (size_t)t * half;
    const int h = idx / half, i = idx % half;
    float* xh = h < n_head ? q + (size_t)h * head_dim : k + (size_t)(h - n_head) * head_dim;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = xh[a], x1 = xh[b], c = cos_t[i], s = sin_t[i];
    xh[a] = x0 * c - x1 * s;
    xh[b] = x0 * s + x1 * c;
}

// Stores one position's k and v (kv_dim each) in the caches, as f32 or f16. The position is
// read from device memory (*pos), as in `attention`, so that a captured graph of the token's
// kernels serves every position.
extern "C" __global__ void kv_store(const float* k, const float* v, void* k_cache, void* v_cache, const int* pos_p,
                                    int kv_dim, int f16) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= kv_dim) return;
    const int t = blockIdx.y;  // batch row t is position *pos + t
    const int pos = *pos_p + t;
    k += (size_t)t * kv_dim;
    v += (size_t)t * kv_dim;
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

// Causal attention of the token at position *pos over positions 0..*pos, or over the last
// `window` of them (a sliding-window layer; 0: all); one block per query head. Query head h reads
// kv head h / (n_head / n_head_kv). Scores are q.k * scale, squashed into
// softcap * tanh(s / softcap) where softcap > 0 (Gemma 2). sinks, if not null, holds a logit per
// query head that joins its softmax with no value (gpt-oss). scores (n_head, n_ctx) is scratch in
// global memory, so the context length is not bounded by shared memory.
extern "C" __global__ void attention(const float* q, const void* k_cache, const void* v_cache, float* scores,
                                     float* out, const int* pos_p, int n_ctx, int n_head, int n_head_kv, int head_dim,
                                     float scale, float softcap, int window, int f16, const float* sinks) {
    __shared__ float red[32];
    const int t = blockIdx.y;  // batch row t is the query at position *pos + t
    const int len = *pos_p + t + 1;
    q += (size_t)t * n_head * head_dim;
    out += (size_t)t * n_head * head_dim;
    scores += (size_t)t * n_head * n_ctx;
    const int first = window > 0 && len > window ? len - window : 0;
    const int h = blockIdx.x;
    const int g = h / (n_head / n_head_kv);
    const int kv_dim = n_head_kv * head_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const float* qh = q + (size_t)h * head_dim;
    float* sh = scores + (size_t)h * n_ctx;

    // scores: one warp per position, lanes across the head
    for (int t = first + warp; t < len; t += nwarps) {
        const size_t base = (size_t)t * kv_dim + (size_t)g * head_dim;
        float s = 0.0f;
        for (int d = lane; d < head_dim; d += 32) s += qh[d] * cache_at(k_cache, base + d, f16);
        s = warp_sum(s) * scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        if (lane == 0) sh[t] = s;
    }
    __syncthreads();

    // softmax over the scores
    float m = -INFINITY;
    for (int t = first + threadIdx.x; t < len; t += blockDim.x) m = fmaxf(m, sh[t]);
    m = block_max(m, red);
    if (sinks) m = fmaxf(m, sinks[h]);
    float sum = 0.0f;
    for (int t = first + threadIdx.x; t < len; t += blockDim.x) {
        const float e = expf(sh[t] - m);
        sh[t] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // its barriers also make every sh[t] visible below
    if (sinks) sum += expf(sinks[h] - m);
    const float inv = 1.0f / sum;

    // out[d] = sum_t p[t] v[t, d]; one thread per head dimension
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int t = first; t < len; t++) acc += sh[t] * cache_at(v_cache, (size_t)t * kv_dim + (size_t)g * head_dim + d, f16);
        out[(size_t)h * head_dim + d] = acc * inv;
    }
}
