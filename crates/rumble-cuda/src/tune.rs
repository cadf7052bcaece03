//! What the tuners share (the matmul tuner, `matmul_tune`, the attention choice,
//! `cudnn::recipe`, and the decode attention's split length, `decode::split_keys`): timing a
//! launch with CUDA events (or as a graph replays it), and the per-GPU files in the kernel cache
//! folder that remember each shape's choice, one `key<TAB>value` line each (the last line of a
//! key wins), so every later process on the machine runs what the first one chose.

use std::io::Write;
use std::path::{Path, PathBuf};

use cudarc::driver::{result as drv, sys as dsys};

use crate::device::Device;
use crate::error::{DriverContext, Result};

/// Whether the device's stream is capturing a graph (or that cannot be told): nothing is timed
/// then.
pub(crate) fn capturing(dev: &Device) -> bool {
    unsafe { drv::stream::is_capturing(dev.stream()) }
        .map(|s| s != dsys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        .unwrap_or(true)
}

/// Milliseconds per call of `run`, enqueued `runs` times back to back after one untimed call
/// (CUDA events on the device's stream; `what` names the tuner in errors).
pub(crate) fn time_ms(dev: &Device, runs: usize, what: &str, run: impl Fn() -> Result<()>) -> Result<f64> {
    run()?;
    let ev = || drv::event::create(dsys::CUevent_flags::CU_EVENT_DEFAULT).ctx(|| format!("{what}: cuEventCreate"));
    let (e0, e1) = (ev()?, ev()?);
    let timed = (|| -> Result<f64> {
        let rec = |e| unsafe { drv::event::record(e, dev.stream()) }.ctx(|| format!("{what}: cuEventRecord"));
        rec(e0)?;
        for _ in 0..runs {
            run()?;
        }
        rec(e1)?;
        dev.synchronize()?;
        let ms = unsafe { drv::event::elapsed(e0, e1) }.ctx(|| format!("{what}: cuEventElapsedTime"))?;
        Ok(ms as f64 / runs.max(1) as f64)
    })();
    unsafe {
        let _ = drv::event::destroy(e0);
        let _ = drv::event::destroy(e1);
    }
    timed
}

/// Milliseconds per call of `run` as a CUDA graph replays it: `runs` calls captured into one
/// graph, replayed once untimed and [`GRAPH_REPLAYS`] times timed. For kernels of a few
/// microseconds, about what a launch from the host costs, [`time_ms`] would time the launches;
/// a decode step replays them from a graph.
pub(crate) fn graph_time_ms(dev: &Device, runs: usize, what: &str, run: impl Fn() -> Result<()>) -> Result<f64> {
    let stream = dev.stream();
    unsafe { drv::stream::begin_capture(stream, dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
        .ctx(|| format!("{what}: cuStreamBeginCapture"))?;
    let body = (0..runs).try_for_each(|_| run());
    let ended = unsafe { drv::stream::end_capture(stream) }.ctx(|| format!("{what}: cuStreamEndCapture"));
    // A recording that failed leaves no graph behind; its error is the one to report.
    if let (Err(_), Ok(g)) = (&body, &ended) {
        unsafe {
            let _ = drv::graph::destroy(*g);
        }
    }
    body?;
    let graph = ended?;
    let exec = unsafe { drv::graph::instantiate(graph, dsys::CUgraphInstantiate_flags(0)) }
        .ctx(|| format!("{what}: cuGraphInstantiate"));
    let timed = exec.and_then(|exec| {
        let launch = || unsafe { drv::graph::launch(exec, stream) }.ctx(|| format!("{what}: cuGraphLaunch"));
        let t = time_ms(dev, GRAPH_REPLAYS, what, launch);
        unsafe {
            let _ = drv::graph::exec_destroy(exec);
        }
        t
    });
    unsafe {
        let _ = drv::graph::destroy(graph);
    }
    Ok(timed? / runs.max(1) as f64)
}

/// Timed replays of [`graph_time_ms`]'s graph (after one untimed).
const GRAPH_REPLAYS: usize = 3;

/// `<cache>/<what>-<gpu>-<version>.txt`, or `None` without a kernel cache folder.
pub(crate) fn cache_file(dev: &Device, what: &str, version: impl std::fmt::Display) -> Option<PathBuf> {
    let dir = dev.knobs().cache?;
    let gpu: String = dev.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    Some(dir.join(format!("{what}-{gpu}-{version}.txt")))
}

/// The value last remembered for `key` in `file`.
pub(crate) fn remembered(file: &Path, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines().rev().find_map(|l| Some(l.strip_prefix(key)?.strip_prefix('\t')?.trim().to_string()))
}

/// Appends one line (a whole line per write: concurrent processes at worst repeat a key). A
/// file that cannot be written only loses the choice.
pub(crate) fn remember(file: &Path, key: &str, value: &str) {
    if let Some(d) = file.parent() {
        let _ = std::fs::create_dir_all(d);
    }
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(file) {
        let _ = f.write_all(format!("{key}\t{value}\n").as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_line_of_a_key_wins() {
        let dir = std::env::temp_dir().join(format!("rumble-tune-{}", std::process::id()));
        let f = dir.join("choices.txt");
        assert_eq!(remembered(&f, "k1"), None);
        remember(&f, "k1", "cudnn");
        remember(&f, "k2", "3");
        assert_eq!((remembered(&f, "k1").as_deref(), remembered(&f, "k2").as_deref()), (Some("cudnn"), Some("3")));
        remember(&f, "k1", "flash");
        assert_eq!(remembered(&f, "k1").as_deref(), Some("flash"));
        // A key that is the prefix of another's is not that one.
        assert_eq!(remembered(&f, "k"), None);
        let _ = std::fs::remove_dir_all(dir);
    }
}
