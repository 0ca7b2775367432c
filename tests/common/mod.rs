//! The harness of the per-op property tests, shared by the CPU and CUDA test files.
//!
//! - [`case`]: backend-independent case descriptions and [`run_case`], which builds a
//!   case on any `&mut dyn Backend`, runs it and reads back the result, the state buffers
//!   and (with guard bytes) the arena;
//! - [`oracle`]: the f64 oracle, written from the op definitions;
//! - [`check`]: NMSE and exact comparisons, NaN/inf rules, sentinel checks;
//! - [`strategies`]: proptest strategies per op and per layout family.
//!
//! Each test binary uses a part of the harness, hence the `dead_code` allowance.
#![allow(dead_code)]

pub mod attention;
pub mod case;
pub mod check;
pub mod oracle;
pub mod paged;
pub mod quant_blocks;
pub mod strategies;

#[path = "../support/metrics.rs"]
mod metrics;
pub use metrics::nmse;

pub use case::{run_case, run_case_n, Case, Outcome};

use graft::backend::Backend;

/// Guard bytes after every arena block in the property tests.
pub const GUARD_BYTES: usize = 256;

/// The proptest configuration of the op tests: `cases` cases (or `GRAFT_PROPTEST_CASES`
/// when set, e.g. fewer under compute-sanitizer, more for a soak run), failing cases saved
/// next to the test file (`<file>.regressions`) and replayed first on later runs.
pub fn config(cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("GRAFT_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    proptest::test_runner::Config {
        cases,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("regressions"),
        )),
        ..proptest::test_runner::Config::default()
    }
}

/// Runs `case` on `backend` with sentinels on and checks the outcome against the oracle.
/// A backend error (including an unsupported node) is returned as is.
pub fn run_and_verify(case: &Case, backend: &mut dyn Backend) -> Result<Outcome, String> {
    let exp = oracle::expected(case);
    let got = run_case(case, backend, GUARD_BYTES)
        .map_err(|e| format!("{} failed: {e}", backend.name()))?;
    check::verify(case, &exp, &got).map_err(|e| format!("{} vs oracle: {e}", backend.name()))?;
    Ok(got)
}

/// Runs per case in [`cross_check`]: a backend may capture a graph on the first run
/// and replay it on the second.
pub const RUNS: usize = 2;

/// What a device backend did with a case in [`cross_check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// It ran the case, and the case passed.
    Ran,
    /// It does not support the case, and the case is not one every backend must run.
    Unsupported,
}

/// Runs `case` ([`RUNS`] runs, sentinels on) on `reference` (checked against the
/// oracle) and on `device`, whose result must match the oracle and agree with the
/// reference's. A case `device` does not support is an error when
/// [`Case::required_everywhere`] says every backend must run it.
pub fn cross_check(
    case: &Case,
    device: &mut dyn Backend,
    reference: &mut dyn Backend,
) -> Result<Device, String> {
    let exp = oracle::expected(case);
    let (dn, rn) = (device.name(), reference.name());
    let r =
        run_case_n(case, reference, GUARD_BYTES, RUNS).map_err(|e| format!("{rn} failed: {e}"))?;
    check::verify(case, &exp, &r).map_err(|e| format!("{rn} vs oracle: {e}"))?;
    match run_case_n(case, device, GUARD_BYTES, RUNS) {
        Err(e) if case::is_unsupported(&e) => {
            if case.required_everywhere() {
                Err(format!("{dn} must support this case: {e}"))
            } else {
                Ok(Device::Unsupported)
            }
        }
        Err(e) => Err(format!("{dn} failed: {e}")),
        Ok(d) => {
            check::verify(case, &exp, &d).map_err(|e| format!("{dn} vs oracle: {e}"))?;
            check::agree(case, &exp, &d, &r).map_err(|e| format!("{dn} vs {rn}: {e}"))?;
            Ok(Device::Ran)
        }
    }
}

/// Runs a case with exactly one id out of range (from
/// [`strategies::index_out_of_range`]) and checks that it fails with
/// `Error::IndexOutOfRange` naming the op, the result node, the id and the row count.
pub fn check_index_error(case: &Case, backend: &mut dyn Backend) -> Result<(), String> {
    let rows = oracle::arg_layout(case, 0).ne[1];
    let (ids, _) = oracle::arg_values(case, case.args.len() - 1);
    let bad = ids
        .iter()
        .map(|&v| v as i64)
        .find(|&v| v < 0 || v >= rows as i64)
        .ok_or("the case has no id out of range")?;
    let op = case.op.name();
    let node = case::out_name(&case.op);
    match run_case(case, backend, GUARD_BYTES) {
        Err(e @ graft::Error::IndexOutOfRange { .. }) => {
            let text = e.to_string();
            let graft::Error::IndexOutOfRange {
                op: o,
                node: n,
                index,
                limit,
                ..
            } = e
            else {
                unreachable!()
            };
            if (o, n.as_str(), index, limit) != (op, node.as_str(), bad, rows) {
                return Err(format!(
                    "{}: expected {op} '{node}' index {bad} limit {rows}, got '{text}'",
                    backend.name()
                ));
            }
            if !(text.contains(op) && text.contains(&node) && text.contains(&bad.to_string())) {
                return Err(format!(
                    "message '{text}' does not name {op}, '{node}' and {bad}"
                ));
            }
            Ok(())
        }
        other => Err(format!(
            "{}: expected an index error for id {bad} (rows {rows}), got {other:?}",
            backend.name()
        )),
    }
}

/// Prints a line on stderr past the test harness's output capture, so that it shows in
/// a plain `cargo test` run.
pub fn report(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Opens GPU 0, or prints "skipped: no GPU (<reason>)" and returns None when there is
/// none. With `GRAFT_REQUIRE_GPU=1` a missing GPU is a failure instead.
#[cfg(feature = "cuda")]
pub fn cuda_backend() -> Option<graft::backend::cuda::CudaBackend> {
    match graft::backend::cuda::CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(graft::Error::NoDevice(reason)) => {
            if std::env::var("GRAFT_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("GRAFT_REQUIRE_GPU=1 but no GPU: {reason}");
            }
            report(&format!("skipped: no GPU ({reason})"));
            None
        }
        Err(e) => panic!("opening the CUDA backend failed: {e}"),
    }
}
