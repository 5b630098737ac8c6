//! The FFN's elementwise activations, one value at a time: the scalar forms every path takes
//! (`avx2::activate` computes the same bits in 8 lanes).

/// e^x: x = n ln 2 + r with |r| <= ln 2 / 2, e^r from Cephes' degree-6 polynomial, 2^n built
/// in the exponent bits (relative error about 2e-7 where e^x is a normal float; 0 below -87.3,
/// about 2.4e38 from 88.4 up). Plain multiplies and adds, no fused ones, so that
/// `avx2::activate` computes the same bits in 8 lanes and a CPU without FMA needs no library call.
#[inline]
pub fn exp_poly(x: f32) -> f32 {
    // (a NaN becomes the lower bound here, as in `_mm256_max_ps`, where `clamp` would keep it;
    // the callers keep x's NaN)
    #[allow(clippy::manual_clamp)]
    let x = x.max(-88.376_26).min(88.376_26);
    let t = x * std::f32::consts::LOG2_E + 0.5;
    // floor(t) (t is within +-128)
    let n = t as i32 - ((t as i32) as f32 > t) as i32;
    let nf = n as f32;
    // r = x - n ln 2, with ln 2 in two parts (n * 0.693359375 is exact)
    let r = x - nf * 0.693_359_4;
    let r = r - nf * -2.121_944_4e-4;
    let mut y = 1.987_569_1e-4f32;
    for c in EXP_POLY {
        y = y * r + c;
    }
    let y = y * (r * r) + (r + 1.0);
    y * f32::from_bits(((n + 127) as u32) << 23)
}

/// The polynomial's coefficients after the first (`exp_poly`).
pub(crate) const EXP_POLY: [f32; 5] =
    [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_poly(-x))
}

/// GELU, tanh approximation (ggml's `ggml_gelu`), as x * sigmoid(2u) = 0.5 x (1 + tanh(u)).
#[inline]
pub fn gelu(x: f32) -> f32 {
    x / (1.0 + exp_poly(gelu_exponent(x)))
}

/// -2u of the tanh approximation's u = sqrt(2 / pi) (x + 0.044715 x^3).
#[inline]
pub(crate) fn gelu_exponent(x: f32) -> f32 {
    MINUS_2_SQRT_2_OVER_PI * (x * (1.0 + 0.044715 * (x * x)))
}

/// -2 sqrt(2 / pi), GELU's exponent factor (`gelu_exponent`, `avx2::activate`).
pub(crate) const MINUS_2_SQRT_2_OVER_PI: f32 = -1.595_769;

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_poly` is within 3e-7 (relative) of f64's e^x wherever e^x is a normal float, 0
    /// below the range and finite above it.
    #[test]
    fn exp_poly_is_close_to_f64_exp() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0f32 + 175.0 * i as f32 / 200_000.0;
            let (got, want) = (exp_poly(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_poly(-100.0), 0.0);
        assert!(exp_poly(100.0) > 2e38 && exp_poly(100.0).is_finite());
        assert_eq!(exp_poly(0.0), 1.0);
    }
}
