//! Activations quantized to Q8_1 with AVX2: the bytes of [`crate::quant::quantize_row`]
//! (ggml's `quantize_row_q8_1_ref`, and a NaN scale over zeros for a block holding a NaN
//! or an infinity), eight values per instruction. Every product with block-typed weights
//! on the CPU quantizes its activation columns first; the portable loop took a tenth of
//! a 128-token prefill of SmolLM2 on a 2-core Zen 4.

use std::arch::x86_64::*;

use crate::quant::write_f16;

/// Quantizes the f32 row `src` into the Q8_1 blocks of `dst` (36 bytes per 32 values).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C ([`super::available`]); `src.len()` is a multiple of 32
/// and `dst.len()` is `src.len() / 32 * 36`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(32).zip(dst.chunks_exact_mut(36)) {
        if !block(x.as_ptr(), y) {
            y.fill(0);
            write_f16(y, 0, f32::NAN);
        }
    }
}

/// One block: false (nothing written) when a value is not finite.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block(x: *const f32, y: &mut [u8]) -> bool {
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.add(8 * i)));
    let sign = _mm256_set1_ps(-0.0);
    let abs = v.map(|x| _mm256_andnot_ps(sign, x));
    // every |x| below infinity (a NaN compares false)
    let inf = _mm256_set1_ps(f32::INFINITY);
    let finite = abs.map(|a| _mm256_cmp_ps::<_CMP_LT_OQ>(a, inf));
    let all = _mm256_and_ps(
        _mm256_and_ps(finite[0], finite[1]),
        _mm256_and_ps(finite[2], finite[3]),
    );
    if _mm256_movemask_ps(all) != 0xff {
        return false;
    }
    let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    // as the portable quantizer: d = amax / 127, its inverse (0 for 0), then each value
    // times it rounded half away from zero
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let half = _mm256_set1_ps(0.5);
    let q = v.map(|x| {
        let p = _mm256_mul_ps(x, id);
        let t = _mm256_cvttps_epi32(p);
        let f = _mm256_sub_ps(p, _mm256_cvtepi32_ps(t));
        // the masks are -1 where true: t + (f >= 0.5) - (f <= -0.5)
        let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(f, half));
        let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(
            f,
            _mm256_sub_ps(_mm256_setzero_ps(), half),
        ));
        let r = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
        _mm256_min_epi32(
            _mm256_max_epi32(r, _mm256_set1_epi32(-128)),
            _mm256_set1_epi32(127),
        )
    });
    let total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    let s = _mm_add_epi32(
        _mm256_castsi256_si128(total),
        _mm256_extracti128_si256::<1>(total),
    );
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0x4e>(s));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0xb1>(s)));
    // i32 -> i16 -> i8 with saturation (the values are in range), packs interleaving the
    // 128-bit halves: dwords 0, 4, 1, 5, 2, 6, 3, 7 of the result, put back in order
    let w01 = _mm256_packs_epi32(q[0], q[1]);
    let w23 = _mm256_packs_epi32(q[2], q[3]);
    let b = _mm256_packs_epi16(w01, w23);
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(y.as_mut_ptr().add(4) as *mut __m256i, b);
    write_f16(y, 0, d);
    write_f16(y, 2, sum as f32 * d);
    true
}

#[cfg(test)]
mod tests {
    use crate::quant::legacy::quantize_q8_1;
    use proptest::prelude::*;

    /// The AVX2 row against the portable blocks (and a NaN scale over zeros where a block
    /// holds a value that is not finite).
    fn check(x: &[f32]) {
        if !super::super::available() {
            return;
        }
        let mut got = vec![0u8; x.len() / 32 * 36];
        // SAFETY: available() was checked; the lengths agree.
        unsafe { super::quantize_row(x, &mut got) };
        for (b, (xb, gb)) in x.chunks_exact(32).zip(got.chunks_exact(36)).enumerate() {
            let mut want = [0u8; 36];
            if xb.iter().all(|v| v.is_finite()) {
                quantize_q8_1(xb.try_into().unwrap(), &mut want);
            } else {
                crate::quant::write_f16(&mut want, 0, f32::NAN);
            }
            assert_eq!(gb, &want[..], "block {b} of {xb:?}");
        }
    }

    #[test]
    fn ties_zeros_and_non_finite_blocks() {
        // halves after scaling by 127 / 127: the rounding away from zero
        let mut x: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
        x[0] = 127.0;
        x.extend([0.0f32; 32]);
        let mut nan = vec![1.0f32; 32];
        nan[7] = f32::NAN;
        x.extend(nan);
        let mut inf = vec![-2.0f32; 32];
        inf[31] = f32::NEG_INFINITY;
        x.extend(inf);
        x.extend((0..32).map(|i| if i == 3 { -1e-30 } else { 1e-38 * i as f32 }));
        check(&x);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn matches_portable(v in proptest::collection::vec(-1e4f32..1e4, 32..=320), scale in -30i32..30) {
            let n = v.len() / 32 * 32;
            let x: Vec<f32> = v[..n].iter().map(|a| a * 2f32.powi(scale)).collect();
            check(&x);
        }
    }
}
