//! The CPU kernels of every weight type at every SIMD level, one row per type: ggml's
//! `type_traits_cpu` beside `dtype::TYPES`, its `type_traits`. A row names, per level
//! (`SimdLevel as usize`: scalar, AVX2, AVX-512), the kernel that dots R of the type's rows with
//! N tokens and the one that adds R rows, scaled, to an output row. `matmul` and `sparse` look
//! their kernel up here once per product and never match on a type or a level themselves;
//! adding a type's kernels is a row here (and the kernels, each with its scalar twin).
//!
//! The kernels take R and N as const generics (decode dots four rows per call, prompts up to
//! four tokens per pass), so the table is a generic constant: `Table::<R, N>::ROWS` holds the
//! function pointers of the instances for that R and N.
//!
//! Below the table: the adapters that give each family's kernel the table's one signature
//! (the rows as bytes, the activations in the form the type reads).

use crate::dtype::DType;
use crate::matmul::{Activations, SimdLevel};
use crate::quant::chunks::{BlockIQ4NL, BlockQ5_0, BlockQ5_1};
use crate::quant::{self, cast_blocks, q256, BlockQ4_0, BlockQ4_1, BlockQ8_0};

/// R weight rows (each the bytes of one row of the type) against tokens `t` of `x`:
/// out[r][k] = rows[r] . x[t[k]]. `next`: the bytes the caller reads after these rows, in turn;
/// the kernel prefetches them a line at a time over its work (see `matmul::dot_row`).
///
/// # Safety
/// The CPU must have the features of the table column the kernel came from, and `x` must hold
/// the activation form the type reads for tokens `t` (`Activations::set_for`).
pub(crate) type DotFn<const R: usize, const N: usize> =
    unsafe fn([&[u8]; R], &Activations, [usize; N], &[&[u8]]) -> [[f32; N]; R];

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
    pub axpy: [AxpyFn<R>; 3],
}

/// The table for R rows and N tokens per call.
pub(crate) struct Table<const R: usize, const N: usize>;

// On other architectures the SIMD columns hold the scalar kernel (`simd_level` never reports
// those levels there).
#[cfg(target_arch = "x86_64")]
macro_rules! x86 {
    ($simd:expr, $scalar:expr) => {
        $simd
    };
}
#[cfg(not(target_arch = "x86_64"))]
macro_rules! x86 {
    ($simd:expr, $scalar:expr) => {
        $scalar
    };
}

impl<const R: usize, const N: usize> Table<R, N> {
    /// One row per `DType`, in its order.
    #[rustfmt::skip]
    pub const ROWS: [CpuKernels<R, N>; 15] = {
        use DType as T;
        // the type's index, for the adapters generic over it
        macro_rules! i { ($t:ident) => { { T::$t as usize } }; }
        macro_rules! row {
            ($t:ident, dot: $s:expr, $a2:expr, $a5:expr; axpy: $xs:expr, $x2:expr, $x5:expr) => {
                CpuKernels {
                    dtype: T::$t,
                    dot: [$s, x86!($a2, $s), x86!($a5, $s)],
                    axpy: [$xs, x86!($x2, $xs), x86!($x5, $xs)],
                }
            };
        }
        // floats: f32 activations; the rows dotted one per call (`TypeTraits::decode_rows`)
        macro_rules! float {
            ($t:ident) => { row!($t,
                dot: float_scalar::<{ i!($t) }, R, N>, float_avx2::<{ i!($t) }, R, N>,
                     float_avx2::<{ i!($t) }, R, N>;
                axpy: axpy_scalar::<{ i!($t) }, R>, axpy_avx2::<{ i!($t) }, R>,
                      axpy_avx512::<{ i!($t) }, R>) };
        }
        // the 32-weight formats the kernels read as stored: int8 activations per 32
        macro_rules! direct {
            ($t:ident, $block:ty, $scalar:ident) => { row!($t,
                dot: $scalar::<R, N>, legacy_avx2::<$block, R, N>, quads_avx512::<$block, R, N>;
                axpy: axpy_scalar::<{ i!($t) }, R>, axpy_avx2::<{ i!($t) }, R>,
                      axpy_avx512::<{ i!($t) }, R>) };
        }
        // the other 32-weight formats, decoded into 32-weight chunks (`quant::chunks`)
        macro_rules! chunked {
            ($t:ident, $block:ty) => { row!($t,
                dot: chunked_scalar::<{ i!($t) }, R, N>, legacy_avx2::<$block, R, N>,
                     chunked_avx512::<{ i!($t) }, R, N>;
                axpy: axpy_scalar::<{ i!($t) }, R>, axpy_chunks::<{ i!($t) }, R>,
                      axpy_chunks::<{ i!($t) }, R>) };
        }
        // the 256-weight formats: int8 activations per 256 (`quant::q256`)
        macro_rules! super_block {
            ($t:ident) => { row!($t,
                dot: q256_scalar::<{ i!($t) }, R, N>, q256_avx2::<{ i!($t) }, false, R, N>,
                     q256_avx2::<{ i!($t) }, true, R, N>;
                axpy: axpy_scalar::<{ i!($t) }, R>, axpy_chunks::<{ i!($t) }, R>,
                      axpy_chunks::<{ i!($t) }, R>) };
        }
        [
            float!(F32),
            float!(F16),
            float!(BF16),
            direct!(Q4_0, BlockQ4_0, q4_0_scalar),
            direct!(Q4_1, BlockQ4_1, q4_1_scalar),
            direct!(Q8_0, BlockQ8_0, q8_0_scalar),
            chunked!(Q5_0, BlockQ5_0),
            chunked!(Q5_1, BlockQ5_1),
            super_block!(Q2_K),
            super_block!(Q3_K),
            super_block!(Q4_K),
            super_block!(Q5_K),
            super_block!(Q6_K),
            chunked!(IQ4_NL, BlockIQ4NL),
            super_block!(IQ4_XS),
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

/// The kernel that adds R rows of `dtype` to an output row at `level`.
#[inline]
pub(crate) fn axpy<const R: usize>(dtype: DType, level: SimdLevel) -> AxpyFn<R> {
    Table::<R, 1>::ROWS[dtype as usize].axpy[level as usize]
}

// ---------------------------------------------------------------------------------------------
// Adapters: each family's kernel behind the table's signature. `T` is a `DType`'s index.

fn float_scalar<const T: usize, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    x: &Activations,
    t: [usize; N],
    _next: &[&[u8]],
) -> [[f32; N]; R] {
    let a = t.map(|ti| x.f32_row(ti));
    rows.map(|row| quant::dot_float_scalar(DType::ALL[T], row, a))
}

fn q4_0_scalar<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    x: &Activations,
    t: [usize; N],
    _next: &[&[u8]],
) -> [[f32; N]; R] {
    let a = t.map(|ti| x.q8_row(ti));
    rows.map(|row| quant::dot_q4_0_scalar(cast_blocks(row), a))
}

fn q4_1_scalar<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    x: &Activations,
    t: [usize; N],
    _next: &[&[u8]],
) -> [[f32; N]; R] {
    let a = t.map(|ti| x.q8_row(ti));
    rows.map(|row| quant::dot_q4_1_scalar(cast_blocks(row), a))
}

fn q8_0_scalar<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    x: &Activations,
    t: [usize; N],
    _next: &[&[u8]],
) -> [[f32; N]; R] {
    let a = t.map(|ti| x.q8_row(ti));
    rows.map(|row| quant::dot_q8_0_scalar(cast_blocks(row), a))
}

fn chunked_scalar<const T: usize, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    x: &Activations,
    t: [usize; N],
    _next: &[&[u8]],
) -> [[f32; N]; R] {
    let a = t.map(|ti| x.q8_row(ti));
    rows.map(|row| quant::chunks::dot_scalar(DType::ALL[T], row, a))
}

fn q256_scalar<const T: usize, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    x: &Activations,
    t: [usize; N],
    _next: &[&[u8]],
) -> [[f32; N]; R] {
    let a = t.map(|ti| x.q8k_row(ti));
    rows.map(|row| q256::dot_scalar(DType::ALL[T], row, a))
}

fn axpy_scalar<const T: usize, const R: usize>(
    rows: [&[u8]; R],
    a: [f32; R],
    y: &mut [f32],
    _next: &[&[u8]],
) {
    for (row, ar) in rows.iter().zip(a) {
        quant::axpy_scalar(DType::ALL[T], row, ar, y);
    }
}

#[cfg(target_arch = "x86_64")]
use x86_adapters::*;

#[cfg(target_arch = "x86_64")]
mod x86_adapters {
    //! (Safety, for every adapter: the CPU has the features its table column stands for.)

    use super::*;
    use crate::avx2::LegacyBlock;
    use crate::avx512::QuadBlocks;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn float_avx2<const T: usize, const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: &Activations,
        t: [usize; N],
        next: &[&[u8]],
    ) -> [[f32; N]; R] {
        let a = t.map(|ti| x.f32_row(ti));
        rows.map(|row| crate::avx2::dot_float(DType::ALL[T], row, a, next))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn legacy_avx2<B: LegacyBlock, const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: &Activations,
        t: [usize; N],
        next: &[&[u8]],
    ) -> [[f32; N]; R] {
        let a = t.map(|ti| x.q8_row(ti));
        crate::avx2::dot_legacy(rows.map(|row| cast_blocks::<B>(row)), a, next)
    }

    /// (`x` holds the tokens' `ActQuad`s at this level)
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn quads_avx512<B: QuadBlocks, const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: &Activations,
        t: [usize; N],
        next: &[&[u8]],
    ) -> [[f32; N]; R] {
        let quads = t.map(|ti| x.quad_row(ti));
        crate::avx512::dot_quads(rows.map(|row| cast_blocks::<B>(row)), quads, next)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn chunked_avx512<const T: usize, const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: &Activations,
        t: [usize; N],
        next: &[&[u8]],
    ) -> [[f32; N]; R] {
        let quads = t.map(|ti| x.quad_row(ti));
        crate::avx512::dot_chunked(DType::ALL[T], rows, quads, next)
    }

    /// `WIDE`: the AVX-512 VNNI form (its column only).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q256_avx2<
        const T: usize,
        const WIDE: bool,
        const R: usize,
        const N: usize,
    >(
        rows: [&[u8]; R],
        x: &Activations,
        t: [usize; N],
        next: &[&[u8]],
    ) -> [[f32; N]; R] {
        let a = t.map(|ti| x.q8k_row(ti));
        crate::quant::q256_x86::dot(DType::ALL[T], WIDE, rows, a, next)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_avx2<const T: usize, const R: usize>(
        rows: [&[u8]; R],
        a: [f32; R],
        y: &mut [f32],
        next: &[&[u8]],
    ) {
        crate::avx2::axpy_rows::<R>(DType::ALL[T], rows, a, y, next)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn axpy_avx512<const T: usize, const R: usize>(
        rows: [&[u8]; R],
        a: [f32; R],
        y: &mut [f32],
        next: &[&[u8]],
    ) {
        crate::avx512::axpy_rows::<R>(DType::ALL[T], rows, a, y, next)
    }

    /// The chunk decoders' axpy (AVX2, at both SIMD levels).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_chunks<const T: usize, const R: usize>(
        rows: [&[u8]; R],
        a: [f32; R],
        y: &mut [f32],
        next: &[&[u8]],
    ) {
        crate::quant::chunks_x86::axpy_rows::<R>(DType::ALL[T], rows, a, y, next)
    }
}
