//! The instruction sets the CPU kernels are written for, which one this CPU runs (decided once,
//! capped by `POWERINFER_SIMD`), and the prefetch hint the kernels' callers issue.

use std::sync::OnceLock;

/// Instruction sets the kernels are written for, in increasing order: each level has every
/// feature of the ones below it. The discriminant indexes `TypeTraits::decode_rows`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2's features plus AVX-512 F, BW, VL and VNNI.
    Avx512,
}

impl SimdLevel {
    /// Whether the AVX2 kernels may run (also true at higher levels).
    pub fn has_avx2(self) -> bool {
        self >= SimdLevel::Avx2
    }

    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }
}

/// Asks the CPU to start loading `bytes` into cache (the scattered rows and slices sparse and
/// masked products read next).
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        for off in (0..bytes.len()).step_by(64) {
            // SAFETY: prefetching is a hint that never faults; the address is inside the slice.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(off) as *const i8) };
        }
    }
}

/// Best instruction set on this CPU, decided once. `POWERINFER_SIMD=scalar`, `avx2` or
/// `avxvnni` (AVX2 with AVX-VNNI where the CPU has it) caps it (for checking results and
/// measuring what each level buys).
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match std::env::var("POWERINFER_SIMD").as_deref() {
            Ok("scalar") => SimdLevel::Scalar,
            Ok("avx2" | "avxvnni") => SimdLevel::Avx2,
            _ => SimdLevel::Avx512,
        };
        detect().min(cap)
    })
}

/// Whether `level` takes AVX-VNNI (`vpdpbusd` without AVX-512: Alder Lake and later Intel
/// cores, AMD Zen 5) for prompts (row groups): at the AVX2 level, where the CPU has it and
/// `POWERINFER_SIMD` is not `avx2`. Its sums are the AVX2 kernels' exactly, so results do not
/// change with it.
pub fn avx_vnni(level: SimdLevel) -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    level == SimdLevel::Avx2
        && *VNNI.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            let has = is_x86_feature_detected!("avxvnni");
            #[cfg(not(target_arch = "x86_64"))]
            let has = false;
            has && std::env::var("POWERINFER_SIMD").as_deref() != Ok("avx2")
        })
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn detect() -> SimdLevel {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni");
    match (avx2, avx512) {
        (true, true) => SimdLevel::Avx512,
        (true, false) => SimdLevel::Avx2,
        _ => SimdLevel::Scalar,
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn detect() -> SimdLevel {
    SimdLevel::Scalar
}
