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
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }>(bytes)
}

/// `prefetch` into L2 only (for rows long enough to crowd L1).
#[inline]
pub(crate) fn prefetch_l2(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(bytes)
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_lines<const HINT: i32>(bytes: &[u8]) {
    for off in (0..bytes.len()).step_by(64) {
        // SAFETY: prefetching is a hint that never faults; the address is inside the slice.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(bytes.as_ptr().add(off) as *const i8) };
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

/// How a CPU encodes the 256-bit VNNI instructions (`vpdpbusd`, `vpdpwssd`) the AVX2 level's
/// kernels take where it has them: AVX-VNNI's VEX form (Alder Lake and later Intel cores, AMD
/// Zen 5), or AVX-512 VL's EVEX form of the same instructions, the same operation on the same
/// 256 bits (an AVX-512 machine runs the AVX-VNNI level that way when asked to, so that the
/// level is measured and tested there too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vnni256 {
    Vex,
    Evex,
}

/// The 256-bit VNNI encodings this CPU runs, VEX first (whatever `POWERINFER_SIMD` says).
pub fn vnni256_encodings() -> Vec<Vnni256> {
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if detect().has_avx2() && is_x86_feature_detected!("avxvnni") {
            found.push(Vnni256::Vex);
        }
        if detect() == SimdLevel::Avx512 {
            found.push(Vnni256::Evex);
        }
    }
    found
}

/// Whether `level` takes 256-bit VNNI, and in which encoding: at the AVX2 level, AVX-VNNI where
/// the CPU has it and `POWERINFER_SIMD` is not `avx2`; with `POWERINFER_SIMD=avxvnni` on a CPU
/// with AVX-512 VNNI but no AVX-VNNI, the EVEX form. Its sums are the AVX2 kernels' exactly, so
/// results do not change with it.
pub fn vnni256(level: SimdLevel) -> Option<Vnni256> {
    static VNNI: OnceLock<Option<Vnni256>> = OnceLock::new();
    if level != SimdLevel::Avx2 {
        return None;
    }
    *VNNI.get_or_init(|| {
        let asked = std::env::var("POWERINFER_SIMD");
        let found = vnni256_encodings();
        match asked.as_deref() {
            Ok("avx2") => None,
            Ok("avxvnni") => found.first().copied(),
            _ => found.contains(&Vnni256::Vex).then_some(Vnni256::Vex),
        }
    })
}

/// Whether `level` takes 256-bit VNNI (`vnni256`).
pub fn avx_vnni(level: SimdLevel) -> bool {
    vnni256(level).is_some()
}

/// Whether `level` may take the kernels that also need AVX-512 VBMI's byte permutes (Ice Lake,
/// Zen 4 and later have it; Skylake-X's AVX-512 does not): the integer down pass of the sparse
/// operator (`avx512::axpy_group_q4_0`).
pub fn avx512_vbmi(level: SimdLevel) -> bool {
    static VBMI: OnceLock<bool> = OnceLock::new();
    level == SimdLevel::Avx512
        && *VBMI.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            return is_x86_feature_detected!("avx512vbmi");
            #[cfg(not(target_arch = "x86_64"))]
            false
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
