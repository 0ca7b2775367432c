//! Step profiling through the `Backend` trait: a profiled run times every step of the
//! plan, in order, and computes the same result; an unprofiled run records nothing.

use graft::backend::cpu::CpuBackend;
use graft::backend::{profile_table, Backend, BackendExt};
use graft::graph::{DType, Graph};

#[test]
fn profiled_runs_time_every_step() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[64, 3]).unwrap();
    let w = g.input("w", DType::F32, &[64, 32]).unwrap();
    let y = g.mul_mat(w, x).unwrap();
    let y = g.rms_norm(y, 1e-5).unwrap();
    let y = g.soft_max(y).unwrap();
    let plan = g.plan(&[y]).unwrap();
    let mut be = CpuBackend::new();
    let e = be.load(&plan).unwrap();
    let xs: Vec<f32> = (0..64 * 3).map(|i| (i as f32 * 0.37).sin()).collect();
    let ws: Vec<f32> = (0..64 * 32).map(|i| (i as f32 * 0.11).cos()).collect();
    be.set_input_f32(e, x, &xs).unwrap();
    be.set_input_f32(e, w, &ws).unwrap();

    be.compute(e).unwrap();
    let plain = be.get_output_f32(e, y, 32 * 3).unwrap();
    assert!(be.take_profile().is_empty(), "profiling is off by default");

    be.set_profiling(true);
    be.compute(e).unwrap();
    let rows = be.take_profile();
    assert_eq!(be.get_output_f32(e, y, 32 * 3).unwrap(), plain);
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    let steps: Vec<&str> = plan.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, steps);
    assert_eq!(
        rows.iter().map(|r| r.op).collect::<Vec<_>>(),
        ["mul_mat", "rms_norm", "soft_max"]
    );
    assert!(rows.iter().all(|r| r.us >= 0.0 && r.us.is_finite()));
    assert!(be.take_profile().is_empty(), "take_profile drains");

    let table = profile_table(&rows);
    assert!(table.contains("| mul_mat |"), "{table}");
    assert!(table.contains("| all | | 3 |"), "{table}");

    be.set_profiling(false);
    be.compute(e).unwrap();
    assert!(be.take_profile().is_empty());
}
