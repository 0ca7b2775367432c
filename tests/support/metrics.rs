//! The error measure every numerical test uses, in one place.

/// Normalized mean squared error of `got` against `want`, in f64:
/// `sum (g - w)^2 / sum w^2`. Where `want` is all zeros it is the plain sum of squared
/// errors (0 only when `got` is zero too), so a zero reference cannot hide a wrong result.
/// A NaN anywhere gives NaN, which fails every `<=` bound.
///
/// # Panics
/// If the lengths differ: a comparison of a prefix would pass what it never looked at.
pub fn nmse<G: Copy + Into<f64>, W: Copy + Into<f64>>(got: &[G], want: &[W]) -> f64 {
    assert_eq!(
        got.len(),
        want.len(),
        "nmse of {} values against {}",
        got.len(),
        want.len()
    );
    let (mut err, mut norm) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let (g, w): (f64, f64) = (g.into(), w.into());
        err += (g - w) * (g - w);
        norm += w * w;
    }
    match norm == 0.0 {
        true => err,
        false => err / norm,
    }
}
