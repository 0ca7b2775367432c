//! A device group: N backends driven as one, for tensor parallelism. Every member runs
//! the same plan (the same graph, with `all_reduce` nodes where the devices' partial
//! results are summed) over its own copy of every buffer; the model writes each member's
//! share of the weights into its copy ([`Backend::write_buffer_on`]).
//!
//! The group hands out its own buffer and plan ids and maps them to each member's.
//! Inputs go to every member; outputs are read from member 0 (after an all-reduce every
//! member holds the same values). A run starts every member on its own thread and waits
//! for all of them; the members meet in their collectives. On the CPU the members are
//! [`CpuBackend`]s joined by a [`LocalGroup`] (simulated devices, one process); with the
//! `cuda` feature, [`DeviceGroup::cuda`] makes one `CudaBackend` per GPU joined by NCCL
//! communicators (each member's all-reduces are enqueued on its own stream and captured
//! into its own CUDA graph).
//!
//! A member that fails takes the group down with it rather than leaving the others
//! waiting: the simulated group is aborted at once (its members wait on the host), an
//! NCCL group's communicators are aborted once every member thread has returned (its
//! collectives wait on the GPUs). Reads of results first wait for every member, each on
//! its own thread, so that a GPU fault on one member aborts the group instead of hanging
//! the read on another.

use std::collections::HashMap;
use std::sync::Arc;

use super::cpu::CpuBackend;
use super::{Backend, ExecId, Stats, StepTime};
use crate::error::{Error, Result};
use crate::graph::{BufferId, DType, Loc, Plan, Step, TensorId};
use crate::ops::collective::LocalGroup;

/// Most devices a group takes (a sanity bound on `--tp`).
pub const MAX_DEVICES: usize = 64;

/// N backends run as one (see the module docs).
pub struct DeviceGroup {
    members: Vec<Box<dyn Backend + Send>>,
    /// Group buffer -> each member's buffer.
    buffers: HashMap<BufferId, Vec<BufferId>>,
    /// Group plan -> each member's plan.
    execs: Vec<Option<Vec<ExecId>>>,
    /// What joins the members, aborted when one fails.
    collective: Collective,
}

/// What joins the members of a group.
enum Collective {
    /// Simulated devices in this process.
    Local(Arc<LocalGroup>),
    /// GPUs joined by NCCL communicators.
    #[cfg(feature = "cuda")]
    Nccl(Arc<super::cuda::nccl::NcclGroup>),
}

impl DeviceGroup {
    /// `n` simulated CPU devices joined by an in-process all-reduce.
    pub fn cpu(n: usize) -> Result<DeviceGroup> {
        check_size(n)?;
        let local = Arc::new(LocalGroup::new(n));
        let members = (0..n)
            .map(|rank| Box::new(CpuBackend::in_group(local.clone(), rank)) as _)
            .collect();
        Ok(DeviceGroup {
            members,
            buffers: HashMap::new(),
            execs: Vec::new(),
            collective: Collective::Local(local),
        })
    }

    /// GPUs `0..n` of this machine, one `CudaBackend` each, joined by NCCL communicators
    /// (see [`super::cuda::nccl`]: libnccl loaded at run time, NVLink multicast off).
    /// Fails with [`Error::NoDevice`] when there are fewer GPUs or no NCCL.
    #[cfg(feature = "cuda")]
    pub fn cuda(n: usize) -> Result<DeviceGroup> {
        use super::cuda::{nccl, CudaBackend};
        check_size(n)?;
        let mut gpus = Vec::with_capacity(n);
        for ordinal in 0..n {
            let gpu = CudaBackend::new(ordinal);
            if let Err(Error::NoDevice(msg)) = &gpu {
                return Err(Error::NoDevice(format!("--tp {n} needs {n} GPUs: {msg}")));
            }
            gpus.push(gpu?);
        }
        let contexts: Vec<_> = gpus.iter().map(|g| g.context().clone()).collect();
        let group = nccl::init_all(&contexts)?;
        let mut values = Vec::with_capacity(n);
        for (rank, g) in gpus.iter_mut().enumerate() {
            g.join(nccl::Member {
                group: group.clone(),
                rank,
            });
            values.push(g.warm_up_value()?);
        }
        let warmed: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = gpus
                .iter_mut()
                .zip(&values)
                .map(|(g, v)| s.spawn(move || g.warm_up_group(v)))
                .collect();
            join_all(handles)
        });
        if let Some(e) = warmed.into_iter().find_map(|r| r.err()) {
            group.abort();
            return Err(e);
        }
        Ok(DeviceGroup {
            members: gpus.into_iter().map(|g| Box::new(g) as _).collect(),
            buffers: HashMap::new(),
            execs: Vec::new(),
            collective: Collective::Nccl(group),
        })
    }

    fn member_buffers(&self, buf: BufferId) -> Result<&Vec<BufferId>> {
        self.buffers
            .get(&buf)
            .ok_or_else(|| Error::plan(format!("device group: unknown buffer {buf:?}")))
    }

    fn member_execs(&self, exec: ExecId) -> Result<&Vec<ExecId>> {
        self.execs
            .get(exec.0)
            .and_then(|e| e.as_ref())
            .ok_or_else(|| Error::plan(format!("device group: no loaded plan {exec:?}")))
    }

    /// Runs `f` on every member, in order, with that member's id of group buffer `buf`.
    fn each_buffer(
        &mut self,
        buf: BufferId,
        mut f: impl FnMut(&mut dyn Backend, BufferId) -> Result<()>,
    ) -> Result<()> {
        let ids = self.member_buffers(buf)?.clone();
        for (m, id) in self.members.iter_mut().zip(ids) {
            f(m.as_mut(), id)?;
        }
        Ok(())
    }

    /// Runs `f` on every member, in order, with that member's id of group plan `exec`.
    fn each_exec(
        &mut self,
        exec: ExecId,
        mut f: impl FnMut(&mut dyn Backend, ExecId) -> Result<()>,
    ) -> Result<()> {
        let ids = self.member_execs(exec)?.clone();
        for (m, id) in self.members.iter_mut().zip(ids) {
            f(m.as_mut(), id)?;
        }
        Ok(())
    }

    /// `plan` with the group's buffers replaced by member `m`'s.
    fn member_plan(&self, plan: &Plan, m: usize) -> Result<Plan> {
        let mut p = plan.clone();
        let map = |loc: &mut Loc| -> Result<()> {
            if let Loc::Buffer(b, off) = *loc {
                *loc = Loc::Buffer(self.member_buffers(b)?[m], off);
            }
            Ok(())
        };
        for step in &mut p.steps {
            map(&mut step.dst.loc)?;
            for s in &mut step.src {
                map(&mut s.loc)?;
            }
        }
        for io in p
            .inputs
            .iter_mut()
            .chain(&mut p.outputs)
            .chain(&mut p.externals)
        {
            map(&mut io.operand.loc)?;
        }
        Ok(p)
    }

    /// Runs `f` on every member (with its index), one thread per member; when one fails
    /// the collective is aborted so that no member waits for it (see the module docs),
    /// and the first member's own error (not an "abandoned" one) is returned.
    fn on_all_threads(
        &mut self,
        f: impl Fn(usize, &mut dyn Backend) -> Result<()> + Sync,
    ) -> Result<()> {
        // The simulated members wait on the host: release them as soon as one fails.
        let local = match &self.collective {
            Collective::Local(l) => Some(l.clone()),
            #[cfg(feature = "cuda")]
            Collective::Nccl(_) => None,
        };
        let f = &f;
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .members
                .iter_mut()
                .enumerate()
                .map(|(i, m)| {
                    let local = local.clone();
                    s.spawn(move || {
                        let r = f(i, m.as_mut());
                        if let (Err(_), Some(l)) = (&r, &local) {
                            l.abort();
                        }
                        r
                    })
                })
                .collect();
            join_all(handles)
        });
        match &self.collective {
            Collective::Local(l) => l.reset(),
            // No member enqueues now: the communicators can go.
            // A bad row index is recorded, not a fault: the collectives ran. Any other
            // failure may have left a member's collective unmatched.
            #[cfg(feature = "cuda")]
            Collective::Nccl(g) => {
                if results
                    .iter()
                    .any(|r| matches!(r, Err(e) if !matches!(e, Error::IndexOutOfRange { .. })))
                {
                    g.abort();
                }
            }
        }
        let mut errors: Vec<Error> = results.into_iter().filter_map(|r| r.err()).collect();
        // the member's own error, not the others' giving up on it
        match errors.iter().position(|e| !matches!(e, Error::Abandoned)) {
            Some(i) => Err(errors.swap_remove(i)),
            None => errors.pop().map_or(Ok(()), Err),
        }
    }
}

/// The results of the member threads, in member order (a panicked thread is an error).
fn join_all(handles: Vec<std::thread::ScopedJoinHandle<'_, Result<()>>>) -> Vec<Result<()>> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(Error::plan("device group: a member's thread panicked")))
        })
        .collect()
}

/// Checks a group size.
pub fn check_size(n: usize) -> Result<()> {
    if n == 0 || n > MAX_DEVICES {
        return Err(Error::model(format!(
            "--tp {n}: a device group has 1 to {MAX_DEVICES} devices"
        )));
    }
    Ok(())
}

impl Backend for DeviceGroup {
    fn name(&self) -> &'static str {
        self.members[0].name()
    }

    fn devices(&self) -> usize {
        self.members.len()
    }

    fn alloc_buffer(&mut self, bytes: usize) -> Result<BufferId> {
        let mut ids = Vec::with_capacity(self.members.len());
        for m in &mut self.members {
            match m.alloc_buffer(bytes) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    for (m, id) in self.members.iter_mut().zip(ids) {
                        m.free_buffer(id)?;
                    }
                    return Err(e);
                }
            }
        }
        let id = BufferId::fresh();
        self.buffers.insert(id, ids);
        Ok(id)
    }

    fn free_buffer(&mut self, buf: BufferId) -> Result<()> {
        self.each_buffer(buf, |m, id| m.free_buffer(id))?;
        self.buffers.remove(&buf);
        Ok(())
    }

    fn free_memory(&mut self) -> Result<Option<usize>> {
        let mut least: Option<usize> = None;
        for m in &mut self.members {
            match m.free_memory()? {
                None => return Ok(None),
                Some(f) => least = Some(least.map_or(f, |l| l.min(f))),
            }
        }
        Ok(least)
    }

    fn write_buffer(&mut self, buf: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.each_buffer(buf, |m, id| m.write_buffer(id, offset, data))
    }

    fn write_buffer_on(
        &mut self,
        device: usize,
        buf: BufferId,
        offset: usize,
        data: &[u8],
    ) -> Result<()> {
        let id = *self.member_buffers(buf)?.get(device).ok_or_else(|| {
            Error::plan(format!(
                "device {device} is outside a group of {}",
                self.members.len()
            ))
        })?;
        self.members[device].write_buffer(id, offset, data)
    }

    fn copy_within(&mut self, buf: BufferId, src: usize, dst: usize, len: usize) -> Result<()> {
        self.each_buffer(buf, |m, id| m.copy_within(id, src, dst, len))
    }

    fn read_buffer(&mut self, buf: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        let id = self.member_buffers(buf)?[0];
        self.synchronize()?;
        self.members[0].read_buffer(id, offset, out)
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
        self.each_buffer(buf, |m, id| {
            m.fill_random(id, offset, dtype, n, seed, scale)
        })
    }

    fn supports(&self, step: &Step) -> std::result::Result<(), String> {
        self.members[0].supports(step)
    }

    fn load(&mut self, plan: &Plan) -> Result<ExecId> {
        let mut ids: Vec<ExecId> = Vec::with_capacity(self.members.len());
        for m in 0..self.members.len() {
            let loaded = self
                .member_plan(plan, m)
                .and_then(|p| self.members[m].load(&p));
            match loaded {
                Ok(id) => ids.push(id),
                Err(e) => {
                    for (member, id) in self.members.iter_mut().zip(ids) {
                        member.unload(id)?;
                    }
                    return Err(e);
                }
            }
        }
        let index = match self.execs.iter().position(|e| e.is_none()) {
            Some(i) => i,
            None => {
                self.execs.push(None);
                self.execs.len() - 1
            }
        };
        self.execs[index] = Some(ids);
        Ok(ExecId(index))
    }

    fn unload(&mut self, exec: ExecId) -> Result<()> {
        self.each_exec(exec, |m, e| m.unload(e))?;
        self.execs[exec.0] = None;
        Ok(())
    }

    fn set_input(&mut self, exec: ExecId, id: TensorId, data: &[u8]) -> Result<()> {
        self.each_exec(exec, |m, e| m.set_input(e, id, data))
    }

    fn compute(&mut self, exec: ExecId) -> Result<()> {
        let ids = self.member_execs(exec)?.clone();
        self.on_all_threads(|i, m| m.compute(ids[i]))
    }

    fn synchronize(&mut self) -> Result<()> {
        match &self.collective {
            // the members ran to completion inside compute
            Collective::Local(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Collective::Nccl(_) => self.on_all_threads(|_, m| m.synchronize()),
        }
    }

    fn get_output(&mut self, exec: ExecId, id: TensorId, out: &mut [u8]) -> Result<()> {
        let e = self.member_execs(exec)?[0];
        self.synchronize()?;
        self.members[0].get_output(e, id, out)
    }

    fn stats(&self) -> Stats {
        self.members[0].stats()
    }

    fn fill_arena(&mut self, exec: ExecId, byte: u8) -> Result<()> {
        self.each_exec(exec, |m, e| m.fill_arena(e, byte))
    }

    fn read_arena(&mut self, exec: ExecId) -> Result<Vec<u8>> {
        let e = self.member_execs(exec)?[0];
        self.synchronize()?;
        self.members[0].read_arena(e)
    }

    fn set_profiling(&mut self, on: bool) {
        for m in &mut self.members {
            m.set_profiling(on);
        }
    }

    fn take_profile(&mut self) -> Vec<StepTime> {
        let rows = self.members[0].take_profile();
        for m in &mut self.members[1..] {
            m.take_profile();
        }
        rows
    }
}
