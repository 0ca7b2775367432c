//! Comparisons: a backend's [`Outcome`] against the oracle's [`Expected`], and two
//! backends against each other, with ggml's NMSE thresholds, exact equality where a
//! result is a plain copy, strict rules for NaN and infinities, and the sentinel checks
//! of the arena and of the state buffers.

use super::case::{decode_value, Case, Outcome};
use super::oracle::{Expected, StateExpect, Tol};

use super::nmse;

/// Compares `got` with the reference `want`: a NaN on either side always fails, an
/// infinity must be matched exactly at the same place, and the finite values must be
/// equal (`Tol::Exact`) or within the NMSE threshold.
pub fn compare(what: &str, got: &[f64], want: &[f64], tol: Tol) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    let (mut g_fin, mut w_fin) = (Vec::new(), Vec::new());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g.is_nan() || w.is_nan() {
            return Err(format!(
                "{what}: NaN at element {i} (got {g}, reference {w})"
            ));
        }
        if g.is_infinite() || w.is_infinite() {
            if g != w {
                return Err(format!(
                    "{what}: element {i} is {g}, reference {w} (infinities must match)"
                ));
            }
            continue;
        }
        g_fin.push(g);
        w_fin.push(w);
    }
    match tol {
        Tol::Exact => {
            let bad: Vec<usize> = (0..g_fin.len()).filter(|&i| g_fin[i] != w_fin[i]).collect();
            if let Some(&i) = bad.first() {
                return Err(format!(
                    "{what}: {} of {} finite values differ; first at finite index {i}: got {}, reference {}",
                    bad.len(),
                    g_fin.len(),
                    g_fin[i],
                    w_fin[i]
                ));
            }
        }
        Tol::Nmse(t) => {
            let e = nmse(&g_fin, &w_fin);
            if e.is_nan() || e > t {
                let worst = (0..g_fin.len())
                    .max_by(|&a, &b| {
                        (g_fin[a] - w_fin[a])
                            .abs()
                            .total_cmp(&(g_fin[b] - w_fin[b]).abs())
                    })
                    .unwrap_or(0);
                return Err(format!(
                    "{what}: NMSE {e:.3e} > {t:e} over {} values; worst at finite index {worst}: got {}, reference {}",
                    g_fin.len(),
                    g_fin.get(worst).copied().unwrap_or(0.0),
                    w_fin.get(worst).copied().unwrap_or(0.0)
                ));
            }
        }
    }
    Ok(())
}

/// The state buffer of leaf `leaf` in `o`.
fn state_of(o: &Outcome, leaf: usize) -> &[u8] {
    &o.states
        .iter()
        .find(|(l, _)| *l == leaf)
        .expect("every state leaf is read back")
        .1
}

/// The values at the written places of a state buffer.
fn written_values(st: &StateExpect, img: &[u8]) -> Vec<f64> {
    st.writes
        .iter()
        .map(|&(off, _)| decode_value(st.dtype, &img[off..]))
        .collect()
}

/// Bytes outside the written elements that differ from `reference`.
fn untouched_changes(
    st: &StateExpect,
    img: &[u8],
    reference: &[u8],
    name: &str,
) -> Result<(), String> {
    let es = st.dtype.block_bytes();
    let mut written = vec![false; img.len()];
    for &(off, _) in &st.writes {
        written[off..off + es].fill(true);
    }
    let bad: Vec<usize> = (0..img.len())
        .filter(|&i| !written[i] && img[i] != reference[i])
        .collect();
    match bad.first() {
        None => Ok(()),
        Some(&i) => Err(format!(
            "state '{name}': {} bytes outside the written elements changed; first at buffer byte {i} (tensor bytes {}..{}): 0x{:02x} -> 0x{:02x}",
            bad.len(),
            st.tensor.0,
            st.tensor.1,
            reference[i],
            img[i]
        )),
    }
}

/// Checks a backend's outcome against the oracle: the result, every state buffer (the
/// written elements by value, every other byte unchanged), the read-back of the state,
/// and the arena sentinels.
pub fn verify(case: &Case, exp: &Expected, got: &Outcome) -> Result<(), String> {
    if let Some(v) = &got.arena_violation {
        return Err(v.clone());
    }
    if let Some(want) = &exp.out {
        let g = got.out.as_ref().ok_or("no result was read")?;
        compare("result", g, want, exp.tol)?;
    }
    for st in &exp.states {
        let name = &case.leaves[st.leaf].name;
        let img = state_of(got, st.leaf);
        untouched_changes(st, img, &st.init, name)?;
        let want: Vec<f64> = st.writes.iter().map(|w| w.1).collect();
        compare(
            &format!("state '{name}' written elements"),
            &written_values(st, img),
            &want,
            exp.tol,
        )?;
        if let (Some(rb), Some(si)) = (&got.read_back, case.op.state_arg()) {
            if case.args[si].leaf == st.leaf {
                let stored: Vec<f64> = img[st.tensor.0..st.tensor.1]
                    .chunks_exact(st.dtype.block_bytes())
                    .map(|c| decode_value(st.dtype, c))
                    .collect();
                compare("read_back of the state", rb, &stored, Tol::Exact)?;
            }
        }
    }
    Ok(())
}

/// Checks that backend `got` agrees with backend `reference` on the same case, with the
/// case's tolerance (the state elements the op writes by value, every other byte equal).
pub fn agree(
    case: &Case,
    exp: &Expected,
    got: &Outcome,
    reference: &Outcome,
) -> Result<(), String> {
    if let (Some(g), Some(r)) = (&got.out, &reference.out) {
        compare("result vs reference backend", g, r, exp.tol)?;
    }
    if let (Some(g), Some(r)) = (&got.read_back, &reference.read_back) {
        compare("read_back vs reference backend", g, r, exp.tol)?;
    }
    for st in &exp.states {
        let name = &case.leaves[st.leaf].name;
        let (img, rimg) = (state_of(got, st.leaf), state_of(reference, st.leaf));
        untouched_changes(st, img, rimg, name)?;
        compare(
            &format!("state '{name}' vs reference backend"),
            &written_values(st, img),
            &written_values(st, rimg),
            exp.tol,
        )?;
    }
    Ok(())
}
