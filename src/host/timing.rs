//! CUDA-event timing on a raw stream.
//!
//! Events measure GPU time between two points of a stream, so host-side launch overhead
//! only counts where it leaves the GPU idle. Every call leaves the calling thread's current
//! CUDA context as it found it (see [`ContextScope`]).

use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUevent, CUevent_flags, CUstream};

use super::device::{ContextScope, check, release_context};
use crate::error::{Error, Result};

/// One timing-capable CUDA event (`CU_EVENT_DEFAULT`; cudarc's `new_event(None)` would
/// disable timing), destroyed on drop.
#[derive(Debug)]
struct Event {
    /// Released through `release_context` in `Drop`.
    ctx: ManuallyDrop<Arc<CudaContext>>,
    raw: CUevent,
}

impl Event {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let _scope = ContextScope::enter(ctx)?;
        let mut raw: CUevent = ptr::null_mut();
        // SAFETY: the context is current on this thread; `raw` is a valid out-pointer; the
        // flags are a valid CUevent_flags value.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, CUevent_flags::CU_EVENT_DEFAULT as u32)
        })?;
        Ok(Self {
            ctx: ManuallyDrop::new(Arc::clone(ctx)),
            raw,
        })
    }

    /// Enqueues the event on `stream` (null = legacy default stream).
    ///
    /// # Safety
    ///
    /// `stream` must be null or a live stream of the event's context.
    unsafe fn record(&self, stream: CUstream) -> Result<()> {
        let _scope = ContextScope::enter(&self.ctx)?;
        // SAFETY: `self.raw` is a live event of the current context; `stream` is null or a
        // live stream of that context (this function's contract).
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream)
        })
    }

    /// Milliseconds from `self` to `end`, waiting for `end` to complete first.
    fn elapsed_to(&self, end: &Event) -> Result<f32> {
        let _scope = ContextScope::enter(&self.ctx)?;
        // SAFETY: `end.raw` is a live event of the current context.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(end.raw)
        })?;
        let mut ms = 0f32;
        // SAFETY: both events are live, timing-enabled events of the current context; `ms` is
        // a valid out-pointer. (The cuda-12080 bindings name the v1 entry point, which every
        // 12.x and 13.x driver exports.)
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime(&mut ms, self.raw, end.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        {
            // Nothing can be reported from Drop: a failure to make the context current, or
            // to destroy the event, is ignored.
            let _scope = ContextScope::enter(&self.ctx).ok();
            // SAFETY: `self.raw` was created by cuEventCreate and is destroyed exactly once,
            // here. Destroying an event that is still pending is allowed: the driver
            // releases it once the event completes.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
        // SAFETY: `self.ctx` is taken exactly once, here, and not used afterwards.
        let ctx = unsafe { ManuallyDrop::take(&mut self.ctx) };
        release_context(ctx);
    }
}

// SAFETY: a CUevent is an opaque driver handle and the driver API is thread-safe; every use
// makes the owning context current on the calling thread first.
unsafe impl Send for Event {}
// SAFETY: as above; shared access only records, synchronizes on or reads the event.
unsafe impl Sync for Event {}

/// A start/stop pair of events for timing one span of a stream.
///
/// The `record_*` methods take a raw `CUstream`, which the driver would use unchecked, so
/// they are `unsafe`: the stream must be null (the legacy default stream) or a live stream
/// of the timer's context.
#[derive(Debug)]
pub struct EventTimer {
    start: Event,
    stop: Event,
}

impl EventTimer {
    /// Creates the two events in `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        Ok(Self {
            start: Event::new(ctx)?,
            stop: Event::new(ctx)?,
        })
    }

    /// Marks the start of the timed span on `stream`.
    ///
    /// # Safety
    ///
    /// `stream` must be null (the legacy default stream) or a live stream of the context
    /// the timer was created in.
    pub unsafe fn record_start(&self, stream: CUstream) -> Result<()> {
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.start.record(stream) }
    }

    /// Marks the end of the timed span on `stream`.
    ///
    /// # Safety
    ///
    /// As for [`EventTimer::record_start`].
    pub unsafe fn record_stop(&self, stream: CUstream) -> Result<()> {
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.stop.record(stream) }
    }

    /// Milliseconds between the two marks. Blocks until the stop mark has been reached.
    pub fn elapsed_ms(&self) -> Result<f32> {
        self.start.elapsed_to(&self.stop)
    }
}

/// Summary of a timed run, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingStats {
    pub median_ms: f32,
    pub min_ms: f32,
    pub max_ms: f32,
    /// Number of timed iterations (warm-up calls not included).
    pub iters: usize,
}

/// Median (mean of the two middle values for an even count), min and max. `None` when empty.
fn summarize(samples: &mut [f32]) -> Option<TimingStats> {
    let n = samples.len();
    if n == 0 {
        return None;
    }
    samples.sort_by(f32::total_cmp);
    let median_ms = if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    };
    Some(TimingStats {
        median_ms,
        min_ms: samples[0],
        max_ms: samples[n - 1],
        iters: n,
    })
}

/// Times `f` (which should enqueue work on `stream`) `iters` times after `warmup` untimed
/// calls, and summarizes the per-iteration GPU times.
///
/// Each call gets a start and a stop event of its own (`start_i, call_i, stop_i`), with no
/// host synchronization in between, and iteration `i` is the span `start_i -> stop_i`:
/// the way `torch.cuda.Event` timing (the SDPA scripts, the harness) brackets a call, so
/// figures set beside theirs are taken alike. One event between consecutive calls
/// instead (`e_i, call_i, e_{i+1}`) timed the same kernels up to 0.7 µs slower on the
/// H200 (a 15 µs decode step: 15.5–15.7 against 15.0–15.2; a 1 ms forward: level).
/// (With `warmup == 0`, the first span may include the first launch's host overhead.)
///
/// `f` must enqueue its work on `stream`. Errors from `f` are returned as they are.
///
/// # Safety
///
/// `stream` must be null (the legacy default stream) or a live stream of `ctx`, and stay
/// live until this function returns.
pub unsafe fn median_ms(
    ctx: &Arc<CudaContext>,
    stream: CUstream,
    warmup: usize,
    iters: usize,
    f: impl FnMut() -> Result<()>,
) -> Result<TimingStats> {
    // SAFETY: this function's contract, passed on unchanged.
    unsafe { median_ms_after(ctx, stream, warmup, iters, || Ok(()), f) }
}

/// GPU work queued ahead of timed calls: `passes` clears of `bytes` bytes at device
/// address `ptr`.
#[derive(Debug, Clone, Copy)]
pub struct Backlog {
    pub ptr: u64,
    pub bytes: usize,
    pub passes: usize,
}

impl Backlog {
    /// Clears of the `bytes` at `ptr` enough to outlast the host's queueing of `calls`
    /// launches: 64 MiB a call (about 21 µs on an H100 at 3 TB/s, twice a forward call's
    /// host time), and at least 8 passes.
    pub fn covering(ptr: u64, bytes: usize, calls: usize) -> Backlog {
        Backlog {
            ptr,
            bytes,
            passes: (calls * (64 << 20)).div_ceil(bytes.max(1)).max(8),
        }
    }
}

/// [`median_ms`] with `backlog` queued on `stream` between the warm-up and the timed
/// calls. The host then queues the timed calls while the GPU is still busy, so each span
/// holds the call's GPU time and not the host's launch overhead: the way the SDPA scripts
/// time (behind `torch.cuda._sleep`). A call whose launch takes longer on the host than it
/// runs on the GPU otherwise leaves the GPU idle inside its span.
///
/// The backlog must last while the host queues the calls ([`Backlog::covering`]).
///
/// # Safety
///
/// As for [`median_ms`]; `backlog.ptr` must be `backlog.bytes` live bytes of `ctx` that
/// nothing else uses while this runs.
pub unsafe fn median_ms_queued(
    ctx: &Arc<CudaContext>,
    stream: CUstream,
    backlog: Backlog,
    warmup: usize,
    iters: usize,
    f: impl FnMut() -> Result<()>,
) -> Result<TimingStats> {
    let queue = || {
        for _ in 0..backlog.passes {
            // SAFETY: the bytes are live memory of the current context (this function's
            // contract); `stream` is null or a live stream of it.
            check("cuMemsetD8Async", unsafe {
                sys::cuMemsetD8Async(backlog.ptr, 0, backlog.bytes, stream)
            })?;
        }
        Ok(())
    };
    // SAFETY: this function's contract, passed on unchanged.
    unsafe { median_ms_after(ctx, stream, warmup, iters, queue, f) }
}

/// [`median_ms`], running `before_timing` (on the host, with the context current) after
/// the warm-up calls and before the first timed one.
///
/// # Safety
///
/// As for [`median_ms`]; whatever `before_timing` enqueues must be valid work on `stream`.
unsafe fn median_ms_after(
    ctx: &Arc<CudaContext>,
    stream: CUstream,
    warmup: usize,
    iters: usize,
    before_timing: impl FnOnce() -> Result<()>,
    mut f: impl FnMut() -> Result<()>,
) -> Result<TimingStats> {
    if iters == 0 {
        return Err(Error::InvalidArgument(
            "median_ms needs at least one timed iteration".into(),
        ));
    }
    // One scope for the whole run: the calls inside find the context current already.
    let _scope = ContextScope::enter(ctx)?;
    let marks = (0..iters)
        .map(|_| Ok((Event::new(ctx)?, Event::new(ctx)?)))
        .collect::<Result<Vec<_>>>()?;
    for _ in 0..warmup {
        f()?;
    }
    before_timing()?;
    for (start, stop) in &marks {
        // SAFETY: `stream` is null or a live stream of `ctx`, in which every mark was
        // created (this function's contract).
        unsafe { start.record(stream) }?;
        f()?;
        // SAFETY: as above.
        unsafe { stop.record(stream) }?;
    }
    let mut samples = marks
        .iter()
        .map(|(start, stop)| start.elapsed_to(stop))
        .collect::<Result<Vec<_>>>()?;
    // `iters > 0` was checked, so there is at least one sample.
    summarize(&mut samples)
        .ok_or_else(|| Error::InvalidArgument("median_ms recorded no samples".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backlog_covers_64_mib_a_call_and_at_least_8_passes() {
        let passes = |bytes, calls| Backlog::covering(0, bytes, calls).passes;
        assert_eq!(passes(1 << 30, 30), 8);
        assert_eq!(passes(1 << 30, 300), 19);
        assert_eq!(passes(256 << 20, 30), 8);
        assert_eq!(passes(256 << 20, 1000), 250);
        assert_eq!(passes(64 << 20, 9), 9);
    }

    #[test]
    fn summarize_odd_even_and_empty() {
        let s = summarize(&mut [3.0, 1.0, 2.0]).unwrap();
        assert_eq!(
            (s.median_ms, s.min_ms, s.max_ms, s.iters),
            (2.0, 1.0, 3.0, 3)
        );
        let s = summarize(&mut [4.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!(
            (s.median_ms, s.min_ms, s.max_ms, s.iters),
            (2.5, 1.0, 4.0, 4)
        );
        let s = summarize(&mut [0.5]).unwrap();
        assert_eq!((s.median_ms, s.min_ms, s.max_ms), (0.5, 0.5, 0.5));
        assert!(summarize(&mut []).is_none());
    }
}
