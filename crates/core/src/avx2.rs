//! AVX2 + FMA + F16C dot products. Each function is the SIMD twin of a `*_scalar` function in
//! `quant/` with the same signature and is tested against it. They must only be called after
//! `simd::simd_level()` has confirmed the CPU features.
//!
//! One weight row is dotted with N activation rows at once: the weight block is loaded and its
//! nibbles unpacked once, then reused for every token, which is what makes prefill (N = 4)
//! cheaper per token than decode (N = 1).

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use crate::quant::{f16_to_f32, BlockQ4_0, BlockQ4_1, BlockQ8Act, BlockQ8_0, DType};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Every f16 as f32, indexed by its bits (256 KB, built on first use): the axpys broadcast a
/// block's scale straight from it, one load where the conversion takes two shuffles and a
/// convert on the ports their loop is bound by. The scales of one matrix span a few exponents,
/// so the entries read stay in cache.
pub(crate) fn f16_table() -> &'static [f32] {
    static T: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    T.get_or_init(|| (0..=u16::MAX).map(|b| half::f16::from_bits(b).to_f32()).collect())
}

/// An f16 scale broadcast to 8 f32 lanes. The broadcast load writes the whole register; a
/// scalar conversion instead lets the compiler narrow the load into a 16-bit insert that merges
/// into an unrelated (often loop-carried) register, chaining every block to the previous one
/// (measured 2-4x slower).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn splat_f16(bits: u16) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
}

/// Prefetches every line of `next` (the rows a caller reads after this kernel, in turn), spread
/// evenly over a kernel's `steps` (see `matmul::dot_row` for why): after step i, the first
/// (i + 1) * lines / steps lines. Consecutive rows come as one slice; the scattered rows a
/// sparse operator reads next as several. Into L1, or into L2 where `INTO_L2` (see
/// `PrefetchL2`).
pub(crate) struct PrefetchInto<'a, const INTO_L2: bool> {
    /// The rows after `cur`.
    rest: &'a [&'a [u8]],
    /// The row being prefetched, from `line`.
    cur: &'a [u8],
    lines: usize,
    steps: usize,
    line: usize,
    due: usize,
}

/// `PrefetchInto` L1: what a kernel that is near its instruction limit takes, so that its loads
/// find their lines in L1.
pub(crate) type Prefetch<'a> = PrefetchInto<'a, false>;

/// `PrefetchInto` L2, for the dense decode products whose loops read faster than one core's L1
/// misses can bring lines from DRAM (each miss holds one of L1's few miss buffers until its line
/// arrives; L2 has several times as many): the AVX-512 level's dots of every quantized type,
/// and the AVX2 level's (so AVX-VNNI's) Q4_1 and Q8_0. On the 2-core AMD EPYC (Zen 4), 16 copies of a
/// 4096 x 4096 matrix from DRAM on huge pages, the two hints alternating in one process, medians
/// of 15 rounds, L1 -> L2 on two threads: AVX-512 Q4_0 21.2-21.6 -> 26.6-26.7 GB/s, Q4_1
/// 19.2-20.0 -> 22.7-23.2, Q8_0 21.1-21.5 -> 30.4-31.1; AVX2 Q4_1 15.2 -> 17.3-17.7, Q8_0
/// 23.4-23.8 -> 29.4-30.1 (one thread: the same or better everywhere). AVX2's Q4_0, near its
/// instruction limit, moved -12% to +5% between runs, and F16 did not move: they keep L1.
/// A 7B-shape model's decode at AVX-512: Q4_0 1.25x, Q4_K_M and Q8_0 1.15x, IQ4_NL 1.23x,
/// Q5_0 1.08x (docs/performance.md, "Dense decode's prefetch").
pub(crate) type PrefetchL2<'a> = PrefetchInto<'a, true>;

impl<'a, const INTO_L2: bool> PrefetchInto<'a, INTO_L2> {
    pub(crate) fn new(next: &'a [&'a [u8]], steps: usize) -> Self {
        let lines = next.iter().map(|r| r.len().div_ceil(64)).sum();
        let (cur, rest) = next.split_first().map_or((&[][..], &[][..]), |(c, r)| (*c, r));
        PrefetchInto { rest, cur, lines, steps: steps.max(1), line: 0, due: 0 }
    }

    /// The lines due by the end of this step.
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        self.due += self.lines;
        while self.due >= self.steps {
            if 64 * self.line < self.cur.len() {
                // SAFETY: 64 * line < cur.len(), so the address lies within the row
                // (prefetches never fault)
                unsafe {
                    let line = self.cur.as_ptr().add(64 * self.line) as *const i8;
                    if INTO_L2 {
                        _mm_prefetch::<_MM_HINT_T1>(line)
                    } else {
                        _mm_prefetch::<_MM_HINT_T0>(line)
                    }
                };
                self.line += 1;
                self.due -= self.steps;
            } else if let Some((&row, rest)) = self.rest.split_first() {
                (self.cur, self.rest, self.line) = (row, rest, 0);
            } else {
                self.due = 0;
                break;
            }
        }
    }
}

/// How a kernel prefetches the rows its caller reads next, a line per due step (`Prefetch`
/// in order, `PrefetchApart` a line of each row in turn); the kernel's caller picks one.
pub(crate) trait LineFetch<'a> {
    fn new(next: &'a [&'a [u8]], steps: usize) -> Self;
    fn step(&mut self);
}

impl<'a, const INTO_L2: bool> LineFetch<'a> for PrefetchInto<'a, INTO_L2> {
    #[inline(always)]
    fn new(next: &'a [&'a [u8]], steps: usize) -> Self {
        PrefetchInto::new(next, steps)
    }
    #[inline(always)]
    fn step(&mut self) {
        PrefetchInto::step(self)
    }
}

/// `PrefetchInto` for rows that lie apart (a sparse operator's next selected rows): a line of
/// each row in turn, so that their first misses overlap instead of each row's waiting for the
/// one before. (The sparse FFN bench, Q4_0 7B shape, AVX2, 2 threads: the selected gate and up
/// rows read 10% faster; the dense products keep `Prefetch`'s order, one stream, which lost a
/// quarter of their rate when interleaved.) Into L1, or into L2 where `INTO_L2`: for long rows,
/// the kernels whose dense rows go into L2 (`PrefetchL2`) take `PrefetchApartL2`.
pub(crate) struct PrefetchApartInto<'a, const INTO_L2: bool> {
    rows: &'a [&'a [u8]],
    /// Lines asked for per step, against `steps` (as `Prefetch`'s); 0 once all are asked for.
    lines: usize,
    steps: usize,
    due: usize,
    /// The next line: row `row` at byte `offset`. The rows are a matrix's, so equally long:
    /// each is taken as long as the longest (`end` bytes; a hint past a shorter row's end
    /// cannot fault), which spares a bounds test per line (the test and the row's length
    /// were two thirds of the sparse operator's prefetching, a fifth of its dots' instructions).
    row: usize,
    offset: usize,
    end: usize,
}

/// `PrefetchApartInto` L1, for the kernels near their instruction limit (as `Prefetch`).
pub(crate) type PrefetchApart<'a> = PrefetchApartInto<'a, false>;

/// `PrefetchApartInto` L2, for the long rows (`kernels::APART_L2_ROW_BYTES`) of the kernels
/// whose dense rows go into L2 (`PrefetchL2`): where one core's few L1 miss buffers limit what
/// it can have in flight.
pub(crate) type PrefetchApartL2<'a> = PrefetchApartInto<'a, true>;

impl<'a, const INTO_L2: bool> LineFetch<'a> for PrefetchApartInto<'a, INTO_L2> {
    fn new(next: &'a [&'a [u8]], steps: usize) -> Self {
        let row_lines = next.iter().map(|r| r.len().div_ceil(64)).max().unwrap_or(0);
        PrefetchApartInto {
            rows: next,
            lines: row_lines * next.len(),
            steps: steps.max(1),
            due: 0,
            row: 0,
            offset: 0,
            end: 64 * row_lines,
        }
    }

    #[inline(always)]
    fn step(&mut self) {
        self.due += self.lines;
        while self.due >= self.steps {
            // SAFETY: row < rows.len() (it wraps to 0 below, and lines is 0 without rows); a
            // prefetch never faults, wherever it points
            unsafe {
                let line = self.rows.get_unchecked(self.row).as_ptr().wrapping_add(self.offset);
                if INTO_L2 {
                    _mm_prefetch::<_MM_HINT_T1>(line as *const i8)
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(line as *const i8)
                }
            };
            self.due -= self.steps;
            self.row += 1;
            if self.row == self.rows.len() {
                (self.row, self.offset) = (0, self.offset + 64);
                if self.offset == self.end {
                    (self.lines, self.due) = (0, 0);
                }
            }
        }
    }
}

/// Prefetches every line of up to G byte ranges in turn into L2 (the rows a prompt kernel
/// decodes next), spread evenly over `steps` (its passes over the tokens): rows that the
/// kernel reads a few at a time are too short for the hardware prefetchers to catch on.
pub(crate) struct PrefetchRows<'a, const G: usize> {
    rows: [&'a [u8]; G],
    count: usize,
    lines: usize,
    steps: usize,
    row: usize,
    line: usize,
    due: usize,
}

impl<'a, const G: usize> PrefetchRows<'a, G> {
    pub(crate) fn new(rows: impl Iterator<Item = &'a [u8]>, steps: usize) -> Self {
        let mut p = PrefetchRows {
            rows: [&[][..]; G],
            count: 0,
            lines: 0,
            steps: steps.max(1),
            row: 0,
            line: 0,
            due: 0,
        };
        for r in rows.take(G) {
            p.rows[p.count] = r;
            p.lines += r.len().div_ceil(64);
            p.count += 1;
        }
        p
    }

    /// The lines due by the end of this step.
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        self.due += self.lines;
        while self.due >= self.steps && self.row < self.count {
            let row = self.rows[self.row];
            // SAFETY: 64 * line < row.len(), so the address lies within the row (prefetches never fault)
            unsafe { _mm_prefetch::<_MM_HINT_T1>(row.as_ptr().add(64 * self.line) as *const i8) };
            self.line += 1;
            if 64 * self.line >= row.len() {
                (self.row, self.line) = (self.row + 1, 0);
            }
            self.due -= self.steps;
        }
    }
}

/// 16 bytes of packed nibbles to 32 unsigned bytes in ggml's element order (low nibbles first).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_nibbles(qs: &[u8; 16]) -> __m256i {
    // the bytes in both halves (a load), the upper half's shifted down a nibble: one shift and
    // one mask for the 32 weights (splitting the halves apart and joining them cost two more
    // operations; AVX2 Q4_0 decode on 2 threads of the AMD EPYC, from cache: 11008 x 512
    // 24-25 -> 28-29 GB/s, 4096 x 4096 27-32 -> 31-33)
    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs.as_ptr() as *const __m128i));
    let shifted = _mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
}

/// The 256-bit VNNI instructions in one of their encodings (`simd::Vnni256`), or none
/// (`NoVnni`: AVX2's `vpmaddubsw`). A kernel that takes them is written once over this trait and
/// compiled once per encoding, each copy behind a wrapper that enables that encoding's features
/// (the instructions inline only into functions compiled for them).
pub(crate) trait Dp256 {
    /// Whether the kernel takes these instructions (false: `NoVnni`, never called).
    const ON: bool = true;
    /// src plus, in each 32-bit lane, the four products of u's unsigned bytes with a's signed
    /// ones in that lane (exact: no saturation).
    unsafe fn dpbusd(src: __m256i, u: __m256i, a: __m256i) -> __m256i;
    /// src plus, in each 32-bit lane, the two products of a's and b's signed 16-bit halves.
    unsafe fn dpwssd(src: __m256i, a: __m256i, b: __m256i) -> __m256i;
}

/// AVX-VNNI's VEX encoding.
pub(crate) struct Vex;
impl Dp256 for Vex {
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn dpbusd(src: __m256i, u: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(src, u, a)
    }
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn dpwssd(src: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpwssd_avx_epi32(src, a, b)
    }
}

/// AVX-512 VL's EVEX encoding of the same instructions.
pub(crate) struct Evex;
impl Dp256 for Evex {
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    unsafe fn dpbusd(src: __m256i, u: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(src, u, a)
    }
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    unsafe fn dpwssd(src: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpwssd_epi32(src, a, b)
    }
}

/// No VNNI: the kernels' `vpmaddubsw` path.
pub(crate) struct NoVnni;
impl Dp256 for NoVnni {
    const ON: bool = false;
    unsafe fn dpbusd(_: __m256i, _: __m256i, _: __m256i) -> __m256i {
        unreachable!("NoVnni has no vpdpbusd")
    }
    unsafe fn dpwssd(_: __m256i, _: __m256i, _: __m256i) -> __m256i {
        unreachable!("NoVnni has no vpdpwssd")
    }
}

/// A 32-weight block format read by `dot_legacy` and the prompts' row groups
/// (`q32_x86::legacy_rows_all_tokens`): signed weights v times one f16 scale (Q4_0's q - 8,
/// Q5_0's q - 16, Q8_0, IQ4_NL's grid values), or with `MIN` unsigned q times the scale plus an
/// f16 minimum (Q4_1, Q5_1).
pub(crate) trait LegacyBlock {
    /// Whether w = d q + m (q unsigned); else w = d v (v signed).
    const MIN: bool = false;
    /// Whether a row group's eight steps of pair sums may overflow 16 bits (|v| up to 127, or
    /// q up to 31): then pairs widen to 32 bits before they are added.
    const WIDE: bool = false;
    /// Whether `scale_bits` is an f16 (else `scale` reads the block's own format: MXFP4).
    const F16_SCALE: bool = true;
    fn scale_bits(&self) -> u16;
    fn min_bits(&self) -> u16 {
        0
    }
    /// The block's scale d.
    #[inline]
    fn scale(&self) -> f32 {
        f16_to_f32(self.scale_bits())
    }
    /// A constant c where the signed weights are v = q - c for unsigned q (`unsigned`):
    /// the one-token kernel then multiplies q unsigned by the activations and subtracts c times
    /// their pair sums, the same 16-bit pair sums as v's in one multiply and one subtraction
    /// per row instead of v's three operations; 0 where there is no such form.
    const OFFSET: i32 = 0;
    /// With `OFFSET`, the block's q as bytes, in element order.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn unsigned(&self) -> __m256i {
        self.weights()
    }
    /// The block's 32 weights (v signed, or q with `MIN`) as bytes, in element order.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn weights(&self) -> __m256i;
}

impl LegacyBlock for BlockQ4_0 {
    const OFFSET: i32 = 8;
    fn scale_bits(&self) -> u16 {
        self.d
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(&self) -> __m256i {
        _mm256_sub_epi8(unpack_nibbles(&self.qs), _mm256_set1_epi8(8))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unsigned(&self) -> __m256i {
        unpack_nibbles(&self.qs)
    }
}

impl LegacyBlock for BlockQ8_0 {
    const WIDE: bool = true;
    fn scale_bits(&self) -> u16 {
        self.d
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(&self) -> __m256i {
        _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i)
    }
}

impl LegacyBlock for BlockQ4_1 {
    const MIN: bool = true;
    fn scale_bits(&self) -> u16 {
        self.d
    }

    fn min_bits(&self) -> u16 {
        self.m
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(&self) -> __m256i {
        unpack_nibbles(&self.qs)
    }
}

/// R rows of a `LegacyBlock` format against N tokens (decode groups rows so that they share
/// the activations' loads); the twins are the formats' scalar dots. Signed weights go in as
/// Q8_0's do, |v| times the activations with v's sign, so Q4_0's and Q5_0's offsets stay in
/// the integer sum. A block's products sum exactly in integers, then one float step per block,
/// row and token: acc = fma(sum, d * d_a, acc), and with minima min = fma(m, s_a, min) (s_a:
/// the activations' scaled sum), the result acc (+ min): the steps the prompts' row groups
/// (`q32_x86::legacy_rows_all_tokens`) take in each lane, so that a token's dot is bit for
/// bit the same in a prompt as alone.
///
/// With 256-bit VNNI (`simd::vnni256`), four rows' block sums come from `vpdpbusd` straight
/// into 32 bits (an offset format's c times the activations starting the lanes): fewer
/// instructions for the same exact sums, so the same results (4096 x 4096 Q4_0 products on one
/// thread of the AMD EPYC, in the EVEX form, 0-10% faster; docs/performance.md).
pub(crate) unsafe fn dot_legacy<
    'n,
    B: LegacyBlock,
    P: LineFetch<'n>,
    const R: usize,
    const N: usize,
>(
    w: [&[B]; R],
    a: [&[BlockQ8Act]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    dot_legacy_in::<B, P, R, N>(crate::simd::vnni256(crate::simd::SimdLevel::Avx2), w, a, next)
}

/// `dot_legacy` with 256-bit VNNI in the given encoding, or without.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C, and the encoding's features.
pub(crate) unsafe fn dot_legacy_in<
    'n,
    B: LegacyBlock,
    P: LineFetch<'n>,
    const R: usize,
    const N: usize,
>(
    vnni: Option<crate::simd::Vnni256>,
    w: [&[B]; R],
    a: [&[BlockQ8Act]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    use crate::simd::Vnni256;
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn plain<'n, B: LegacyBlock, P: LineFetch<'n>, const R: usize, const N: usize>(
        w: [&[B]; R],
        a: [&[BlockQ8Act]; N],
        next: &'n [&'n [u8]],
    ) -> [[f32; N]; R] {
        legacy_rows_dot::<B, P, NoVnni, R, N>(w, a, next)
    }
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn vex<'n, B: LegacyBlock, P: LineFetch<'n>, const R: usize, const N: usize>(
        w: [&[B]; R],
        a: [&[BlockQ8Act]; N],
        next: &'n [&'n [u8]],
    ) -> [[f32; N]; R] {
        legacy_rows_dot::<B, P, Vex, R, N>(w, a, next)
    }
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn evex<'n, B: LegacyBlock, P: LineFetch<'n>, const R: usize, const N: usize>(
        w: [&[B]; R],
        a: [&[BlockQ8Act]; N],
        next: &'n [&'n [u8]],
    ) -> [[f32; N]; R] {
        legacy_rows_dot::<B, P, Evex, R, N>(w, a, next)
    }
    match vnni {
        None => plain::<B, P, R, N>(w, a, next),
        Some(Vnni256::Vex) => vex::<B, P, R, N>(w, a, next),
        Some(Vnni256::Evex) => evex::<B, P, R, N>(w, a, next),
    }
}

/// `dot_legacy`'s loop with the VNNI instructions of V (compiled into each wrapper).
#[inline(always)]
unsafe fn legacy_rows_dot<
    'n,
    B: LegacyBlock,
    P: LineFetch<'n>,
    V: Dp256,
    const R: usize,
    const N: usize,
>(
    w: [&[B]; R],
    a: [&[BlockQ8Act]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    let mut prefetch = P::new(next, w[0].len());
    let (mut acc, mut mins) = ([[0.0f32; N]; R], [[0.0f32; N]; R]);
    // four rows: their float steps side by side in the lanes of one vector per token
    let (mut acc4, mut mins4) = ([_mm_setzero_ps(); N], [_mm_setzero_ps(); N]);
    for i in 0..w[0].len() {
        prefetch.step();
        let mut u = [_mm256_setzero_si256(); R];
        let mut v = [_mm256_setzero_si256(); R];
        for r in 0..R {
            if B::OFFSET > 0 {
                u[r] = w[r].get_unchecked(i).unsigned();
            } else {
                v[r] = w[r].get_unchecked(i).weights();
                u[r] = if B::MIN { v[r] } else { _mm256_sign_epi8(v[r], v[r]) };
            }
        }
        // (written out: a closure would not be compiled for these features)
        let (mut d4, mut m4) = (_mm_setzero_ps(), _mm_setzero_ps());
        if R == 4 {
            let b = [
                w[0].get_unchecked(i),
                w[1].get_unchecked(i),
                w[2].get_unchecked(i),
                w[3].get_unchecked(i),
            ];
            d4 = match B::F16_SCALE {
                true => _mm_cvtph_ps(_mm_setr_epi16(
                    b[0].scale_bits() as i16,
                    b[1].scale_bits() as i16,
                    b[2].scale_bits() as i16,
                    b[3].scale_bits() as i16,
                    0,
                    0,
                    0,
                    0,
                )),
                false => _mm_setr_ps(b[0].scale(), b[1].scale(), b[2].scale(), b[3].scale()),
            };
            if B::MIN {
                m4 = _mm_cvtph_ps(_mm_setr_epi16(
                    b[0].min_bits() as i16,
                    b[1].min_bits() as i16,
                    b[2].min_bits() as i16,
                    b[3].min_bits() as i16,
                    0,
                    0,
                    0,
                    0,
                ));
            }
        }
        for j in 0..N {
            let ab = a[j].get_unchecked(i);
            let q = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            if V::ON && R == 4 {
                // each row's block sum in 32-bit lanes by `vpdpbusd`: an offset format's lanes
                // start at -c times the activations (c a summed by the same instruction)
                let zero = _mm256_setzero_si256();
                let start = if B::OFFSET > 0 {
                    _mm256_sub_epi32(zero, V::dpbusd(zero, _mm256_set1_epi8(B::OFFSET as i8), q))
                } else {
                    zero
                };
                let mut p = [zero; 4];
                for r in 0..4 {
                    let x = if B::OFFSET > 0 || B::MIN { q } else { _mm256_sign_epi8(q, v[r]) };
                    p[r] = V::dpbusd(start, u[r], x);
                }
                let sums = hsum4_i32(p);
                acc4[j] =
                    _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(d4, _mm_set1_ps(ab.d)), acc4[j]);
                if B::MIN {
                    mins4[j] = _mm_fmadd_ps(m4, _mm_set1_ps(ab.s), mins4[j]);
                }
                continue;
            }
            // pair sums of |v| * a <= 2 * 16 * 127 (q * a <= 2 * 31 * 127): a row's 16 of them
            // sum in 16 bits by fours (`WIDE` formats' in 32 bits)
            let mut p = [_mm256_setzero_si256(); R];
            if B::OFFSET > 0 {
                // (q - c) a = q a - c a per pair: |c a| pairs <= 2 * 16 * 127, no overflow
                let c_a = _mm256_mullo_epi16(
                    _mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
                    _mm256_set1_epi16(B::OFFSET as i16),
                );
                for r in 0..R {
                    p[r] = _mm256_sub_epi16(_mm256_maddubs_epi16(u[r], q), c_a);
                }
            } else {
                for r in 0..R {
                    p[r] = _mm256_maddubs_epi16(
                        u[r],
                        if B::MIN { q } else { _mm256_sign_epi8(q, v[r]) },
                    );
                }
            }
            if R == 4 {
                let sums = if B::WIDE {
                    row_sums4_i32([p[0], p[1], p[2], p[3]])
                } else {
                    row_sums4_i16([p[0], p[1], p[2], p[3]])
                };
                acc4[j] =
                    _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(d4, _mm_set1_ps(ab.d)), acc4[j]);
                if B::MIN {
                    mins4[j] = _mm_fmadd_ps(m4, _mm_set1_ps(ab.s), mins4[j]);
                }
            } else {
                for r in 0..R {
                    let b = w[r].get_unchecked(i);
                    let sum = _mm_cvtsi32_ss(_mm_setzero_ps(), hsum_i16(p[r]));
                    let dd = _mm_set_ss(b.scale() * ab.d);
                    acc[r][j] = _mm_cvtss_f32(_mm_fmadd_ss(sum, dd, _mm_set_ss(acc[r][j])));
                    if B::MIN {
                        mins[r][j] = _mm_cvtss_f32(_mm_fmadd_ss(
                            _mm_set_ss(f16_to_f32(b.min_bits())),
                            _mm_set_ss(ab.s),
                            _mm_set_ss(mins[r][j]),
                        ));
                    }
                }
            }
        }
    }
    if R == 4 {
        for j in 0..N {
            let (mut lanes, mut m) = ([0.0f32; 4], [0.0f32; 4]);
            _mm_storeu_ps(lanes.as_mut_ptr(), acc4[j]);
            _mm_storeu_ps(m.as_mut_ptr(), mins4[j]);
            for r in 0..R {
                (acc[r][j], mins[r][j]) = (lanes[r], m[r]);
            }
        }
    }
    if B::MIN {
        for r in 0..R {
            for j in 0..N {
                acc[r][j] += mins[r][j];
            }
        }
    }
    acc
}

/// The sums of four vectors' 16-bit lanes (each sum within 16 bits by fours), as the four 32-bit
/// lanes of one (exact): two rounds of `vphaddw` and one `vpmaddwd`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_sums4_i16(p: [__m256i; 4]) -> __m128i {
    let h = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
    let s = _mm256_madd_epi16(h, _mm256_set1_epi16(1));
    _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
}

/// `row_sums4_i16` for 16-bit lanes whose pairs may not sum within 16 bits: pairs widen to
/// 32 bits first (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_sums4_i32(p: [__m256i; 4]) -> __m128i {
    let ones = _mm256_set1_epi16(1);
    hsum4_i32([
        _mm256_madd_epi16(p[0], ones),
        _mm256_madd_epi16(p[1], ones),
        _mm256_madd_epi16(p[2], ones),
        _mm256_madd_epi16(p[3], ones),
    ])
}

/// The sum of sixteen 16-bit lanes, as i32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i16(p: __m256i) -> i32 {
    hsum_i32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

/// The lane sums of four vectors of 32-bit lanes, as the four lanes of one (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum4_i32(v: [__m256i; 4]) -> __m128i {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

/// The sum of eight 32-bit lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum_i32(v: __m256i) -> i32 {
    let x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let x = _mm_add_epi32(x, _mm_unpackhi_epi64(x, x));
    _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32::<0b01>(x)))
}

/// Loads 8 weights of a float type as f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8(dtype: DType, w: *const u8, k: usize) -> __m256 {
    match dtype {
        DType::F32 => _mm256_loadu_ps((w as *const f32).add(k)),
        DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128((w as *const u16).add(k) as *const __m128i)),
        // bf16 is the top half of an f32: widen and shift left by 16.
        _ => {
            let h = _mm_loadu_si128((w as *const u16).add(k) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_float<const N: usize>(
    dtype: DType,
    w: &[u8],
    a: [&[f32]; N],
    next: &[&[u8]],
) -> [f32; N] {
    let n = a[0].len();
    debug_assert_eq!(w.len(), dtype.row_bytes(n));
    let mut acc = [_mm256_setzero_ps(); N];
    let wp = w.as_ptr();
    let n8 = n / 8 * 8;
    // the next row (float rows go one per call) is prefetched a line per 64 bytes of this
    // row (see `matmul::dot_row`): a test per step, cheaper than `Prefetch`'s count in a loop
    // of one load and N fused multiply-adds. Only the first of `next`: a selection's last
    // call passes the up to four rows its caller reads next.
    let next = next.first().copied().unwrap_or(&[]);
    let eb = dtype.block_bytes();
    let mut k = 0;
    while k < n8 {
        if (k * eb).is_multiple_of(64) && k * eb < next.len() {
            _mm_prefetch::<_MM_HINT_T0>(next.as_ptr().add(k * eb) as *const i8);
        }
        let wv = load8(dtype, wp, k);
        for j in 0..N {
            acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[j].as_ptr().add(k)), acc[j]);
        }
        k += 8;
    }
    let mut out = [0.0f32; N];
    for j in 0..N {
        out[j] = hsum(acc[j]);
    }
    if n8 < n {
        let mut tail = vec![0.0f32; n - n8];
        crate::quant::dequantize_row(dtype, &w[n8 * eb..], &mut tail);
        for j in 0..N {
            out[j] += tail.iter().zip(&a[j][n8..]).map(|(x, y)| x * y).sum::<f32>();
        }
    }
    out
}

/// SIMD twin of `quantize_act`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_act(x: &[f32], out: &mut [BlockQ8Act]) {
    let sign_mask = _mm256_set1_ps(-0.0);
    for (blk, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let p = blk.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let mut m = _mm256_andnot_ps(sign_mask, v[0]);
        for vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, *vi));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let amax = _mm_cvtss_f32(m4);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        // Round half away from zero, like `f32::round` in the scalar twin.
        let mut q = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let s = _mm256_mul_ps(v[k], id);
            let half_signed = _mm256_or_ps(_mm256_and_ps(s, sign_mask), _mm256_set1_ps(0.5));
            q[k] = _mm256_cvttps_epi32(_mm256_add_ps(s, half_signed));
        }
        let sum_v = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(sum_v), _mm256_extracti128_si256(sum_v, 1));
        let s4 = _mm_hadd_epi32(s4, s4);
        let s4 = _mm_hadd_epi32(s4, s4);
        let sum = _mm_cvtsi128_si32(s4);
        // Pack 32 x i32 to 32 x i8; packs interleave 128-bit lanes, the permute restores order.
        let p16a = _mm256_packs_epi32(q[0], q[1]);
        let p16b = _mm256_packs_epi32(q[2], q[3]);
        let p8 = _mm256_packs_epi16(p16a, p16b);
        let p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, p8);
        o.d = d;
        o.s = d * sum as f32;
    }
}

/// 8 cache elements starting at element `idx`, as f32 (the cache holds f32, or f16 bits when
/// `F16`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8_kv<const F16: bool>(base: *const u8, idx: usize) -> __m256 {
    if F16 {
        _mm256_cvtph_ps(_mm_loadu_si128((base as *const u16).add(idx) as *const __m128i))
    } else {
        _mm256_loadu_ps((base as *const f32).add(idx))
    }
}

/// f32 to f16 bits (round to nearest even), 8 at a time. Twin of `quant::f32_to_f16`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f32_to_f16_row(src: &[f32], dst: &mut [u16]) {
    let n = src.len().min(dst.len());
    let mut k = 0;
    while k + 8 <= n {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(k)));
        _mm_storeu_si128(dst.as_mut_ptr().add(k) as *mut __m128i, h);
        k += 8;
    }
    for i in k..n {
        dst[i] = crate::quant::f32_to_f16(src[i]);
    }
}

/// Scores of the G query heads that share one KV head: `qs` holds them back to back (G x hd),
/// and `scores[h * n + j]` = scale * dot(q_h, row j) for rows 0..n. Each cache row is loaded
/// (and converted from f16) once for all G heads, and rows go in blocks (4 for up to 3 heads,
/// 2 for up to 6), so the horizontal sums at the end are shared by a block.
/// Twin of `attention::group_scores_scalar`.
///
/// Safety: the cache must hold `(n - 1) * stride + offset + hd` elements, hd a multiple of 8,
/// `qs.len() == G * hd` and `scores.len() == G * n`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attn_scores_group<const F16: bool, const G: usize>(
    qs: &[f32],
    cache: *const u8,
    stride: usize,
    offset: usize,
    scale: f32,
    n: usize,
    scores: &mut [f32],
) {
    let mut j = 0;
    if G <= 3 {
        while j + 4 <= n {
            scores_block::<F16, G, 4>(qs, cache, stride, offset, scale, n, scores, j);
            j += 4;
        }
    } else if G <= 6 {
        while j + 2 <= n {
            scores_block::<F16, G, 2>(qs, cache, stride, offset, scale, n, scores, j);
            j += 2;
        }
    }
    while j < n {
        scores_block::<F16, G, 1>(qs, cache, stride, offset, scale, n, scores, j);
        j += 1;
    }
}

/// Rows j0..j0 + R of `attn_scores_group`: G x R accumulators. A score's bits do not depend
/// on R (its eight lane sums, then the same `hsum4` tree), so a pass of any width, and
/// `avx512::attn_scores_group`'s wider ones, give the same scores.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn scores_block<const F16: bool, const G: usize, const R: usize>(
    qs: &[f32],
    cache: *const u8,
    stride: usize,
    offset: usize,
    scale: f32,
    n: usize,
    scores: &mut [f32],
    j0: usize,
) {
    let hd = qs.len() / G;
    let qp = qs.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); R]; G];
    let mut d = 0;
    while d < hd {
        let mut k = [_mm256_setzero_ps(); R];
        for (r, x) in k.iter_mut().enumerate() {
            *x = load8_kv::<F16>(cache, (j0 + r) * stride + offset + d);
        }
        for (h, a) in acc.iter_mut().enumerate() {
            let q = _mm256_loadu_ps(qp.add(h * hd + d));
            for r in 0..R {
                a[r] = _mm256_fmadd_ps(q, k[r], a[r]);
            }
        }
        d += 8;
    }
    for (h, a) in acc.iter().enumerate() {
        for r0 in (0..R).step_by(4) {
            let m = (R - r0).min(4);
            let mut four = [_mm256_setzero_ps(); 4];
            four[..m].copy_from_slice(&a[r0..r0 + m]);
            let mut sums = [0f32; 4];
            _mm_storeu_ps(sums.as_mut_ptr(), _mm_mul_ps(hsum4(four), _mm_set1_ps(scale)));
            scores[h * n + j0 + r0..h * n + j0 + r0 + m].copy_from_slice(&sums[..m]);
        }
    }
}

/// The lane sums of four vectors, as one 4-lane vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum4(v: [__m256; 4]) -> __m128 {
    // pairs within each 128-bit half, then the halves: lanes [v0, v1, v2, v3] (low and high)
    let h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1))
}

/// e^x in 8 lanes: x = n ln 2 + r with |r| <= ln 2 / 2, e^r from Cephes' degree-6 polynomial,
/// 2^n built in the exponent bits. Relative error about 2e-7 where e^x is a normal float;
/// below -87.3 the result is 0, which is what a softmax wants of scores far below the maximum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp_ps(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.376_26)), _mm256_set1_ps(88.376_26));
    let n = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    // r = x - n ln 2, with ln 2 in two parts so the product is exact
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let pow2n =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n))
}

/// `sparse::tiled_axpy_scalar` for T tokens in 8 lanes: each 8-column tile of the T tokens'
/// rows of y stays in registers while the neurons go by, one load of a neuron's tile serving
/// every token (one fused multiply-add per neuron and value, in order: the twin's bits).
/// Only columns 0..cols (a multiple of 8, at most `width`). Safety: the CPU has AVX2; `y` holds
/// T rows `stride` apart at least `cols` long, `w` holds `neurons.len()` rows of `width`, `ht`
/// rows of n with t0 + T <= n.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tiled_axpy<const T: usize>(
    w: &[f32],
    width: usize,
    cols: usize,
    ht: &[f32],
    n: usize,
    neurons: &[u32],
    t0: usize,
    y: *mut f32,
    stride: usize,
) {
    debug_assert!(
        cols.is_multiple_of(8) && cols <= width && w.len() >= neurons.len() * width && t0 + T <= n
    );
    for c in (0..cols).step_by(8) {
        let mut acc = [_mm256_setzero_ps(); T];
        for t in 0..T {
            acc[t] = _mm256_loadu_ps(y.add(t * stride + c));
        }
        for (k, &j) in neurons.iter().enumerate() {
            let wv = _mm256_loadu_ps(w.as_ptr().add(k * width + c));
            let h = ht.as_ptr().add(j as usize * n + t0);
            for t in 0..T {
                acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*h.add(t)), wv, acc[t]);
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(y.add(t * stride + c), acc[t]);
        }
    }
}

/// `activation::exp_poly` in 8 lanes, step for step (no fused multiply-adds), so the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp_poly_ps(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.376_26)), _mm256_set1_ps(88.376_26));
    let t = _mm256_add_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _mm256_set1_ps(0.5),
    );
    let n = _mm256_floor_ps(t);
    let r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693_359_4)));
    let r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.121_944_4e-4)));
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in crate::activation::EXP_POLY {
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
    }
    y = _mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let pow2n =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n))
}

/// gate[i] = silu(gate[i]) * up[i] (GELU's tanh approximation where `gelu`; without `up`,
/// silu(gate[i]) alone), 8 neurons at a time: `FfnActivation::apply`'s and `gate_part`'s
/// arithmetic (`activation::silu`, `activation::gelu`) to the bit. Safety: the CPU has AVX2;
/// `up`, if given, is as long as `gate`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn activate(gelu: bool, gate: &mut [f32], up: Option<&[f32]>) {
    let n = up.map_or(gate.len(), |u| gate.len().min(u.len()));
    let g = gate.as_mut_ptr();
    let one = _mm256_set1_ps(1.0);
    let lane = |x: __m256| {
        // the exponent: -x for SiLU, -2 sqrt(2 / pi) (x + 0.044715 x^3) for GELU
        let e = if gelu {
            let cube = _mm256_mul_ps(
                x,
                _mm256_add_ps(one, _mm256_mul_ps(_mm256_set1_ps(0.044715), _mm256_mul_ps(x, x))),
            );
            _mm256_mul_ps(_mm256_set1_ps(crate::activation::MINUS_2_SQRT_2_OVER_PI), cube)
        } else {
            _mm256_xor_ps(x, _mm256_set1_ps(-0.0))
        };
        _mm256_div_ps(x, _mm256_add_ps(one, exp_poly_ps(e)))
    };
    let body = n & !7;
    for i in (0..body).step_by(8) {
        let mut h = lane(_mm256_loadu_ps(g.add(i)));
        if let Some(u) = up {
            h = _mm256_mul_ps(h, _mm256_loadu_ps(u.as_ptr().add(i)));
        }
        _mm256_storeu_ps(g.add(i), h);
    }
    for i in body..n {
        let x = *g.add(i);
        let h = if gelu { crate::activation::gelu(x) } else { crate::activation::silu(x) };
        *g.add(i) = up.map_or(h, |u| h * u[i]);
    }
}

/// row[i] = e^(row[i] - max), in place; returns (max, sum of the new row). Twin of
/// `attention::exp_shifted_scalar` (the library's exp, one running sum): they agree to about
/// 1e-6 relative, plus the sum's rounding, which grows with the row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn exp_shifted(row: &mut [f32]) -> (f32, f32) {
    let n = row.len();
    if n == 0 {
        return (f32::NEG_INFINITY, 0.0);
    }
    let p = row.as_mut_ptr();
    let body = n & !7;
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..body).step_by(8) {
        vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p.add(i)));
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
    let max = lanes.iter().chain(&row[body..]).copied().fold(f32::NEG_INFINITY, f32::max);
    let vm = _mm256_set1_ps(max);
    let mut vsum = _mm256_setzero_ps();
    for i in (0..body).step_by(8) {
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
        _mm256_storeu_ps(p.add(i), e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if body < n {
        // the tail through the same exp, padded with -inf (e^-inf = 0)
        let mut tail = [f32::NEG_INFINITY; 8];
        tail[..n - body].copy_from_slice(&row[body..]);
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), vm));
        _mm256_storeu_ps(tail.as_mut_ptr(), e);
        row[body..].copy_from_slice(&tail[..n - body]);
        vsum = _mm256_add_ps(vsum, e);
    }
    (max, hsum(vsum))
}

/// `out[h]` (hd each, back to back) = sum_j weights[h * n + j] * row j, for the G heads sharing
/// one KV head; each value row is loaded once for all of them. The dims go in passes as wide as
/// the registers allow (32 for up to 3 heads, else 16), so a long cache is swept as few times
/// as possible. Twin of `attention::group_weighted_sum_scalar`. Safety: as for
/// `attn_scores_group`, with hd a multiple of 16 and `out.len() == G * hd`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attn_weighted_sum_group<const F16: bool, const G: usize>(
    weights: &[f32],
    cache: *const u8,
    stride: usize,
    offset: usize,
    n: usize,
    out: &mut [f32],
) {
    let hd = out.len() / G;
    let mut d0 = 0;
    if G <= 3 {
        while d0 + 32 <= hd {
            weighted_sum_pass::<F16, G, 4>(weights, cache, stride, offset + d0, n, out, hd, d0);
            d0 += 32;
        }
    }
    while d0 < hd {
        weighted_sum_pass::<F16, G, 2>(weights, cache, stride, offset + d0, n, out, hd, d0);
        d0 += 16;
    }
}

/// Dims d0..d0 + 8P of `attn_weighted_sum_group`: G x P accumulators. Each output value is one
/// chain of multiply-adds over the rows in order, whatever P.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn weighted_sum_pass<const F16: bool, const G: usize, const P: usize>(
    weights: &[f32],
    cache: *const u8,
    stride: usize,
    at: usize,
    n: usize,
    out: &mut [f32],
    hd: usize,
    d0: usize,
) {
    let wp = weights.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); P]; G];
    for j in 0..n {
        let base = j * stride + at;
        let mut v = [_mm256_setzero_ps(); P];
        for (p, x) in v.iter_mut().enumerate() {
            *x = load8_kv::<F16>(cache, base + 8 * p);
        }
        for (h, a) in acc.iter_mut().enumerate() {
            let w = _mm256_broadcast_ss(&*wp.add(h * n + j));
            for p in 0..P {
                a[p] = _mm256_fmadd_ps(w, v[p], a[p]);
            }
        }
    }
    for (h, a) in acc.iter().enumerate() {
        for (p, x) in a.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(h * hd + d0 + 8 * p), *x);
        }
    }
}

/// 32 signed bytes to four vectors of 8 f32 lanes, in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn i8x32_to_f32x4(q: __m256i) -> [__m256; 4] {
    halves_to_f32x4(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1))
}

/// Elements 0..16 (`lo`) and 16..32 (`hi`) as signed bytes to four vectors of 8 f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves_to_f32x4(lo: __m128i, hi: __m128i) -> [__m256; 4] {
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
    ]
}

/// 16 bytes of packed nibbles to four vectors of 8 f32 lanes (0..16) in element order. Each half
/// of the bytes is widened to 32-bit lanes as it is loaded (one shuffle per 8 bytes), and both
/// of its nibbles come out of those lanes with a mask or a shift: elements 0..8 and 16..24 from
/// bytes 0..8, 8..16 and 24..32 from bytes 8..16. (Splitting the nibbles in bytes first and
/// widening afterwards costs three shuffles more per block, and the vector ports bound this
/// loop.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles_to_f32x4(qs: &[u8; 16]) -> [__m256; 4] {
    let b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.as_ptr() as *const __m128i));
    let b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.as_ptr().add(8) as *const __m128i));
    let mask = _mm256_set1_epi32(0x0F);
    [
        _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)),
        _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)),
        _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)),
        _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)),
    ]
}

/// 32 signed bytes in memory to four vectors of 8 f32 lanes, each 8 bytes widened as loaded.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x32_mem_to_f32x4(qs: &[i8; 32]) -> [__m256; 4] {
    let p = qs.as_ptr() as *const __m128i;
    let w = |k: usize| {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
            (p as *const i8).add(8 * k) as *const __m128i
        )))
    };
    [w(0), w(1), w(2), w(3)]
}

/// y += sum over r of a[r] * rows[r]: R neurons' down_t rows at once, so each block of y is
/// loaded and stored once per R rows instead of once per row; `next` (the rows read after
/// these) is prefetched a line at a time over the blocks (see `matmul::dot_row`). SIMD twin of
/// R calls of `quant::axpy_scalar`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_rows<const R: usize>(
    dtype: DType,
    rows: [&[u8]; R],
    a: [f32; R],
    y: &mut [f32],
    next: &[&[u8]],
) {
    let n = y.len();
    let yp = y.as_mut_ptr();
    let mut av = [_mm256_setzero_ps(); R];
    for r in 0..R {
        av[r] = _mm256_set1_ps(a[r]);
    }
    let f16s = f16_table().as_ptr();
    // `$decode` the block's 32 weights as floats (`q`, before any offset), `$a` the row's coefficient,
    // `$s` that times the block's scale; with `$has_offset`, `$offset` the offsets summed over
    // the rows (`$off`, per block), added once per element after the rows' products
    macro_rules! quantized {
        ($block:ty, |$b:ident, $a:ident, $s:ident, $off:ident| $decode:expr, $has_offset:expr, $offset:expr) => {{
            let blocks = rows.map(|r| crate::quant::cast_blocks::<$block>(r));
            let mut prefetch = Prefetch::new(next, n / 32);
            for i in 0..n / 32 {
                prefetch.step();
                let p = yp.add(32 * i);
                let mut acc = [
                    _mm256_loadu_ps(p),
                    _mm256_loadu_ps(p.add(8)),
                    _mm256_loadu_ps(p.add(16)),
                    _mm256_loadu_ps(p.add(24)),
                ];
                let mut $off = _mm256_setzero_ps();
                for r in 0..R {
                    let ($b, $a) = (blocks[r].get_unchecked(i), av[r]);
                    let w = $decode;
                    let $s = _mm256_mul_ps($a, _mm256_broadcast_ss(&*f16s.add($b.d as usize)));
                    for k in 0..4 {
                        acc[k] = _mm256_fmadd_ps(w[k], $s, acc[k]);
                    }
                    if $has_offset {
                        $off = $offset;
                    }
                }
                for k in 0..4 {
                    let v = if $has_offset { _mm256_add_ps(acc[k], $off) } else { acc[k] };
                    _mm256_storeu_ps(p.add(8 * k), v);
                }
            }
        }};
    }
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {
            let n8 = n / 8 * 8;
            let mut prefetch = Prefetch::new(next, n8 / 8);
            let mut k = 0;
            while k < n8 {
                prefetch.step();
                let p = yp.add(k);
                let mut acc = _mm256_loadu_ps(p);
                for r in 0..R {
                    acc = _mm256_fmadd_ps(load8(dtype, rows[r].as_ptr(), k), av[r], acc);
                }
                _mm256_storeu_ps(p, acc);
                k += 8;
            }
            if n8 < n {
                let eb = dtype.block_bytes();
                for r in 0..R {
                    crate::quant::axpy_scalar(dtype, &rows[r][n8 * eb..], a[r], &mut y[n8..]);
                }
            }
        }
        // q s - 8 s: the offset summed over the rows (one subtraction per weight less)
        DType::Q4_0 => {
            let minus8 = _mm256_set1_ps(-8.0);
            quantized!(
                BlockQ4_0,
                |b, a, s, off| nibbles_to_f32x4(&b.qs),
                true,
                _mm256_fmadd_ps(s, minus8, off)
            )
        }
        // q s + m a
        DType::Q4_1 => quantized!(
            BlockQ4_1,
            |b, a, s, off| nibbles_to_f32x4(&b.qs),
            true,
            _mm256_fmadd_ps(a, _mm256_broadcast_ss(&*f16s.add(b.m as usize)), off)
        ),
        DType::Q8_0 => {
            quantized!(BlockQ8_0, |b, a, s, off| i8x32_mem_to_f32x4(&b.qs), false, off)
        }
        // the chunked formats (`sparse::axpy4` sends them to `chunks_x86::axpy_rows`)
        _ => {
            for r in 0..R {
                crate::quant::axpy_scalar(dtype, rows[r], a[r], y);
            }
        }
    }
}
