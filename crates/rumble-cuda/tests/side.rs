//! The side stream of collectives of several ranks (`exec::SideStream`), on one GPU with a
//! device copy standing in for NCCL (a communicator of two ranks needs two GPUs): issued from
//! the step's stream, it runs beside the work after it; the step's stream waits for it before
//! its join, or at the end of the launched range; captured into a graph the same way, the
//! replayed graph gives the same bytes.

mod common;

use common::gpu;
use cudarc::driver::{result as drv, sys};
use rumble_cuda::exec::SideStream;
use rumble_cuda::memory::{DeviceBuffer, download};

const BYTES: usize = 64 << 20;

fn pattern(seed: usize) -> Vec<u8> {
    (0..BYTES).map(|i| ((i * 7 + seed) % 251) as u8).collect()
}

/// Enqueues a three-node "step" on the device's stream: node 0 issues the copy `a -> b` on the
/// side stream, node 1 fills `c` beside it, node 2 (the join, when `join == 2`) copies `b -> c`;
/// the range `0..3` ends joined.
fn enqueue(side: &SideStream, main: sys::CUstream, a: &DeviceBuffer, b: &DeviceBuffer, c: &DeviceBuffer, join: usize) {
    let range = 0..3;
    let s = unsafe { side.fork(main) }.unwrap();
    unsafe { drv::memcpy_dtod_async(b.ptr, a.ptr, BYTES, s) }.unwrap();
    side.issued(0).unwrap();
    unsafe { side.join(main, 1, &range) }.unwrap();
    unsafe { drv::memset_d8_async(c.ptr, 3, BYTES, main) }.unwrap();
    unsafe { side.join(main, 2, &range) }.unwrap();
    if join == 2 {
        unsafe { drv::memcpy_dtod_async(c.ptr, b.ptr, BYTES, main) }.unwrap();
    }
    unsafe { side.join(main, range.end, &range) }.unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_side_stream_runs_beside_the_step_and_joins_in_a_captured_graph() {
    let dev = gpu();
    dev.bind().unwrap();
    let main = dev.stream();
    let (a, b, c) = (
        DeviceBuffer::new(&dev, BYTES, "a").unwrap(),
        DeviceBuffer::new(&dev, BYTES, "b").unwrap(),
        DeviceBuffer::new(&dev, BYTES, "c").unwrap(),
    );
    for join in [2, 3] {
        // Eagerly: the join node reads the whole copy.
        let side = SideStream::new(&[(0, join)], 3).unwrap().expect("one collective");
        assert_eq!((side.at(0), side.at(1)), (Some(0), None));
        a.upload(&dev, 0, &pattern(join)).unwrap();
        enqueue(&side, main, &a, &b, &c, join);
        dev.synchronize().unwrap();
        assert!(download(&dev, b.ptr, BYTES).unwrap() == pattern(join), "join {join}: the side copy");
        let want_c = if join == 2 { pattern(join) } else { vec![3; BYTES] };
        assert!(download(&dev, c.ptr, BYTES).unwrap() == want_c, "join {join}: the step after the join");

        // Captured (every stream joined by the range's end, or the capture fails), then replayed
        // on new bytes.
        unsafe { drv::stream::begin_capture(main, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .unwrap();
        enqueue(&side, main, &a, &b, &c, join);
        let graph = unsafe { drv::stream::end_capture(main) }.expect("the capture ends joined");
        let exec = unsafe { drv::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }.unwrap();
        a.upload(&dev, 0, &pattern(join + 10)).unwrap();
        unsafe { drv::memset_d8_async(b.ptr, 0, BYTES, main) }.unwrap();
        unsafe { drv::graph::launch(exec, main) }.unwrap();
        dev.synchronize().unwrap();
        assert!(download(&dev, b.ptr, BYTES).unwrap() == pattern(join + 10), "join {join}: replayed side copy");
        let want_c = if join == 2 { pattern(join + 10) } else { vec![3; BYTES] };
        assert!(download(&dev, c.ptr, BYTES).unwrap() == want_c, "join {join}: replayed step after the join");
        unsafe {
            drv::graph::exec_destroy(exec).unwrap();
            drv::graph::destroy(graph).unwrap();
        }
    }
    // No collective of several ranks: no side stream.
    assert!(SideStream::new(&[], 3).unwrap().is_none());
    // A join before its collective is refused.
    assert!(SideStream::new(&[(2, 1)], 3).is_err());
}
