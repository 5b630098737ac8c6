//! The CPU kernels of every weight type at every SIMD level, one row per type: ggml's
//! `type_traits_cpu` beside `dtype::TYPES`, its `type_traits`. A row names, per level
//! (`SimdLevel as usize`: scalar, AVX2, AVX-512), the type's dot kernel (R of its rows against
//! N tokens) and its axpy kernel (R rows, scaled, added to an output row), and the loops over
//! many rows built on the dot kernel: a run of consecutive rows (dense products) and a list of
//! scattered ones (the sparse operators' selected rows). `matmul` and `sparse` look their
//! kernels up here once per product and never match on a type or a level themselves; adding a
//! type's kernels is a row here (and the kernels, each with its scalar twin).
//!
//! The loops are in the table, not around it, so that the call inside them is a direct one:
//! a four-row group of a 576-column row is ~100 ns of work, and a function-pointer call per
//! group (with the activations sliced again behind it) cost 3-12% of an AVX2 matrix-vector
//! product in cache.
//!
//! The kernels take R and N as const generics (decode dots four rows per call, prompts up to
//! four tokens per pass), so the table is a generic constant: `Table::<R, N>::ROWS` holds the
//! function pointers of the instances for that R and N.

use crate::dtype::DType;
use crate::quant::chunks::{BlockIQ4NL, BlockMXFP4, BlockQ5_0, BlockQ5_1};
use crate::quant::q256::BlockQ8K;
use crate::quant::{
    self, cast_blocks, cast_rows, q256, ActQuad, BlockQ4_0, BlockQ4_1, BlockQ8Act, BlockQ8_0,
};
use crate::simd::SimdLevel;

/// One token's activations in the forms the kernels read (`matmul::Activations::token`), sliced once
/// for the many kernel calls of a product.
#[derive(Clone, Copy)]
pub(crate) struct TokenActs<'a> {
    pub f32s: &'a [f32],
    pub q8: &'a [BlockQ8Act],
    pub quads: &'a [ActQuad],
    pub q8k: &'a [BlockQ8K],
}

/// The rows of a weight matrix as the loops read them: `data` holds rows of `row_bytes` bytes,
/// `stride` bytes apart.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub data: &'a [u8],
    pub row_bytes: usize,
    /// Bytes from one row's start to the next's: `row_bytes`, or more where each row lies in
    /// a neuron's bundle (`Model::neuron_bundles`).
    pub stride: usize,
}

impl<'a> Rows<'a> {
    pub(crate) fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.stride..r * self.stride + self.row_bytes]
    }
}

/// R weight rows (each the bytes of one row of the type) against N tokens' activations:
/// out[r][k] = rows[r] . x[k]. `next`: the bytes the caller reads after these rows, in turn;
/// the kernel prefetches them a line at a time over its work (see `matmul::dot_row`).
///
/// # Safety
/// The CPU must have the features of the table column the kernel came from, and `x` must hold
/// the activation form the type reads (`Activations::set_for`).
pub(crate) type DotFn<const R: usize, const N: usize> =
    unsafe fn([&[u8]; R], [TokenActs; N], &[&[u8]]) -> [[f32; N]; R];

/// Rows `rows` of `w` against N tokens into out[..rows.len()], four rows per kernel call where
/// `four`, each call with the next call's rows prefetched (up to row `limit`). Safety: `DotFn`'s.
pub(crate) type RunFn<const N: usize> =
    unsafe fn(Rows, std::ops::Range<usize>, usize, bool, [TokenActs; N], &mut [[f32; N]]);

/// Rows `sel` of `w` against one token into out[..sel.len()], as `RunFn`; the last call
/// prefetches `then` (the rows read next, from whatever matrix). Safety: `DotFn`'s.
pub(crate) type SelectedFn = unsafe fn(Rows, &[u32], bool, TokenActs, &mut [f32], &[&[u8]]);

/// y += sum over r of a[r] * rows[r], each block of y loaded and stored once for the R rows;
/// `next` prefetched as for `DotFn`.
///
/// # Safety
/// The CPU must have the features of the table column the kernel came from.
pub(crate) type AxpyFn<const R: usize> = unsafe fn([&[u8]; R], [f32; R], &mut [f32], &[&[u8]]);

/// One weight type's kernels, per SIMD level.
pub(crate) struct CpuKernels<const R: usize, const N: usize> {
    pub dtype: DType,
    pub dot: [DotFn<R, N>; 3],
    pub run: [RunFn<N>; 3],
    pub selected: [SelectedFn; 3],
    pub axpy: [AxpyFn<R>; 3],
}

/// The table for R rows and N tokens per kernel call.
pub(crate) struct Table<const R: usize, const N: usize>;

// On other architectures the SIMD columns hold the scalar kernels (`simd_level` never reports
// those levels there).
#[cfg(target_arch = "x86_64")]
macro_rules! x86 {
    ($simd:ty, $scalar:ty) => {
        $simd
    };
}
#[cfg(not(target_arch = "x86_64"))]
macro_rules! x86 {
    ($simd:ty, $scalar:ty) => {
        $scalar
    };
}

impl<const R: usize, const N: usize> Table<R, N> {
    /// One row per `DType`, in its order: the dot kernels of the scalar, AVX2 and AVX-512
    /// columns, then the axpy kernels'.
    #[rustfmt::skip]
    pub const ROWS: [CpuKernels<R, N>; 16] = {
        use DType as T;
        // the type's index, for the kernels generic over it
        macro_rules! i { ($t:ident) => { { T::$t as usize } }; }
        macro_rules! row {
            ($t:ident, dot: $s:ty, $d2:ty, $d5:ty; axpy: $as:ty, $a2:ty, $a5:ty) => {
                CpuKernels {
                    dtype: T::$t,
                    dot: [<$s>::dot::<R, N>, <x86!($d2, $s)>::dot::<R, N>,
                          <x86!($d5, $s)>::dot::<R, N>],
                    run: [run_of::<$s, N>, run_of::<x86!($d2, $s), N>, run_of::<x86!($d5, $s), N>],
                    selected: [selected_of::<$s>, selected_of::<x86!($d2, $s)>,
                               selected_of::<x86!($d5, $s)>],
                    axpy: [<$as>::axpy::<R>, <x86!($a2, $as)>::axpy::<R>,
                           <x86!($a5, $as)>::axpy::<R>],
                }
            };
        }
        // floats: f32 activations
        macro_rules! float {
            ($t:ident) => { row!($t,
                dot: FloatScalar<{ i!($t) }>, FloatAvx2<{ i!($t) }>, FloatAvx2<{ i!($t) }>;
                axpy: AxpyScalar<{ i!($t) }>, AxpyAvx2<{ i!($t) }>, AxpyAvx512<{ i!($t) }>) };
        }
        // the 32-weight formats the kernels read as stored: int8 activations per 32; `$l2`:
        // whether AVX2's dense decode prefetches into L2 (`avx2::PrefetchL2`; AVX-512's does)
        macro_rules! direct {
            ($t:ident, $block:ty, avx2_into_l2: $l2:literal) => { row!($t,
                dot: DirectScalar<$block>, LegacyAvx2<$block, $l2>, QuadsAvx512<$block>;
                axpy: AxpyScalar<{ i!($t) }>, AxpyAvx2<{ i!($t) }>, AxpyAvx512<{ i!($t) }>) };
        }
        // the other 32-weight formats, decoded into 32-weight chunks (`quant::chunks`)
        macro_rules! chunked {
            ($t:ident, $block:ty) => { row!($t,
                dot: ChunkedScalar<{ i!($t) }>, LegacyAvx2<$block, false>, ChunkedAvx512<{ i!($t) }>;
                axpy: AxpyScalar<{ i!($t) }>, AxpyChunks<{ i!($t) }>, AxpyChunks<{ i!($t) }>) };
        }
        // the 256-weight formats: int8 activations per 256 (`quant::q256`)
        macro_rules! super_block {
            ($t:ident) => { row!($t,
                dot: Q256Scalar<{ i!($t) }>, Q256X86<{ i!($t) }, false>, Q256X86<{ i!($t) }, true>;
                axpy: AxpyScalar<{ i!($t) }>, AxpyChunks<{ i!($t) }>, AxpyChunks<{ i!($t) }>) };
        }
        [
            float!(F32),
            float!(F16),
            float!(BF16),
            direct!(Q4_0, BlockQ4_0, avx2_into_l2: false),
            direct!(Q4_1, BlockQ4_1, avx2_into_l2: true),
            direct!(Q8_0, BlockQ8_0, avx2_into_l2: true),
            chunked!(Q5_0, BlockQ5_0),
            chunked!(Q5_1, BlockQ5_1),
            super_block!(Q2_K),
            super_block!(Q3_K),
            super_block!(Q4_K),
            super_block!(Q5_K),
            super_block!(Q6_K),
            chunked!(IQ4_NL, BlockIQ4NL),
            super_block!(IQ4_XS),
            chunked!(MXFP4, BlockMXFP4),
        ]
    };
}

// each row sits at its type's index
const _: () = {
    let rows = Table::<1, 1>::ROWS;
    let mut i = 0;
    while i < rows.len() {
        assert!(rows[i].dtype as usize == i);
        i += 1;
    }
};

/// The kernel that dots R rows of `dtype` with N tokens at `level`.
#[inline]
pub(crate) fn dot<const R: usize, const N: usize>(dtype: DType, level: SimdLevel) -> DotFn<R, N> {
    Table::<R, N>::ROWS[dtype as usize].dot[level as usize]
}

/// The loop over a run of consecutive rows of `dtype` at `level`.
#[inline]
pub(crate) fn run<const N: usize>(dtype: DType, level: SimdLevel) -> RunFn<N> {
    Table::<1, N>::ROWS[dtype as usize].run[level as usize]
}

/// The loop over scattered rows of `dtype` at `level`, one token.
#[inline]
pub(crate) fn selected(dtype: DType, level: SimdLevel) -> SelectedFn {
    Table::<1, 1>::ROWS[dtype as usize].selected[level as usize]
}

/// The kernel that adds R rows of `dtype` to an output row at `level`.
#[inline]
pub(crate) fn axpy<const R: usize>(dtype: DType, level: SimdLevel) -> AxpyFn<R> {
    Table::<R, 1>::ROWS[dtype as usize].axpy[level as usize]
}

// ---------------------------------------------------------------------------------------------
// The loops, generic over a family's dot kernel

/// A family's dot kernel at one level as a type (see `DotFn`), so that the loops call it
/// directly.
pub(crate) trait Dots {
    /// # Safety
    /// As `DotFn`'s.
    unsafe fn dot<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: [TokenActs; N],
        next: &[&[u8]],
    ) -> [[f32; N]; R];

    /// `dot` where `next` holds rows that lie apart (a selection's): a kernel that prefetches
    /// them a line of each in turn overrides it (`avx2::PrefetchApart`).
    ///
    /// # Safety
    /// As `DotFn`'s.
    unsafe fn dot_apart<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: [TokenActs; N],
        next: &[&[u8]],
    ) -> [[f32; N]; R] {
        Self::dot::<R, N>(rows, x, next)
    }

    /// `dot_apart` for rows of at least `APART_L2_ROW_BYTES`: a kernel whose dense rows are
    /// prefetched into L2 asks for these there too (`avx2::PrefetchApartL2`).
    ///
    /// # Safety
    /// As `DotFn`'s.
    unsafe fn dot_apart_long<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: [TokenActs; N],
        next: &[&[u8]],
    ) -> [[f32; N]; R] {
        Self::dot_apart::<R, N>(rows, x, next)
    }
}

/// A family's axpy kernel at one level as a type (see `AxpyFn`).
pub(crate) trait Axpys {
    /// # Safety
    /// As `AxpyFn`'s.
    unsafe fn axpy<const R: usize>(rows: [&[u8]; R], a: [f32; R], y: &mut [f32], next: &[&[u8]]);
}

/// How far ahead of the rows it reads a decode run prefetches, in bytes at least: four rows
/// ahead where rows are long, more where they are short. Four rows of 512 Q4_0 weights are
/// 1.1 KiB, less than one memory latency at the rate a thread reads them: with 8 KiB the
/// predictors' second layer (11008 x 512) read 14.7 -> 21 GB/s from DRAM on 2 threads at AVX2
/// (4 KiB did as well, 16 KiB a little less).
const AHEAD_BYTES: usize = 8192;

/// `RunFn`, over kernel K.
unsafe fn run_of<K: Dots, const N: usize>(
    w: Rows,
    rows: std::ops::Range<usize>,
    limit: usize,
    four: bool,
    x: [TokenActs; N],
    out: &mut [[f32; N]],
) {
    let row_bytes = w.row_bytes;
    debug_assert_eq!(w.stride, row_bytes, "a dense run reads consecutive rows");
    // the bytes of rows a..b (none past `limit`), for the prefetch
    let span = |a: usize, b: usize| -> &[u8] {
        match a < b.min(limit) {
            true => &w.data[a * row_bytes..b.min(limit) * row_bytes],
            false => &[],
        }
    };
    let (r0, mut r) = (rows.start, rows.start);
    let ahead = (AHEAD_BYTES / (4 * row_bytes)).max(1) * 4;
    if four {
        // four rows at a time from one slice of them (a bounds check per row cost the
        // predictors' 4-block rows a tenth of their product's instructions)
        let quads = w.data[r0 * row_bytes..rows.end * row_bytes].chunks_exact(4 * row_bytes);
        for (quad, o) in quads.zip(out.chunks_exact_mut(4)) {
            let mut four_rows = [&[][..]; 4];
            for (i, row) in four_rows.iter_mut().enumerate() {
                // SAFETY: the chunk holds four rows
                *row = unsafe { quad.get_unchecked(i * row_bytes..(i + 1) * row_bytes) };
            }
            let v = K::dot::<4, N>(four_rows, x, &[span(r + ahead, r + ahead + 4)]);
            o.copy_from_slice(&v);
            r += 4;
        }
    }
    for r in r..rows.end {
        out[r - r0] = K::dot::<1, N>([w.row(r)], x, &[span(r + 1, r + 2)])[0];
    }
}

/// The rows of the (up to four) rows `ids` of `w` that a kernel call prefetches for the call
/// after it, and how many there are: `&rows[..n]` is the kernel's `next`.
fn next_rows<'a>(w: Rows<'a>, ids: &[u32]) -> ([&'a [u8]; 4], usize) {
    let mut rows = [&[][..]; 4];
    for (r, &j) in rows.iter_mut().zip(ids) {
        *r = w.row(j as usize);
    }
    (rows, ids.len().min(4))
}

/// Rows apart at least this long go through `Dots::dot_apart_long`. The sparse FFN bench on
/// the 2-core AMD EPYC (Zen 4), bundled rows from DRAM, alternating runs, L1 -> L2 at 90%
/// skipped: the 7B shape's rows (2304 bytes in Q4_0, 4352 in Q8_0) read faster into L2 (AVX-512
/// Q4_0 4.7x -> 5.5-5.6x dense on one thread, Q4_1 4.2-4.6x -> 4.9-5.1x, Q8_0 5.1-5.3x ->
/// 6.0-6.1x; AVX2 Q8_0 4.9-5.1x -> 5.9-6.7x), SmolLM2's (324 and 612 bytes) slower (AVX-512
/// Q4_0 3.6-3.7x -> 3.4-3.5x, AVX2 Q8_0 on two threads 6.1-6.5x -> 5.0-5.2x): a short row's
/// lines are few, and its kernel is bound by instructions, not by L1's miss buffers.
const APART_L2_ROW_BYTES: usize = 1024;

/// One call of K's dot over rows apart, by their length (see `APART_L2_ROW_BYTES`).
#[inline(always)]
unsafe fn dot_apart_of<K: Dots, const R: usize>(
    long: bool,
    rows: [&[u8]; R],
    x: TokenActs,
    next: &[&[u8]],
) -> [[f32; 1]; R] {
    match long {
        true => K::dot_apart_long::<R, 1>(rows, [x], next),
        false => K::dot_apart::<R, 1>(rows, [x], next),
    }
}

/// `SelectedFn`, over kernel K.
unsafe fn selected_of<K: Dots>(
    w: Rows,
    sel: &[u32],
    four: bool,
    x: TokenActs,
    out: &mut [f32],
    then: &[&[u8]],
) {
    let ahead = |from: usize, n: usize| sel.get(from..(from + n).min(sel.len())).unwrap_or(&[]);
    let long = w.row_bytes >= APART_L2_ROW_BYTES;
    let mut k = 0;
    if four {
        while k + 4 <= sel.len() {
            let (next, n) = next_rows(w, ahead(k + 4, 4));
            let next = if n == 0 { then } else { &next[..n] };
            let rows = std::array::from_fn(|i| w.row(sel[k + i] as usize));
            for (i, [v]) in dot_apart_of::<K, 4>(long, rows, x, next).into_iter().enumerate() {
                out[k + i] = v;
            }
            k += 4;
        }
    }
    for k in k..sel.len() {
        let (next, n) = next_rows(w, ahead(k + 1, 1));
        let next = if n == 0 { then } else { &next[..n] };
        out[k] = dot_apart_of::<K, 1>(long, [w.row(sel[k] as usize)], x, next)[0][0];
    }
}

// ---------------------------------------------------------------------------------------------
// Each family's kernels behind the table's signatures. `T` is a `DType`'s index. (They only
// slice and cast, compiled as ordinary code, then call the kernel.)

struct FloatScalar<const T: usize>;
impl<const T: usize> Dots for FloatScalar<T> {
    unsafe fn dot<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: [TokenActs; N],
        _next: &[&[u8]],
    ) -> [[f32; N]; R] {
        let a = x.map(|t| t.f32s);
        rows.map(|row| quant::dot_float_scalar(DType::ALL[T], row, a))
    }
}

/// Q4_0, Q4_1 and Q8_0's scalar dots.
struct DirectScalar<B>(std::marker::PhantomData<B>);
macro_rules! direct_scalar {
    ($block:ty, $dot:path) => {
        impl Dots for DirectScalar<$block> {
            unsafe fn dot<const R: usize, const N: usize>(
                rows: [&[u8]; R],
                x: [TokenActs; N],
                _next: &[&[u8]],
            ) -> [[f32; N]; R] {
                let a = x.map(|t| t.q8);
                rows.map(|row| $dot(cast_blocks(row), a))
            }
        }
    };
}
direct_scalar!(BlockQ4_0, quant::dot_q4_0_scalar);
direct_scalar!(BlockQ4_1, quant::dot_q4_1_scalar);
direct_scalar!(BlockQ8_0, quant::dot_q8_0_scalar);

struct ChunkedScalar<const T: usize>;
impl<const T: usize> Dots for ChunkedScalar<T> {
    unsafe fn dot<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: [TokenActs; N],
        _next: &[&[u8]],
    ) -> [[f32; N]; R] {
        let a = x.map(|t| t.q8);
        rows.map(|row| quant::chunks::dot_scalar(DType::ALL[T], row, a))
    }
}

struct Q256Scalar<const T: usize>;
impl<const T: usize> Dots for Q256Scalar<T> {
    unsafe fn dot<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: [TokenActs; N],
        _next: &[&[u8]],
    ) -> [[f32; N]; R] {
        let a = x.map(|t| t.q8k);
        rows.map(|row| q256::dot_scalar(DType::ALL[T], row, a))
    }
}

struct AxpyScalar<const T: usize>;
impl<const T: usize> Axpys for AxpyScalar<T> {
    unsafe fn axpy<const R: usize>(rows: [&[u8]; R], a: [f32; R], y: &mut [f32], _: &[&[u8]]) {
        for (row, ar) in rows.iter().zip(a) {
            quant::axpy_scalar(DType::ALL[T], row, ar, y);
        }
    }
}

#[cfg(target_arch = "x86_64")]
use x86_kernels::*;

#[cfg(target_arch = "x86_64")]
mod x86_kernels {
    //! (Safety, for every kernel here: the CPU has the features its table column stands for.)

    use std::marker::PhantomData;

    use super::*;
    use crate::avx2::{LegacyBlock, Prefetch, PrefetchApart, PrefetchApartL2, PrefetchL2};
    use crate::avx512::QuadBlocks;

    pub(super) struct FloatAvx2<const T: usize>;
    impl<const T: usize> Dots for FloatAvx2<T> {
        unsafe fn dot<const R: usize, const N: usize>(
            rows: [&[u8]; R],
            x: [TokenActs; N],
            next: &[&[u8]],
        ) -> [[f32; N]; R] {
            let a = x.map(|t| t.f32s);
            rows.map(|row| crate::avx2::dot_float(DType::ALL[T], row, a, next))
        }
    }

    /// One of a family's dots from its body, `$P` naming `$far` where `$into_l2` (a constant)
    /// and `$near` elsewhere. (A constant branch: an inner type alias cannot name the impl's
    /// parameters.)
    macro_rules! dot_prefetching {
        ($name:ident, $into_l2:expr, $far:ident, $near:ident,
         |$rows:ident, $x:ident, $next:ident, $P:ident| $body:expr) => {
            unsafe fn $name<const R: usize, const N: usize>(
                $rows: [&[u8]; R],
                $x: [TokenActs; N],
                $next: &[&[u8]],
            ) -> [[f32; N]; R] {
                if $into_l2 {
                    type $P<'a> = $far<'a>;
                    $body
                } else {
                    type $P<'a> = $near<'a>;
                    $body
                }
            }
        };
    }

    /// A family's `dot` and `dot_apart` from one body, `$P` its prefetch order (`Prefetch` or,
    /// where `$l2`, `PrefetchL2` for the dense rows; `PrefetchApart` for rows apart, and for
    /// long ones `PrefetchApartL2` where `$l2`).
    macro_rules! dots_in_both_orders {
        (into_l2: $l2:expr, |$rows:ident, $x:ident, $next:ident, $P:ident| $body:expr) => {
            dot_prefetching!(dot, $l2, PrefetchL2, Prefetch, |$rows, $x, $next, $P| $body);
            dot_prefetching!(
                dot_apart,
                false,
                PrefetchApart,
                PrefetchApart,
                |$rows, $x, $next, $P| $body
            );
            dot_prefetching!(
                dot_apart_long,
                $l2,
                PrefetchApartL2,
                PrefetchApart,
                |$rows, $x, $next, $P| $body
            );
        };
    }

    /// `INTO_L2`: the dense rows prefetched into L2 (`avx2::PrefetchL2`).
    pub(super) struct LegacyAvx2<B, const INTO_L2: bool>(PhantomData<B>);
    impl<B: LegacyBlock, const INTO_L2: bool> Dots for LegacyAvx2<B, INTO_L2> {
        dots_in_both_orders!(into_l2: INTO_L2, |rows, x, next, P| {
            let w = cast_rows::<B, R>(rows);
            crate::avx2::dot_legacy::<B, P, R, N>(w, x.map(|t| t.q8), next)
        });
    }

    /// (the tokens' `ActQuad`s are filled at this level)
    pub(super) struct QuadsAvx512<B>(PhantomData<B>);
    impl<B: QuadBlocks> Dots for QuadsAvx512<B> {
        dots_in_both_orders!(into_l2: true, |rows, x, next, P| {
            let blocks = cast_rows::<B, R>(rows);
            crate::avx512::dot_quads::<B, P, R, N>(blocks, x.map(|t| t.quads), next)
        });
    }

    pub(super) struct ChunkedAvx512<const T: usize>;
    impl<const T: usize> Dots for ChunkedAvx512<T> {
        dots_in_both_orders!(into_l2: true, |rows, x, next, P| {
            let quads = x.map(|t| t.quads);
            crate::avx512::dot_chunked::<P, R, N>(DType::ALL[T], rows, quads, next)
        });
    }

    /// `WIDE`: the AVX-512 VNNI form (its column only), whose dense rows are prefetched into
    /// L2 (`avx2::PrefetchL2`).
    pub(super) struct Q256X86<const T: usize, const WIDE: bool>;
    impl<const T: usize, const WIDE: bool> Dots for Q256X86<T, WIDE> {
        dots_in_both_orders!(into_l2: WIDE, |rows, x, next, P| {
            let a = x.map(|t| t.q8k);
            crate::quant::q256_x86::dot::<P, R, N>(DType::ALL[T], WIDE, rows, a, next)
        });
    }

    pub(super) struct AxpyAvx2<const T: usize>;
    impl<const T: usize> Axpys for AxpyAvx2<T> {
        unsafe fn axpy<const R: usize>(
            rows: [&[u8]; R],
            a: [f32; R],
            y: &mut [f32],
            next: &[&[u8]],
        ) {
            crate::avx2::axpy_rows::<R>(DType::ALL[T], rows, a, y, next)
        }
    }

    pub(super) struct AxpyAvx512<const T: usize>;
    impl<const T: usize> Axpys for AxpyAvx512<T> {
        unsafe fn axpy<const R: usize>(
            rows: [&[u8]; R],
            a: [f32; R],
            y: &mut [f32],
            next: &[&[u8]],
        ) {
            crate::avx512::axpy_rows::<R>(DType::ALL[T], rows, a, y, next)
        }
    }

    /// The chunk decoders' axpy (AVX2, at both SIMD levels).
    pub(super) struct AxpyChunks<const T: usize>;
    impl<const T: usize> Axpys for AxpyChunks<T> {
        unsafe fn axpy<const R: usize>(
            rows: [&[u8]; R],
            a: [f32; R],
            y: &mut [f32],
            next: &[&[u8]],
        ) {
            crate::quant::chunks_x86::axpy_rows::<R>(DType::ALL[T], rows, a, y, next)
        }
    }
}
