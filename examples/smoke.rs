use graft::backend::{cpu::CpuBackend, Backend, BackendExt};
use graft::graph::{DType, Graph};

fn main() -> graft::Result<()> {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[4, 3])?;
    let w = g.input("w", DType::F32, &[4, 5])?;
    let y = g.mul_mat(w, x)?;
    let y = g.silu(y)?;
    let y = g.soft_max(y)?;
    let plan = g.plan(&[y])?;
    let mut be = CpuBackend::new();
    let e = be.load(&plan)?;
    be.set_input_f32(e, x, &(0..12).map(|i| i as f32 * 0.1).collect::<Vec<_>>())?;
    be.set_input_f32(
        e,
        w,
        &(0..20)
            .map(|i| (i as f32 - 10.0) * 0.05)
            .collect::<Vec<_>>(),
    )?;
    be.compute(e)?;
    println!("{:?}", be.get_output_f32(e, y, 15)?);
    println!("{}", graft::graph::dump::text(&g, &plan));
    println!("{}", graft::graph::dump::dot(&g, &plan));
    Ok(())
}
