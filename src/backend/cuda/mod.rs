//! The CUDA backend (feature `cuda`). Interface skeleton: the implementation lands with
//! the CUDA backend work.

use super::{Backend, ExecId, Stats};
use crate::error::{Error, Result};
use crate::graph::{BufferId, DType, Plan, Step, TensorId};

/// The CUDA backend.
pub struct CudaBackend {
    _private: (),
}

impl CudaBackend {
    /// Opens GPU `ordinal`. Fails with [`Error::NoDevice`] when there is no driver or GPU.
    pub fn new(ordinal: usize) -> Result<Self> {
        Err(Error::NoDevice(format!(
            "CUDA backend not implemented (device {ordinal})"
        )))
    }
}

fn todo() -> Error {
    Error::Backend {
        backend: "cuda",
        msg: "not implemented".into(),
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn alloc_buffer(&mut self, _bytes: usize) -> Result<BufferId> {
        Err(todo())
    }
    fn free_buffer(&mut self, _buf: BufferId) -> Result<()> {
        Err(todo())
    }
    fn write_buffer(&mut self, _buf: BufferId, _offset: usize, _data: &[u8]) -> Result<()> {
        Err(todo())
    }
    fn read_buffer(&mut self, _buf: BufferId, _offset: usize, _out: &mut [u8]) -> Result<()> {
        Err(todo())
    }
    fn fill_random(
        &mut self,
        _buf: BufferId,
        _offset: usize,
        _dtype: DType,
        _n: usize,
        _seed: u64,
        _scale: f32,
    ) -> Result<()> {
        Err(todo())
    }
    fn supports(&self, _step: &Step) -> std::result::Result<(), String> {
        Err("not implemented".into())
    }
    fn load(&mut self, _plan: &Plan) -> Result<ExecId> {
        Err(todo())
    }
    fn unload(&mut self, _exec: ExecId) -> Result<()> {
        Err(todo())
    }
    fn set_input(&mut self, _exec: ExecId, _id: TensorId, _data: &[u8]) -> Result<()> {
        Err(todo())
    }
    fn compute(&mut self, _exec: ExecId) -> Result<()> {
        Err(todo())
    }
    fn get_output(&mut self, _exec: ExecId, _id: TensorId, _out: &mut [u8]) -> Result<()> {
        Err(todo())
    }
    fn stats(&self) -> Stats {
        Stats::default()
    }
    fn fill_arena(&mut self, _exec: ExecId, _byte: u8) -> Result<()> {
        Err(todo())
    }
    fn read_arena(&mut self, _exec: ExecId) -> Result<Vec<u8>> {
        Err(todo())
    }
}
