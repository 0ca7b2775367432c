//! x86-64 SIMD pieces shared by the CPU kernels: the feature check of the AVX2 kernels
//! and a vector `exp` (the softmax weights of the decode attention kernel, and silu).
//! Every caller keeps a portable path for CPUs without these features.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether this CPU runs the AVX2 + FMA + F16C kernels (one detection for the quantized
/// dot products and these).
#[cfg(target_arch = "x86_64")]
pub(crate) use crate::quant::simd_available as available;

/// Largest input of [`exp_ps`] taken as it is: `127 * ln 2` rounded down, so `2^n` stays
/// a normal f32 (larger inputs give `exp(88)`, about `1.65e38`).
const EXP_HI: f32 = 88.0;
/// Smallest input of [`exp_ps`] with a nonzero result: `ln(f32::MIN_POSITIVE)`; below it
/// (and at `-inf`) the result is 0.
const EXP_LO: f32 = -87.336_54;

/// `e^x` of eight lanes: `x = n ln 2 + r` with `|r| <= ln 2 / 2`, `e^r` by Cephes' degree-6
/// polynomial (`expf`'s), times `2^n` built in the exponent bits. Relative error within a
/// few units in the last place over `[EXP_LO, EXP_HI]` (the tests bound it by `4e-7`);
/// 0 below `EXP_LO` and at `-inf`; NaN stays NaN.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn exp_ps(x: __m256) -> __m256 {
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
    // min/max return their second operand when one is NaN: x stays NaN.
    let x = _mm256_max_ps(
        _mm256_set1_ps(EXP_LO),
        _mm256_min_ps(_mm256_set1_ps(EXP_HI), x),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // ln 2 in two parts, so that n * ln2_hi is exact.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let one = _mm256_set1_ps(1.0);
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)))
}

/// `x / (1 + e^-x)` (silu) over `x` in place, eight values at a time with [`exp_ps`] and
/// an exact division; the tail through the scalar definition.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn silu_in_place(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(8);
    let one = _mm256_set1_ps(1.0);
    let sign = _mm256_set1_ps(-0.0);
    for c in &mut chunks {
        let v = _mm256_loadu_ps(c.as_ptr());
        let e = exp_ps(_mm256_xor_ps(v, sign));
        _mm256_storeu_ps(c.as_mut_ptr(), _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
    for v in chunks.into_remainder() {
        *v = crate::ops::UnaryOp::Silu.apply(*v);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn exp8(x: [f32; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: checked by the callers (available()); out holds eight floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp_ps(_mm256_loadu_ps(x.as_ptr()))) };
        out
    }

    /// Relative error against f64's exp over the whole range, edges included.
    #[test]
    fn exp_is_within_a_few_ulp() {
        if !available() {
            return;
        }
        let mut worst = 0f64;
        let n = 200_000;
        let xs: Vec<f32> = (0..=n)
            .map(|i| EXP_LO + (EXP_HI - EXP_LO) * i as f32 / n as f32)
            .chain([
                0.0,
                -0.0,
                1.0,
                -1.0,
                1e-8,
                -1e-8,
                0.5 * std::f32::consts::LN_2,
            ])
            .collect();
        for c in xs.chunks(8) {
            let mut x = [0f32; 8];
            x[..c.len()].copy_from_slice(c);
            for (xi, yi) in x.iter().zip(exp8(x)) {
                let want = f64::from(*xi).exp();
                let rel = (f64::from(yi) - want).abs() / want;
                worst = worst.max(rel);
            }
        }
        assert!(worst < 4e-7, "largest relative error {worst:e}");
    }

    /// Below the normal range and at -inf: 0; above: finite and large; NaN: NaN.
    #[test]
    fn exp_edges() {
        if !available() {
            return;
        }
        let y = exp8([
            f32::NEG_INFINITY,
            -1000.0,
            -88.0,
            f32::NAN,
            100.0,
            f32::INFINITY,
            EXP_LO,
            EXP_HI,
        ]);
        assert_eq!(&y[..3], &[0.0, 0.0, 0.0]);
        assert!(y[3].is_nan());
        assert!(y[4].is_finite() && y[4] > 1e38 && y[5] == y[4]);
        assert!(y[6] > 0.0 && (f64::from(y[6]) / f64::from(f32::MIN_POSITIVE) - 1.0).abs() < 1e-5);
        assert!((f64::from(y[7]) / 88f64.exp() - 1.0).abs() < 4e-7);
    }

    /// silu against the f64 definition, tail included; NaN stays NaN.
    #[test]
    fn silu_matches_definition() {
        if !available() {
            return;
        }
        let mut x: Vec<f32> = (0..1003).map(|i| (i as f32 - 501.0) * 0.37).collect();
        x[17] = f32::NAN;
        let want: Vec<f64> = x
            .iter()
            .map(|&v| f64::from(v) / (1.0 + (-f64::from(v)).exp()))
            .collect();
        // SAFETY: available() was checked.
        unsafe { silu_in_place(&mut x) };
        for (i, (g, w)) in x.iter().zip(&want).enumerate() {
            if w.is_nan() {
                assert!(g.is_nan(), "element {i}");
                continue;
            }
            let tol = 1e-6 * w.abs() + 1e-30;
            assert!((f64::from(*g) - w).abs() <= tol, "element {i}: {g} vs {w}");
        }
    }
}
