//! Per-op property tests of the CPU backend against the f64 oracle, with sentinel checks
//! of the arena and of every state buffer.

use common::strategies as st;
use common::{cross_check, run_and_verify, Case, Device};
use graft::backend::cpu::CpuBackend;
use graft::backend::{Backend, ExecId, Stats};
use graft::graph::{BinaryOp, BufferId, DType, Plan, Step, TensorId, UnaryOp};
use graft::{Error, Result};
use proptest::prelude::*;

use crate::common;

/// Runs `case` on a fresh CPU backend (sentinels on) and checks it against the oracle.
fn check(case: &Case) -> Result<(), TestCaseError> {
    run_and_verify(case, &mut CpuBackend::new())
        .map(|_| ())
        .map_err(TestCaseError::fail)
}

proptest! {
    // Every op of the family, drawn from its ALL list: 128 cases per op.
    #![proptest_config(common::config(128 * UnaryOp::ALL.len() as u32))]

    #[test]
    fn prop_unary(case in st::unary()) { check(&case)?; }
}

proptest! {
    #![proptest_config(common::config(128 * BinaryOp::ALL.len() as u32))]

    #[test]
    fn prop_binary(case in st::binary()) { check(&case)?; }
}

proptest! {
    #![proptest_config(common::config(128))]

    #[test]
    fn prop_get_rows(case in st::get_rows()) { check(&case)?; }

    #[test]
    fn prop_scale(case in st::scale()) { check(&case)?; }

    #[test]
    fn prop_rms_norm(case in st::norm(true)) { check(&case)?; }

    #[test]
    fn prop_norm(case in st::norm(false)) { check(&case)?; }

    #[test]
    fn prop_mul_mat(case in st::mul_mat()) { check(&case)?; }

    #[test]
    fn prop_mul_mat_gemv(case in st::mul_mat_gemv()) { check(&case)?; }

    #[test]
    fn prop_mul_mat_p021(case in st::mul_mat_p021()) { check(&case)?; }

    #[test]
    fn prop_mul_mat_vec_nc(case in st::mul_mat_vec_nc()) { check(&case)?; }

    #[test]
    fn prop_mul_mat_prefill(case in st::mul_mat_prefill()) { check(&case)?; }

    #[test]
    fn prop_rope(case in st::rope()) { check(&case)?; }

    #[test]
    fn prop_cpy(case in st::cpy()) { check(&case)?; }

    #[test]
    fn prop_cont(case in st::cont()) { check(&case)?; }

    #[test]
    fn prop_cast(case in st::cast()) { check(&case)?; }

    #[test]
    fn prop_set_rows(case in st::set_rows()) { check(&case)?; }

    #[test]
    fn prop_set_rows_v_transposed(case in st::set_rows_v_transposed()) { check(&case)?; }

    #[test]
    fn prop_diag_mask_inf(case in st::diag_mask_inf()) { check(&case)?; }

    #[test]
    fn prop_soft_max(case in st::soft_max()) { check(&case)?; }

    #[test]
    fn prop_argmax(case in st::argmax()) { check(&case)?; }

    #[test]
    fn prop_top_k(case in st::top_k()) { check(&case)?; }
}

/// A CPU backend that refuses every node, as a backend without a kernel would.
struct Refusing(CpuBackend);

impl Backend for Refusing {
    fn name(&self) -> &'static str {
        "refusing"
    }
    fn free_memory(&mut self) -> Result<Option<usize>> {
        self.0.free_memory()
    }
    fn alloc_buffer(&mut self, bytes: usize) -> Result<BufferId> {
        self.0.alloc_buffer(bytes)
    }
    fn free_buffer(&mut self, buf: BufferId) -> Result<()> {
        self.0.free_buffer(buf)
    }
    fn write_buffer(&mut self, buf: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.0.write_buffer(buf, offset, data)
    }
    fn read_buffer(&mut self, buf: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        self.0.read_buffer(buf, offset, out)
    }
    fn fill_random(
        &mut self,
        buf: BufferId,
        offset: usize,
        dtype: DType,
        n: usize,
        seed: u64,
        scale: f32,
    ) -> Result<()> {
        self.0.fill_random(buf, offset, dtype, n, seed, scale)
    }
    fn supports(&self, step: &Step) -> std::result::Result<(), String> {
        Err(format!("no kernel for {}", step.op.name()))
    }
    fn load(&mut self, plan: &Plan) -> Result<ExecId> {
        for step in &plan.steps {
            if let Err(reason) = self.supports(step) {
                return Err(Error::Unsupported {
                    backend: "refusing",
                    node: step.name.clone(),
                    op: step.op.name(),
                    reason,
                });
            }
        }
        self.0.load(plan)
    }
    fn unload(&mut self, exec: ExecId) -> Result<()> {
        self.0.unload(exec)
    }
    fn set_input(&mut self, exec: ExecId, id: TensorId, data: &[u8]) -> Result<()> {
        self.0.set_input(exec, id, data)
    }
    fn compute(&mut self, exec: ExecId) -> Result<()> {
        self.0.compute(exec)
    }
    fn set_profiling(&mut self, on: bool) {
        self.0.set_profiling(on)
    }
    fn take_profile(&mut self) -> Vec<graft::backend::StepTime> {
        self.0.take_profile()
    }
    fn get_output(&mut self, exec: ExecId, id: TensorId, out: &mut [u8]) -> Result<()> {
        self.0.get_output(exec, id, out)
    }
    fn stats(&self) -> Stats {
        self.0.stats()
    }
    fn fill_arena(&mut self, exec: ExecId, byte: u8) -> Result<()> {
        self.0.fill_arena(exec, byte)
    }
    fn read_arena(&mut self, exec: ExecId) -> Result<Vec<u8>> {
        self.0.read_arena(exec)
    }
}

proptest! {
    #![proptest_config(common::config(128))]

    /// The cross-backend path of the GPU tests, with a second CPU backend as the device:
    /// every case runs twice per backend and both backends agree.
    #[test]
    fn prop_two_backends_agree(case in st::any_op()) {
        let on = cross_check(&case, &mut CpuBackend::new(), &mut CpuBackend::new())
            .map_err(TestCaseError::fail)?;
        prop_assert_eq!(on, Device::Ran);
    }

    /// A backend that supports nothing fails every case every backend must run and
    /// is counted as unsupported on the others.
    #[test]
    fn prop_unsupported_cases_are_caught(case in st::any_op()) {
        let on = cross_check(&case, &mut Refusing(CpuBackend::new()), &mut CpuBackend::new());
        if case.required_everywhere() {
            prop_assert!(on.as_ref().is_err_and(|e| e.contains("must support")), "{:?}", on);
        } else {
            prop_assert_eq!(on, Ok(Device::Unsupported));
        }
    }
}
