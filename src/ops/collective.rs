//! Collectives: `all_reduce`, the sum of one tensor over a group of devices that each
//! run the same graph on their share of the weights (tensor parallelism). Every device's
//! graph holds the node; each gets the same sum.
//!
//! On the CPU a group is [`LocalGroup`]: N simulated devices in one process (one thread
//! each), meeting at a barrier. Every member adds the N contributions itself in device
//! order, so all members hold bit-identical results, as NCCL's all-reduce gives. A member
//! that fails [aborts](LocalGroup::abort) the group so the others return an error instead
//! of waiting forever.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::host::HostTensor;
use super::{expect_dtype, AllReduceParams, Op};
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, TensorId};

impl Graph {
    /// The sum of the F32 tensor `a` over the `devices` devices of a group: a tensor of
    /// `a`'s shape holding the same values on every device. `a` must be contiguous (the
    /// collective libraries move flat buffers).
    pub fn all_reduce(&mut self, a: TensorId, devices: usize) -> Result<TensorId> {
        let t = self.get(a)?;
        expect_dtype("all_reduce", &t.name, t.dtype, &[DType::F32])?;
        if devices == 0 {
            return Err(Error::shape(
                "all_reduce",
                "a group needs at least one device",
            ));
        }
        if !t.is_contiguous() {
            return Err(Error::shape(
                "all_reduce",
                format!(
                    "'{}' is not contiguous; all_reduce sums flat buffers",
                    t.name
                ),
            ));
        }
        let ne = t.ne;
        let p = AllReduceParams { devices };
        Ok(self.new_node(Op::AllReduce(p), DType::F32, ne, &[a]))
    }
}

/// A group of simulated devices in one process: the CPU's stand-in for an NCCL
/// communicator.
#[derive(Debug)]
pub struct LocalGroup {
    n: usize,
    state: Mutex<BarrierState>,
    wake: Condvar,
    /// Each member's contribution to the running all-reduce.
    slots: Vec<Mutex<Vec<f32>>>,
}

#[derive(Debug, Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    aborted: bool,
}

impl LocalGroup {
    /// A group of `n` members (ranks `0..n`).
    pub fn new(n: usize) -> LocalGroup {
        LocalGroup {
            n,
            state: Mutex::new(BarrierState::default()),
            wake: Condvar::new(),
            slots: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
        }
    }

    /// Members of the group.
    pub fn size(&self) -> usize {
        self.n
    }

    fn lock(&self) -> MutexGuard<'_, BarrierState> {
        // a member that panicked holding the lock left consistent counters behind
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every member has arrived (or the group was aborted).
    fn barrier(&self) -> Result<()> {
        let mut s = self.lock();
        if s.aborted {
            return Err(Error::Abandoned);
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.n {
            s.arrived = 0;
            s.generation += 1;
            self.wake.notify_all();
            return Ok(());
        }
        while s.generation == generation && !s.aborted {
            s = self.wake.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match s.aborted {
            true => Err(Error::Abandoned),
            false => Ok(()),
        }
    }

    /// Replaces `data` of member `rank` with the sum of every member's `data`, added in
    /// rank order (the same bits on every member).
    pub fn all_reduce(&self, rank: usize, data: &mut [f32]) -> Result<()> {
        let slot = self.slots.get(rank).ok_or_else(|| {
            Error::plan(format!(
                "all_reduce: rank {rank} outside a group of {}",
                self.n
            ))
        })?;
        {
            let mut mine = slot.lock().unwrap_or_else(|e| e.into_inner());
            mine.clear();
            mine.extend_from_slice(data);
        }
        self.barrier()?;
        data.fill(0.0);
        for (r, other) in self.slots.iter().enumerate() {
            let other = other.lock().unwrap_or_else(|e| e.into_inner());
            if other.len() != data.len() {
                self.abort();
                return Err(Error::plan(format!(
                    "all_reduce: rank {r} contributed {} elements, rank {rank} {}",
                    other.len(),
                    data.len()
                )));
            }
            for (d, o) in data.iter_mut().zip(other.iter()) {
                *d += o;
            }
        }
        // nobody refills a slot before every member has read all of them
        self.barrier()
    }

    /// Makes every waiting and later [`LocalGroup::all_reduce`] return an error (a member
    /// failed and will not arrive), until [`LocalGroup::reset`].
    pub fn abort(&self) {
        self.lock().aborted = true;
        self.wake.notify_all();
    }

    /// Readies the group for the next run once every member has returned.
    pub fn reset(&self) {
        let mut s = self.lock();
        s.aborted = false;
        s.arrived = 0;
    }
}

/// CPU reference for all_reduce: member `rank` of `group`, or the group of one (a copy)
/// when there is none.
pub(crate) fn cpu(
    p: AllReduceParams,
    dst: HostTensor,
    src: &[HostTensor],
    group: Option<(&LocalGroup, usize)>,
) -> Result<()> {
    let a = src[0];
    let n: usize = a.ne.iter().product();
    let mut data = vec![0f32; n];
    // SAFETY: the builder made `a` a contiguous F32 tensor of n elements, which the
    // plan keeps alive for this step.
    unsafe { std::ptr::copy_nonoverlapping(a.ptr as *const f32, data.as_mut_ptr(), n) };
    match group {
        Some((g, rank)) if g.size() == p.devices => g.all_reduce(rank, &mut data)?,
        None if p.devices == 1 => {}
        Some((g, _)) => {
            return Err(Error::plan(format!(
                "all_reduce over {} devices in a group of {}",
                p.devices,
                g.size()
            )))
        }
        None => {
            return Err(Error::plan(format!(
            "all_reduce over {} devices needs a device group (--tp); this backend is one device",
            p.devices
        )))
        }
    }
    // SAFETY: dst has a's shape, contiguous F32 (the builder's result), n elements; it
    // may be `a` itself (in place), which was read in full above.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst.ptr as *mut f32, n) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Every member gets the same sum, over several rounds.
    #[test]
    fn members_get_the_same_sum() {
        let g = Arc::new(LocalGroup::new(3));
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|r| {
                    let g = g.clone();
                    s.spawn(move || {
                        let mut last = Vec::new();
                        for round in 0..5 {
                            let mut v: Vec<f32> =
                                (0..7).map(|i| (r * 10 + i + round) as f32 * 0.1).collect();
                            g.all_reduce(r, &mut v).unwrap();
                            last = v;
                        }
                        last
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<f32> = (0..7)
            .map(|i| (0..3).map(|r| (r * 10 + i + 4) as f32 * 0.1).sum())
            .collect();
        for r in &results {
            assert_eq!(r, &results[0]);
            for (a, b) in r.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    /// A member that never arrives does not hang the others once the group is aborted;
    /// after a reset the group works again.
    #[test]
    fn abort_releases_waiting_members() {
        let g = Arc::new(LocalGroup::new(2));
        let waiter = {
            let g = g.clone();
            std::thread::spawn(move || g.all_reduce(0, &mut [1.0, 2.0]))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        g.abort();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::Abandoned), "{err}");
        g.reset();
        let other = {
            let g = g.clone();
            std::thread::spawn(move || {
                let mut v = [3.0];
                g.all_reduce(1, &mut v).map(|_| v)
            })
        };
        let mut v = [1.0];
        g.all_reduce(0, &mut v).unwrap();
        assert_eq!(v, [4.0]);
        assert_eq!(other.join().unwrap().unwrap(), [4.0]);
    }

    /// Contributions of different lengths are an error on every member, not a wrong sum.
    #[test]
    fn mismatched_lengths_are_an_error() {
        let g = Arc::new(LocalGroup::new(2));
        let other = {
            let g = g.clone();
            std::thread::spawn(move || g.all_reduce(1, &mut [1.0, 2.0, 3.0]))
        };
        assert!(g.all_reduce(0, &mut [1.0]).is_err());
        assert!(other.join().unwrap().is_err());
    }
}
