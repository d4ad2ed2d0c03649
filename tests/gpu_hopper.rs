//! The sm_90a building blocks on the GPU: the TMA round trip (swizzled and not, 2-D and
//! 3-D boxes, tails) and the warp-specialized GEMM (f16, bf16, e4m3) against a float64
//! reference on sizes that are not multiples of the tile. Run on an H100/H200 with
//! `cargo test --release --test gpu_hopper -- --include-ignored`; elsewhere the tests
//! say so and pass vacuously only when the GPU is not sm_90.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use flashcore::check::TestSeeds;
use flashcore::host::device::Device;
use flashcore::host::gemm::HopperProofs;
use flashcore::kernels::attention::HalfType;
use flashcore::kernels::gemm::{GemmConfig, GemmType};
use flashcore::kernels::tma_copy;
use flashcore::reference::{self, Rng};

/// The proof runner and a stream, or `None` (with a note) on a GPU that is not sm_90.
fn setup() -> Option<(HopperProofs, Arc<CudaStream>)> {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let stream = device.context().default_stream();
    match HopperProofs::new(device) {
        Ok(p) => Some((p, stream)),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

fn ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    s.device_ptr(stream).0
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tma_round_trips_are_exact() {
    let Some((hp, stream)) = setup() else { return };
    let mut rng = Rng::new(0x7A5);
    let mut failures = Vec::new();
    for cfg in tma_copy::all_configs() {
        let sizes: &[(usize, usize)] = if cfg.layout().col_blocks() > 1 {
            &[(100, 384), (130, 128), (64, 256)]
        } else {
            &[(100, 200), (32, 64), (1, 8), (77, 1000)]
        };
        for &(rows, cols) in sizes {
            let (bits, _) = reference::random_half(&mut rng, rows * cols, HalfType::Bf16);
            let input = stream.clone_htod(&bits).unwrap();
            let poison = vec![reference::POISON_BF16; rows * cols];
            let out = stream.clone_htod(&poison).unwrap();
            let readback = stream.clone_htod(&poison).unwrap();
            // SAFETY: three live rows x cols buffers of this device, on its stream.
            unsafe {
                hp.tma_round_trip(
                    &cfg,
                    [
                        ptr(&input, &stream),
                        ptr(&out, &stream),
                        ptr(&readback, &stream),
                    ],
                    [rows, cols],
                    stream.cu_stream(),
                )
            }
            .unwrap_or_else(|e| panic!("{} {rows}x{cols}: {e}", cfg.id()));
            let out = stream.clone_dtoh(&out).unwrap();
            let readback = stream.clone_dtoh(&readback).unwrap();
            stream.synchronize().unwrap();
            let bad_out = out.iter().zip(&bits).filter(|(a, b)| a != b).count();
            let bad_rb = readback.iter().zip(&bits).filter(|(a, b)| a != b).count();
            let line = format!(
                "{} {rows}x{cols}: TMA store differs at {bad_out}, swizzled readback at {bad_rb} \
                 of {} elements",
                cfg.id(),
                rows * cols
            );
            println!("{line}");
            if bad_out + bad_rb > 0 {
                failures.push(line);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `[rows, cols]` random inputs of the GEMM's type: the bits to upload and the exact values.
fn inputs(rng: &mut Rng, dtype: GemmType, len: usize) -> (Vec<u8>, Vec<f64>) {
    match dtype {
        GemmType::E4m3 => {
            let vals: Vec<float8::F8E4M3> = (0..len)
                .map(|_| float8::F8E4M3::from_f64(rng.normal()))
                .collect();
            let bits = vals.iter().map(|v| v.to_bits()).collect();
            (bits, vals.iter().map(|v| v.to_f64()).collect())
        }
        GemmType::F16 | GemmType::Bf16 => {
            let h = if dtype == GemmType::F16 {
                HalfType::F16
            } else {
                HalfType::Bf16
            };
            let (bits, vals) = reference::random_half(rng, len, h);
            (bytemuck::cast_slice(&bits).to_vec(), vals)
        }
    }
}

/// `scale · A·Bᵀ` in float64, rows spread over the cores.
fn reference_gemm(a: &[f64], b: &[f64], [m, n, k]: [usize; 3], scale: f64) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    let workers = std::thread::available_parallelism().map_or(4, |x| x.get());
    let rows_per = m.div_ceil(workers);
    std::thread::scope(|s| {
        for (chunk, out) in c.chunks_mut(rows_per * n).enumerate() {
            s.spawn(move || {
                for (r, row) in out.chunks_mut(n).enumerate() {
                    let i = chunk * rows_per + r;
                    let ai = &a[i * k..][..k];
                    for (j, x) in row.iter_mut().enumerate() {
                        let bj = &b[j * k..][..k];
                        *x = scale * ai.iter().zip(bj).map(|(p, q)| p * q).sum::<f64>();
                    }
                }
            });
        }
    });
    c
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_matches_float64_on_odd_sizes() {
    let Some((hp, stream)) = setup() else { return };
    let mut seeds = TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    for dtype in [GemmType::Bf16, GemmType::F16, GemmType::E4m3] {
        let cfg = GemmConfig { dtype };
        let out_type = if dtype == GemmType::F16 {
            HalfType::F16
        } else {
            HalfType::Bf16
        };
        // k: whole 16-byte rows; n even. None is a multiple of the 128 x 256 x 128 B tile
        // except the last.
        let sizes: &[[usize; 3]] = &[
            [1000, 1000, 1008],
            [129, 264, 80],
            [7, 8, 16],
            [300, 520, 4112],
            [2048, 1024, 512],
        ];
        for &[m, n, k] in sizes {
            let mut rng = seeds.next_case();
            let replay = seeds.replay(&rng);
            let scale = if dtype == GemmType::E4m3 { 0.5 } else { 1.0 };
            let (a_bits, a) = inputs(&mut rng, dtype, m * k);
            let (b_bits, b) = inputs(&mut rng, dtype, n * k);
            let da = stream.clone_htod(&a_bits).unwrap();
            let db = stream.clone_htod(&b_bits).unwrap();
            let poison = reference::poison(out_type);
            let dc = stream.clone_htod(&vec![poison; m * n]).unwrap();
            // SAFETY: A, B and C are live buffers of the sizes passed, on this stream.
            unsafe {
                hp.gemm(
                    &cfg,
                    [ptr(&da, &stream), ptr(&db, &stream), ptr(&dc, &stream)],
                    [m, n, k],
                    scale,
                    stream.cu_stream(),
                )
            }
            .unwrap_or_else(|e| panic!("{} {m}x{n}x{k}: {e}", cfg.id()));
            let c_bits = stream.clone_dtoh(&dc).unwrap();
            stream.synchronize().unwrap();
            let unwritten = c_bits.iter().filter(|&&x| x == poison).count();
            let got = reference::half_bits_to_f64(&c_bits, out_type);
            let want = reference_gemm(&a, &b, [m, n, k], scale as f64);
            let err = reference::rel_l2(&got, &want);
            let tol = if out_type == HalfType::F16 {
                2e-3
            } else {
                8e-3
            };
            let line = format!(
                "{} {m}x{n}x{k}: rel L2 {err:.2e} unwritten {unwritten} ({replay})",
                cfg.id()
            );
            println!("{line}");
            if err.is_nan() || err > tol || unwritten > 0 {
                failures.push(line);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_rejects_what_tma_cannot_describe() {
    let Some((hp, stream)) = setup() else { return };
    let cfg = GemmConfig {
        dtype: GemmType::Bf16,
    };
    let buf = stream.clone_htod(&vec![0u16; 4096]).unwrap();
    let p = ptr(&buf, &stream);
    let s = stream.cu_stream();
    // SAFETY: refused before any launch (k = 12 bf16 is 24 bytes per row).
    let odd_k = unsafe { hp.gemm(&cfg, [p, p, p], [8, 8, 12], 1.0, s) };
    assert!(
        matches!(odd_k, Err(flashcore::Error::InvalidArgument(_))),
        "{odd_k:?}"
    );
    // SAFETY: refused before any launch (odd n).
    let odd_n = unsafe { hp.gemm(&cfg, [p, p, p], [8, 7, 16], 1.0, s) };
    assert!(
        matches!(odd_n, Err(flashcore::Error::InvalidArgument(_))),
        "{odd_n:?}"
    );
    // SAFETY: refused before any launch (A 8 bytes off 16-byte alignment).
    let misaligned = unsafe { hp.gemm(&cfg, [p + 8, p, p], [8, 8, 16], 1.0, s) };
    assert!(
        matches!(
            misaligned,
            Err(flashcore::Error::Misaligned { tensor: "a", .. })
        ),
        "{misaligned:?}"
    );
}
