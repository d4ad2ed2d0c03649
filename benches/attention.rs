//! Forward-attention benches, grouped by the kernel path the GPU dispatches to, timed with
//! CUDA events (criterion's custom timing). Throughput is reported twice: "elements" are
//! FLOPs (so `Telem/s` reads as TFLOP/s) and bytes are Q, K, V and O moved once.
//!
//! `cargo bench` on a machine without a GPU prints a notice and measures nothing.

use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUgraphInstantiate_flags;
use cudarc::driver::sys::CUstreamCaptureMode;

use flashcore::check::{BENCH_SHAPES, DeviceCase, FwdCase, Layout};
use flashcore::host::attention::{Attention, path_for_arch};
use flashcore::host::device::{Device, driver_present};
use flashcore::host::tensor::AttentionParams;
use flashcore::host::timing::EventTimer;
use flashcore::kernels::attention::HalfType;
use flashcore::reference::Rng;
use flashcore::shape::AttnShape;

fn case(b: usize, h: usize, s: usize, d: usize, causal: bool) -> FwdCase {
    FwdCase {
        shape: AttnShape::square(b, h, s, d),
        dtype: HalfType::F16,
        causal,
        layout: Layout::Bhsd,
        kernel: None,
    }
}

/// Enough input sets of `case` to exceed twice the L2 cache, so timings are not L2 hits.
fn input_sets(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    case: FwdCase,
    rng: &mut Rng,
) -> Vec<DeviceCase> {
    let l2 = attn.device().l2_bytes() as usize;
    let sets = (2 * l2).div_ceil(case.bytes()).clamp(1, 64);
    (0..sets)
        .map(|_| DeviceCase::for_timing(stream, case, rng).expect("upload"))
        .collect()
}

fn main() {
    if !driver_present() {
        println!("flashcore benches: no CUDA driver on this machine; nothing measured");
        return;
    }
    let device = Arc::new(Device::new(0).expect("CUDA device 0"));
    let attn = Attention::new(device.clone()).expect("an sm_80+ GPU");
    let path = path_for_arch(device.compute_capability()).expect("a kernel path");
    // A stream of our own: graph capture cannot use the legacy default stream.
    let stream = device.context().new_stream().expect("stream");
    let timer = EventTimer::new(device.context()).expect("events");
    let mut rng = Rng::from_entropy();
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();

    let mut group = c.benchmark_group(format!("forward/{}/{}", path.name(), device.arch_name()));
    for (b, h, s, d) in BENCH_SHAPES {
        for causal in [false, true] {
            let case = case(b, h, s, d, causal);
            let sets = input_sets(&attn, &stream, case, &mut rng);
            let params = AttentionParams {
                softmax_scale: None,
                causal,
            };
            sets[0].run(&attn, &params).expect("first run");
            group.throughput(Throughput::ElementsAndBytes {
                elements: case.flops() as u64,
                bytes: case.bytes() as u64,
            });
            let id = format!("B{b}_H{h}_S{s}_D{d}{}", if causal { "_causal" } else { "" });
            group.bench_function(BenchmarkId::from_parameter(id), |bench| {
                bench.iter_custom(|iters| {
                    // SAFETY: `stream` is a live stream of the device's context, as is the timer.
                    unsafe { timer.record_start(stream.cu_stream()) }.expect("event");
                    for i in 0..iters as usize {
                        sets[i % sets.len()].run(&attn, &params).expect("forward");
                    }
                    // SAFETY: as for record_start.
                    unsafe { timer.record_stop(stream.cu_stream()) }.expect("event");
                    Duration::from_secs_f64(timer.elapsed_ms().expect("elapsed") as f64 / 1e3)
                })
            });
        }
    }
    group.finish();

    // Launch overhead: the reference shape replayed from a CUDA graph of 20 calls.
    let mut group = c.benchmark_group(format!("graph/{}/{}", path.name(), device.arch_name()));
    let reference_shape = case(2, 8, 512, 64, false);
    let sets = input_sets(&attn, &stream, reference_shape, &mut rng);
    let params = AttentionParams::default();
    let views: Vec<_> = sets.iter().map(DeviceCase::views).collect();
    let per_graph = 20;
    sets[0]
        .run(&attn, &params)
        .expect("warm the module cache before capture");
    stream.synchronize().expect("sync");
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("capture");
    for i in 0..per_graph {
        let ([q, k, v, o], lse) = &views[i % views.len()];
        // SAFETY: views of `sets`' live buffers, made on `stream`, which outlive the graph.
        unsafe { attn.forward(q, k, v, o, Some(lse), &params, stream.cu_stream()) }
            .expect("captured forward");
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .expect("end capture")
        .expect("a graph");
    group.throughput(Throughput::Elements(
        reference_shape.flops() as u64 * per_graph as u64,
    ));
    group.bench_function("B2_H8_S512_D64_x20_graph", |bench| {
        bench.iter_custom(|iters| {
            // SAFETY: `stream` is a live stream of the device's context, as is the timer.
            unsafe { timer.record_start(stream.cu_stream()) }.expect("event");
            for _ in 0..iters {
                graph.launch().expect("graph launch");
            }
            // SAFETY: as for record_start.
            unsafe { timer.record_stop(stream.cu_stream()) }.expect("event");
            Duration::from_secs_f64(timer.elapsed_ms().expect("elapsed") as f64 / 1e3)
        })
    });
    group.bench_function("B2_H8_S512_D64_x20_eager", |bench| {
        bench.iter_custom(|iters| {
            // SAFETY: `stream` is a live stream of the device's context, as is the timer.
            unsafe { timer.record_start(stream.cu_stream()) }.expect("event");
            for _ in 0..iters {
                for i in 0..per_graph {
                    let ([q, k, v, o], lse) = &views[i % views.len()];
                    // SAFETY: as for the captured calls above.
                    unsafe { attn.forward(q, k, v, o, Some(lse), &params, stream.cu_stream()) }
                        .expect("forward");
                }
            }
            // SAFETY: as for record_start.
            unsafe { timer.record_stop(stream.cu_stream()) }.expect("event");
            Duration::from_secs_f64(timer.elapsed_ms().expect("elapsed") as f64 / 1e3)
        })
    });
    group.finish();
    c.final_summary();
}
