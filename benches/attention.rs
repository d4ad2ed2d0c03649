//! Forward-attention benches, grouped by the kernel path the GPU dispatches to, timed with
//! CUDA events (criterion's custom timing). Throughput is reported twice: "elements" are
//! FLOPs (so `Telem/s` reads as TFLOP/s) and bytes are Q, K, V and O moved once.
//!
//! The decode group times split-KV decode (Sq 1, Hq 32, Hkv 8, D 128, f16) against full
//! caches of 8192 positions, contiguous and paged (pages of 16 in shuffled order); its
//! throughput is the K and V bytes read (so `GiB/s` is the cache bandwidth). It also times
//! a prefill chunk of 1024 causal queries against one such cache (which runs on the
//! forward kernels), in FLOPs.
//!
//! The serving-batch group times one prompt chunk of 512 queries and fifteen decode
//! steps packed in one call (`Attention::decode_varlen`) against caches of 8192
//! positions, contiguous and paged, in FLOPs.
//!
//! The varlen group times packed (variable-length) batches, Hq 32, Hkv 8, D 128, f16:
//! eight causal prompts of 128 to 4096 tokens (throughput in FLOPs) and sixteen decode
//! steps of one query against 8192 keys each, which run on the decode kernels
//! (throughput in K and V bytes read).
//!
//! `cargo bench` on a machine without a GPU prints a notice and measures nothing.

use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use cudarc::driver::sys::CUgraphInstantiate_flags;
use cudarc::driver::sys::CUstreamCaptureMode;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use flashcore::check::{BENCH_SHAPES, DeviceCase, FwdCase, Layout};
use flashcore::host::attention::{Attention, path_for_arch};
use flashcore::host::decode::Workspace;
use flashcore::host::decode_varlen::PackedQueries;
use flashcore::host::device::{Device, driver_present};
use flashcore::host::kv_cache::{CacheLayout, KvCache};
use flashcore::host::tensor::{AttentionParams, DType, TensorView};
use flashcore::host::timing::EventTimer;
use flashcore::host::varlen::Varlen;
use flashcore::kernels::attention::HalfType;
use flashcore::reference::{self, Rng};
use flashcore::shape::AttnShape;

fn case(b: usize, h: usize, s: usize, d: usize, causal: bool) -> FwdCase {
    FwdCase {
        shape: AttnShape::square(b, h, s, d),
        dtype: HalfType::F16,
        causal,
        window: Default::default(),
        layout: Layout::Bhsd,
        kernel: None,
        softcap: None,
        softmax_scale: None,
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

/// Times `iters` calls of `call(i)` (`i` counting from 0) between two CUDA events on
/// `stream`: criterion's custom timing.
fn timed(
    timer: &EventTimer,
    stream: &CudaStream,
    iters: u64,
    mut call: impl FnMut(usize),
) -> Duration {
    // SAFETY: `stream` is a live stream of the device's context, as is the timer.
    unsafe { timer.record_start(stream.cu_stream()) }.expect("event");
    for i in 0..iters as usize {
        call(i);
    }
    // SAFETY: as for record_start.
    unsafe { timer.record_stop(stream.cu_stream()) }.expect("event");
    Duration::from_secs_f64(timer.elapsed_ms().expect("elapsed") as f64 / 1e3)
}

/// Decode shapes: (batch, Skv), each with Hq 32, Hkv 8, D 128, Sq 1.
const DECODE_SHAPES: [(usize, usize); 2] = [(1, 8192), (16, 8192)];
/// Decode cache layouts: 0 contiguous, else the page size.
const DECODE_PAGES: [usize; 2] = [0, 16];
/// Queries of the decode group's prefill chunk (against its first shape's cache).
const PREFILL_CHUNK: usize = 1024;

/// One decode shape's buffers on the device: enough copies of the cache (K, V and, paged,
/// a shuffled block table) to exceed twice the L2 cache, the lengths (every sequence full),
/// q and o of `sq` queries, and the workspace the plan needs.
struct DecodeBuffers {
    caches: Vec<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<i32>)>,
    lens: CudaSlice<i32>,
    q: CudaSlice<u16>,
    o: CudaSlice<u16>,
    workspace: CudaSlice<u8>,
}

impl DecodeBuffers {
    /// A workspace of `bytes` at a 256-byte aligned address, in a buffer `self` holds
    /// from now on; none when `bytes` is 0.
    fn workspace(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Option<Workspace> {
        self.workspace = stream.alloc_zeros(bytes + 256).expect("alloc");
        (bytes > 0).then(|| Workspace {
            ptr: self.workspace.device_ptr(stream).0.next_multiple_of(256),
            bytes,
        })
    }

    /// Input set `i`'s cache of `b` sequences of `skv` positions: contiguous (`page` 0)
    /// or in pages of `page` positions through its shuffled block table.
    fn cache_view(
        &self,
        stream: &Arc<CudaStream>,
        i: usize,
        (b, skv): (usize, usize),
        (hkv, d): (usize, usize),
        page: usize,
    ) -> KvCache {
        let (k, v, table) = &self.caches[i];
        let (k, v) = (k.device_ptr(stream).0, v.device_ptr(stream).0);
        let seqlens = self.lens.device_ptr(stream).0;
        match skv.checked_div(page) {
            None => KvCache {
                k: TensorView::bshd(k, DType::F16, b, skv, hkv, d),
                v: TensorView::bshd(v, DType::F16, b, skv, hkv, d),
                seqlens,
                layout: CacheLayout::Contiguous,
                scales: None,
            },
            Some(max_pages) => KvCache {
                k: TensorView::bshd(k, DType::F16, b * max_pages, page, hkv, d),
                v: TensorView::bshd(v, DType::F16, b * max_pages, page, hkv, d),
                seqlens,
                layout: CacheLayout::Paged {
                    block_table: table.device_ptr(stream).0,
                    max_pages,
                    table_stride: max_pages,
                },
                scales: None,
            },
        }
    }
}

fn decode_buffers(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    rng: &mut Rng,
    (b, sq, skv): (usize, usize, usize),
    (hq, hkv, d): (usize, usize, usize),
    page: usize,
) -> DecodeBuffers {
    let kv_elems = b * skv * hkv * d;
    let kv_bytes = 2 * kv_elems * 2;
    let copies = (2 * attn.device().l2_bytes() as usize)
        .div_ceil(kv_bytes)
        .clamp(1, 64);
    let (pool, _) = reference::random_half(rng, 1 << 16, HalfType::F16);
    let fill: Vec<u16> = (0..kv_elems)
        .map(|i| pool[(i * 7 + 13) % pool.len()])
        .collect();
    let pages = kv_elems.checked_div(page * hkv * d).unwrap_or(1); // contiguous: unused
    let caches = (0..copies)
        .map(|_| {
            let mut order: Vec<i32> = (0..pages as i32).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            (
                stream.clone_htod(&fill).expect("upload"),
                stream.clone_htod(&fill).expect("upload"),
                stream.clone_htod(&order).expect("upload"),
            )
        })
        .collect();
    DecodeBuffers {
        caches,
        lens: stream.clone_htod(&vec![skv as i32; b]).expect("upload"),
        q: stream
            .clone_htod(&fill.repeat((sq * hq).div_ceil(skv * hkv))[..b * sq * hq * d])
            .expect("upload"),
        o: stream.alloc_zeros(b * sq * hq * d).expect("alloc"),
        workspace: stream.alloc_zeros(1).expect("alloc"),
    }
}

/// Split-KV decode against full caches, contiguous and paged, CUDA-event timed.
fn decode_group(
    c: &mut Criterion,
    attn: &Attention,
    stream: &Arc<CudaStream>,
    timer: &EventTimer,
    rng: &mut Rng,
) {
    let (hq, hkv, d) = (32, 8, 128);
    let mut group = c.benchmark_group(format!("decode/{}", attn.device().arch_name()));
    let steps = DECODE_SHAPES.map(|(b, skv)| (b, 1, skv));
    let chunk = (DECODE_SHAPES[0].0, PREFILL_CHUNK, DECODE_SHAPES[0].1);
    for (b, sq, skv) in steps.into_iter().chain([chunk]) {
        for page in DECODE_PAGES {
            let mut bufs = decode_buffers(attn, stream, rng, (b, sq, skv), (hq, hkv, d), page);
            let views: Vec<KvCache> = (0..bufs.caches.len())
                .map(|i| bufs.cache_view(stream, i, (b, skv), (hkv, d), page))
                .collect();
            let qv = TensorView::bshd(bufs.q.device_ptr(stream).0, DType::F16, b, sq, hq, d);
            let ov = TensorView::bshd(bufs.o.device_ptr(stream).0, DType::F16, b, sq, hq, d);
            let ws_bytes = attn
                .decode_workspace_bytes(&qv, &views[0])
                .expect("decode plan");
            let workspace = bufs.workspace(stream, ws_bytes);
            // A prefill chunk is causal, bottom-right: its queries are the cache's last.
            let params = AttentionParams {
                causal: sq > 1,
                ..AttentionParams::default()
            };
            let run = |i: usize| {
                // SAFETY: every view points into `bufs`' live buffers, sized for it, on
                // `stream`, which they outlive (the group synchronizes through the timer).
                unsafe {
                    attn.decode(
                        &qv,
                        &views[i % views.len()],
                        None,
                        &ov,
                        None,
                        &params,
                        workspace,
                        stream.cu_stream(),
                    )
                }
            };
            run(0).expect("first decode");
            let pairs: usize = (0..sq).map(|i| (skv + i + 1).saturating_sub(sq)).sum();
            group.throughput(if sq == 1 {
                Throughput::Bytes((2 * b * skv * hkv * d * 2) as u64)
            } else {
                Throughput::Elements((4 * b * hq * d * pairs) as u64)
            });
            let layout = if page == 0 {
                "contiguous".to_string()
            } else {
                format!("page{page}")
            };
            let id = format!("B{b}_Sq{sq}_Hq{hq}_Hkv{hkv}_D{d}_Skv{skv}_{layout}");
            group.bench_function(BenchmarkId::from_parameter(id), |bench| {
                bench.iter_custom(|iters| timed(timer, stream, iters, |i| run(i).expect("decode")))
            });
            stream.synchronize().expect("sync");
        }
    }
    group.finish();
}

/// Query runs of the serving-batch group: one prompt chunk among fifteen decode steps.
const SERVING_RUNS: [usize; 16] = [512, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];

/// A serving batch in one call (`Attention::decode_varlen`): the queries of
/// [`SERVING_RUNS`] packed, each against a full cache of 8192 positions, contiguous and
/// paged, causal; throughput in FLOPs.
fn serving_batch_group(
    c: &mut Criterion,
    attn: &Attention,
    stream: &Arc<CudaStream>,
    timer: &EventTimer,
    rng: &mut Rng,
) {
    let (hq, hkv, d, skv) = (32, 8, 128, 8192);
    let b = SERVING_RUNS.len();
    let total: usize = SERVING_RUNS.iter().sum();
    let max = SERVING_RUNS.iter().copied().max().unwrap_or(1);
    let mut group = c.benchmark_group(format!("serving_batch/{}", attn.device().arch_name()));
    let offsets: Vec<i32> = std::iter::once(0)
        .chain(SERVING_RUNS.iter().scan(0, |at, &n| {
            *at += n as i32;
            Some(*at)
        }))
        .collect();
    let cu = stream.clone_htod(&offsets).expect("upload");
    for page in DECODE_PAGES {
        let mut bufs = decode_buffers(attn, stream, rng, (b, max, skv), (hq, hkv, d), page);
        let cache = bufs.cache_view(stream, 0, (b, skv), (hkv, d), page);
        let qv = TensorView::bshd(bufs.q.device_ptr(stream).0, DType::F16, 1, total, hq, d);
        let ov = TensorView::bshd(bufs.o.device_ptr(stream).0, DType::F16, 1, total, hq, d);
        let queries = PackedQueries {
            cu_seqlens_q: cu.device_ptr(stream).0,
            batch: b,
            max_seqlen_q: max,
            host: None,
        };
        let ws_bytes = attn
            .decode_varlen_workspace_bytes(&qv, &cache, &queries)
            .expect("plan");
        let workspace = bufs.workspace(stream, ws_bytes);
        let params = AttentionParams {
            causal: true,
            ..AttentionParams::default()
        };
        let run = || {
            // SAFETY: every view points into `bufs`' and `cu`'s live buffers, sized for
            // it, on `stream`, which they outlive.
            unsafe {
                attn.decode_varlen(
                    &qv,
                    &cache,
                    &queries,
                    None,
                    &ov,
                    None,
                    &params,
                    workspace,
                    stream.cu_stream(),
                )
            }
        };
        run().expect("first serving batch");
        let pairs: usize = SERVING_RUNS
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|i| (skv + i + 1).saturating_sub(n))
                    .sum::<usize>()
            })
            .sum();
        group.throughput(Throughput::Elements((4 * hq * d * pairs) as u64));
        let layout = if page == 0 {
            "contiguous".to_string()
        } else {
            format!("page{page}")
        };
        let id = format!("B{b}_Sq{total}max{max}_Hq{hq}_Hkv{hkv}_D{d}_Skv{skv}_{layout}");
        group.bench_function(BenchmarkId::from_parameter(id), |bench| {
            bench
                .iter_custom(|iters| timed(timer, stream, iters, |_| run().expect("serving batch")))
        });
        stream.synchronize().expect("sync");
    }
    group.finish();
}

/// A packed batch: (query rows, key rows) per sequence.
struct PackedBatch {
    name: &'static str,
    lens: Vec<(usize, usize)>,
    causal: bool,
}

fn varlen_batches() -> [PackedBatch; 2] {
    let prompts = [4096, 333, 2048, 1500, 777, 3000, 128, 1024];
    [
        PackedBatch {
            name: "prompts",
            lens: prompts.iter().map(|&l| (l, l)).collect(),
            causal: true,
        },
        PackedBatch {
            name: "decode_steps",
            lens: vec![(1, 8192); 16],
            causal: false,
        },
    ]
}

/// Packed (variable-length) forward calls, CUDA-event timed. Each batch's K and V are
/// larger than twice the L2 cache on their own.
fn varlen_group(
    c: &mut Criterion,
    attn: &Attention,
    stream: &Arc<CudaStream>,
    timer: &EventTimer,
    rng: &mut Rng,
) {
    let (hq, hkv, d) = (32, 8, 128);
    let mut group = c.benchmark_group(format!("varlen/{}", attn.device().arch_name()));
    let (pool, _) = reference::random_half(rng, 1 << 16, HalfType::F16);
    let fill = |n: usize| -> Vec<u16> { (0..n).map(|i| pool[(i * 7 + 13) % pool.len()]).collect() };
    for PackedBatch { name, lens, causal } in varlen_batches() {
        let offsets = |rows: &dyn Fn(&(usize, usize)) -> usize| -> Vec<i32> {
            let mut cu = vec![0i32];
            for l in &lens {
                cu.push(cu[cu.len() - 1] + rows(l) as i32);
            }
            cu
        };
        let (cu_q, cu_k) = (offsets(&|l| l.0), offsets(&|l| l.1));
        let (tq, tk) = (cu_q[lens.len()] as usize, cu_k[lens.len()] as usize);
        let q = stream.clone_htod(&fill(tq * hq * d)).expect("upload");
        let k = stream.clone_htod(&fill(tk * hkv * d)).expect("upload");
        let v = stream.clone_htod(&fill(tk * hkv * d)).expect("upload");
        let o = stream.alloc_zeros::<u16>(tq * hq * d).expect("alloc");
        let cu_q_dev = stream.clone_htod(&cu_q).expect("upload");
        let cu_k_dev = stream.clone_htod(&cu_k).expect("upload");
        let view = |x: &CudaSlice<u16>, rows, h| {
            TensorView::bshd(x.device_ptr(stream).0, DType::F16, 1, rows, h, d)
        };
        let (qv, kv, vv, ov) = (
            view(&q, tq, hq),
            view(&k, tk, hkv),
            view(&v, tk, hkv),
            view(&o, tq, hq),
        );
        let varlen = Varlen {
            cu_seqlens_q: cu_q_dev.device_ptr(stream).0,
            cu_seqlens_k: cu_k_dev.device_ptr(stream).0,
            batch: lens.len(),
            max_seqlen_q: lens.iter().map(|l| l.0).max().unwrap_or(1),
            host: None,
        };
        let params = AttentionParams {
            softmax_scale: None,
            causal,
            ..Default::default()
        };
        let run = || {
            // SAFETY: every view points into the live buffers above, sized for it, on
            // `stream`, which they outlive (the group synchronizes through the timer).
            unsafe {
                attn.forward_varlen(
                    &qv,
                    &kv,
                    &vv,
                    &ov,
                    None,
                    &varlen,
                    &params,
                    stream.cu_stream(),
                )
            }
        };
        run().expect("first packed forward");
        group.throughput(if name == "decode_steps" {
            Throughput::Bytes((2 * tk * hkv * d * 2) as u64)
        } else {
            // Causal pairs of equal-length sequences: l (l + 1) / 2 each.
            let pairs: usize = lens.iter().map(|l| l.0 * (l.0 + 1) / 2).sum();
            Throughput::Elements((4 * pairs * hq * d) as u64)
        });
        let id = format!("{name}_B{}_Hq{hq}_Hkv{hkv}_D{d}", lens.len());
        group.bench_function(BenchmarkId::from_parameter(id), |bench| {
            bench.iter_custom(|iters| {
                timed(timer, stream, iters, |_| run().expect("packed forward"))
            })
        });
        stream.synchronize().expect("sync");
    }
    group.finish();
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
                ..Default::default()
            };
            sets[0].run(&attn, &params).expect("first run");
            group.throughput(Throughput::ElementsAndBytes {
                elements: case.flops() as u64,
                bytes: case.bytes() as u64,
            });
            let id = format!("B{b}_H{h}_S{s}_D{d}{}", if causal { "_causal" } else { "" });
            group.bench_function(BenchmarkId::from_parameter(id), |bench| {
                bench.iter_custom(|iters| {
                    timed(&timer, &stream, iters, |i| {
                        sets[i % sets.len()].run(&attn, &params).expect("forward")
                    })
                })
            });
        }
    }
    group.finish();

    decode_group(&mut c, &attn, &stream, &timer, &mut rng);
    serving_batch_group(&mut c, &attn, &stream, &timer, &mut rng);
    varlen_group(&mut c, &attn, &stream, &timer, &mut rng);

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
            timed(&timer, &stream, iters, |_| {
                graph.launch().expect("graph launch")
            })
        })
    });
    group.bench_function("B2_H8_S512_D64_x20_eager", |bench| {
        bench.iter_custom(|iters| {
            timed(&timer, &stream, iters, |_| {
                for i in 0..per_graph {
                    let ([q, k, v, o], lse) = &views[i % views.len()];
                    // SAFETY: as for the captured calls above.
                    unsafe { attn.forward(q, k, v, o, Some(lse), &params, stream.cu_stream()) }
                        .expect("forward");
                }
            })
        })
    });
    group.finish();
    c.final_summary();
}
