//! The collectives of a rank of several, beside the step: each runs on a stream of its own
//! from the node that issues it to its join (`rumble_core::ir::collective_joins`: the first node
//! reading its result), so NCCL moves a gradient bucket while the backward computes the next.
//! The planner keeps what such a collective reads and writes live until its join.
//!
//! Issue: an event recorded on the step's stream, which the side stream waits for (everything
//! the collective reads is written by then); the collective on the side stream; an event of its
//! own recorded there. Join: the step's stream waits for that event before the join node, and
//! before the end of every launched range for a collective whose join lies past it (a captured
//! graph must end with every stream joined). Inside a capture the events become the graph's
//! edges, so the replayed graph overlaps the same way.

use cudarc::driver::result as drv;
use cudarc::driver::sys;

use crate::error::{CudaError, Result};

/// The side stream of one program and an event per collective.
pub struct SideStream {
    stream: sys::CUstream,
    fork: sys::CUevent,
    /// Per collective of several ranks, in trace order: its node, its join node (the node
    /// count: the step's end) and its event.
    collectives: Vec<(usize, usize, sys::CUevent)>,
    /// By node: the collective it issues; the collectives it joins (launching reads these, not
    /// every collective, at each node).
    issues: Vec<Option<usize>>,
    joins: Vec<Vec<usize>>,
}

// The handles are only used by the thread launching the program's steps; CUDA streams and
// events may move between threads.
unsafe impl Send for SideStream {}
unsafe impl Sync for SideStream {}

fn err(what: &str, e: drv::DriverError) -> CudaError {
    CudaError::Driver { what: what.into(), err: crate::error::describe(&e) }
}

impl SideStream {
    /// For `joins` (`(node, join)` pairs of a trace of `nodes` nodes); `None` where there is
    /// none. The device's context must be current.
    pub fn new(joins: &[(usize, usize)], nodes: usize) -> Result<Option<SideStream>> {
        if joins.is_empty() {
            return Ok(None);
        }
        let event =
            || drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| err("cuEventCreate", e));
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(|e| err("cuStreamCreate", e))?;
        let mut side = SideStream {
            stream,
            fork: std::ptr::null_mut(),
            collectives: Vec::new(),
            issues: vec![None; nodes],
            joins: vec![Vec::new(); nodes],
        };
        side.fork = event()?;
        for (k, &(c, j)) in joins.iter().enumerate() {
            if c >= nodes || j > nodes || j <= c {
                return Err(CudaError::usage(format!("collective at node {c} joined at {j} of {nodes} nodes")));
            }
            side.collectives.push((c, j, event()?));
            side.issues[c] = Some(k);
            if j < nodes {
                side.joins[j].push(k);
            }
        }
        Ok(Some(side))
    }

    /// The collective node `n` issues, if it is one of these.
    pub fn at(&self, n: usize) -> Option<usize> {
        self.issues.get(n).copied().flatten()
    }

    /// Makes the side stream wait for what `main` has enqueued, returns it to launch on.
    ///
    /// # Safety
    /// `main` must be a live stream of the context the side stream was made in.
    pub unsafe fn fork(&self, main: sys::CUstream) -> Result<sys::CUstream> {
        unsafe { drv::event::record(self.fork, main) }.map_err(|e| err("cuEventRecord (issuing a collective)", e))?;
        unsafe { drv::stream::wait_event(self.stream, self.fork, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| err("cuStreamWaitEvent (issuing a collective)", e))?;
        Ok(self.stream)
    }

    /// Marks collective `k` as enqueued on the side stream.
    pub fn issued(&self, k: usize) -> Result<()> {
        unsafe { drv::event::record(self.collectives[k].2, self.stream) }
            .map_err(|e| err("cuEventRecord (a collective's end)", e))
    }

    /// Makes `main` wait, before node `n` of a launched `range`, for the collectives of
    /// `range` that `n` joins; at `n == range.end`, for every collective of `range` joined at or
    /// after it.
    ///
    /// # Safety
    /// As [`SideStream::fork`].
    pub unsafe fn join(&self, main: sys::CUstream, n: usize, range: &std::ops::Range<usize>) -> Result<()> {
        let wait = |ev: sys::CUevent| {
            unsafe { drv::stream::wait_event(main, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .map_err(|e| err("cuStreamWaitEvent (joining a collective)", e))
        };
        if n == range.end {
            // Once a range: every collective of it still beside the step.
            for &(c, j, ev) in &self.collectives {
                if range.contains(&c) && j >= n {
                    wait(ev)?;
                }
            }
            return Ok(());
        }
        for &k in self.joins.get(n).map_or(&[][..], Vec::as_slice) {
            let (c, _, ev) = self.collectives[k];
            if range.contains(&c) {
                wait(ev)?;
            }
        }
        Ok(())
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        // Errors cannot be reported here; the program is going away.
        unsafe {
            for &(_, _, ev) in &self.collectives {
                let _ = drv::event::destroy(ev);
            }
            let _ = drv::event::destroy(self.fork);
            let _ = drv::stream::destroy(self.stream);
        }
    }
}
