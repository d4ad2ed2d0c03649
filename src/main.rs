//! The `flashcore` command line.
//!
//! ```text
//! flashcore info                 driver, GPU, and the kernel each configuration dispatches to
//! flashcore ptx --list           every kernel id flashcore generates (and the Hopper proof kernels')
//! flashcore ptx <id>             that kernel's PTX
//! flashcore report               each forward kernel's tiling, and registers/spills if ptxas is on PATH
//! flashcore run [options]        one forward pass: error against float64 and time (GPU);
//!                                (--dtype e4m3: quantized on the GPU, then the FP8 forward)
//! flashcore bench [--json FILE]  the benchmark shapes, TFLOP/s (GPU)
//! flashcore gemm [options]       the sm_90a proof GEMM, TFLOP/s (GPU)
//! flashcore decode [options]     split-KV decode over contiguous and paged caches, GB/s (GPU)
//! flashcore varlen [options]     packed variable-length prefill against padded calls (GPU)
//! flashcore fp8 [options]        FP8 forward against our FP16 one, TFLOP/s (GPU)
//! flashcore quantize-bench       the FP8 quantizer (Q, K, V to e4m3), GB/s against a copy (GPU)
//! flashcore calibrate [options]  FP8 error against float64: per tensor, per block, options (GPU, or --cpu)
//! ```

use std::process::ExitCode;

/// `println!` that ends the program quietly when stdout is closed (`flashcore ptx --list |
/// head`) instead of panicking on the broken pipe.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}

/// Writes text as it is, with the same closed-stdout handling as `out!`.
fn out_raw(text: &str) {
    use std::io::Write as _;
    if std::io::stdout().write_all(text.as_bytes()).is_err() {
        std::process::exit(0);
    }
}
use std::sync::Arc;

use flashcore::check::{
    BENCH_SHAPES, FP8_LSE_TOLERANCE, FP8_TOLERANCE, FwdCase, Layout, check_forward,
    check_forward_fp8, planned_kernel, time_forward, time_fp8,
};
use flashcore::host::attention::{Attention, PathChoice, dispatch, path_for_arch};
use flashcore::host::device::{Device, driver_present};
use flashcore::kernels::attention::{
    FWD_HEAD_DIMS, FwdConfig, HalfType, Path, all_fwd_configs, scale_folds,
};
use flashcore::kernels::catalog;
use flashcore::reference::Rng;
use flashcore::shape::AttnShape;

const USAGE: &str = "usage:
  flashcore info
  flashcore ptx --list | ptx <id>
  flashcore report
  flashcore run [--batch B] [--heads H] [--kv-heads HKV] [--seqlen S | --seqlen-q SQ --seqlen-k SK]
                [--head-dim D] [--dtype f16|bf16|e4m3] [--causal] [--window LEFT,RIGHT]
                [--softcap CAP] [--layout bshd|bhsd] [--iters N] [--block-m 64|128|192] [--split-keys on|off] [--fold on|off]
                [--narrow-keys on|off] [--path best|sm80]
                e4m3 only: [--in-dtype f16|bf16] [--smooth-k] [--hadamard SEED]
  flashcore bench [--json FILE] [--iters N] [--dtype f16,bf16] [--path best|sm80]
                  [--shapes default|hopper|padded] [--fold on|off] [--softcap CAP]
  flashcore gemm [--m M] [--n N] [--k K] [--dtype bf16|f16|e4m3|all] [--iters N] [--json FILE]
  flashcore decode [--shapes BxSKV,...] [--pages 0,16,64] [--heads 32] [--kv-heads 8]
                   [--head-dim 128] [--seqlen-q 1] [--causal] [--dtype f16|bf16] [--iters N]
                   [--kv-dtype e4m3] [--cache-layout bshd|bhsd] [--window LEFT,RIGHT]
                   [--softcap CAP] [--packed | --q-lens N,N,...] [--json FILE]
  flashcore varlen [--lens 512,4096,...] [--q-lens 1,16,...] [--heads 32] [--kv-heads 8]
                   [--head-dim 128] [--causal] [--dtype f16|bf16] [--path sm80] [--iters N]
                   [--json FILE]
  flashcore fp8 [--shapes B:H:S:D,...] [--path best|sm80] [--iters N]
  flashcore quantize-bench [--batch 4] [--heads 32] [--kv-heads H] [--seqlen 8192]
                           [--head-dim 128] [--dtype f16|bf16] [--iters N] [--json FILE]
  flashcore calibrate [--seqlens 512,2048,8192,16384] [--heads 8] [--head-dim 128]
                      [--rows 512] [--inputs normal,uniform,...] [--path best|sm80] [--cpu]
                      [--seed N] [--json FILE]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or(&[]);
    let result = match args.first().map(String::as_str) {
        Some("info") => info(),
        Some("ptx") => ptx(rest),
        Some("report") => report(),
        Some("run") => run(rest),
        Some("bench") => bench(rest),
        Some("gemm") => gemm(rest),
        Some("decode") => decode(rest),
        Some("varlen") => varlen(rest),
        Some("fp8") => fp8_bench(rest),
        Some("quantize-bench") => quantize_bench(rest),
        Some("calibrate") => calibrate(rest),
        Some("help" | "--help" | "-h") => {
            out!("{USAGE}");
            Ok(())
        }
        _ => Err(Failure::Usage(String::new())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(msg)) => {
            if !msg.is_empty() {
                eprintln!("error: {msg}");
            }
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
        Err(Failure::Run(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}

enum Failure {
    Usage(String),
    Run(String),
}

impl From<flashcore::Error> for Failure {
    fn from(e: flashcore::Error) -> Self {
        Failure::Run(e.to_string())
    }
}

/// Opens device 0, or explains why there is none.
fn open_gpu() -> Result<Arc<Device>, Failure> {
    if !driver_present() {
        return Err(Failure::Run(
            "no CUDA driver on this machine (libcuda not found): this command needs an NVIDIA GPU. \
             `flashcore report` shows the generated kernels without one."
                .into(),
        ));
    }
    Ok(Arc::new(Device::new(0)?))
}

fn info() -> Result<(), Failure> {
    out!("flashcore {}", env!("CARGO_PKG_VERSION"));
    let arch = if !driver_present() {
        out!("driver: none (libcuda not found); no GPU path can run here");
        None
    } else {
        let dev = Device::new(0)?;
        let (major, minor) = dev.compute_capability();
        out!(
            "driver: CUDA {}.{}",
            dev.driver_version() / 1000,
            dev.driver_version() % 1000 / 10
        );
        out!(
            "gpu 0: {} ({}), {} SMs, {} KiB shared memory per block (opt-in), {} MiB L2",
            dev.name(),
            dev.arch_name(),
            dev.sm_count(),
            dev.smem_optin() / 1024,
            dev.l2_bytes() >> 20
        );
        match path_for_arch((major, minor)) {
            Ok(p) => out!("path: {}", p.name()),
            Err(why) => out!("path: none ({why})"),
        }
        Some(((major, minor), dev.sm_count()))
    };
    let detected = arch.map(|(a, _)| a);
    let (arch, sms) = arch.unwrap_or(((8, 0), 108));
    out!(
        "\ndispatch on sm_{}{} with {sms} SMs (dtype, head dim, causal -> kernel for large | \
         small grids; sm80 takes the 64-row tile when fewer than {sms} 128-row blocks, sm90a \
         when its 64-row blocks fit one wave, and 192 rows at d64 from 2048 keys, \
         8192 causal):",
        arch.0,
        arch.1,
    );
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for d in FWD_HEAD_DIMS {
            for causal in [false, true] {
                let big = AttnShape::square(8, 32, 4096, d as usize);
                let small = AttnShape::square(1, 1, 128, d as usize);
                let describe = |cfg: FwdConfig| {
                    let t = cfg.tiling();
                    let kib = t.smem_bytes / 1024;
                    format!(
                        "{} ({}x{}, {} threads, {kib} KiB)",
                        cfg.id(),
                        t.block_m,
                        t.block_n,
                        t.threads
                    )
                };
                let scale = 1.0 / (d as f32).sqrt();
                let target = match (
                    dispatch(arch, sms, dtype, &big, causal, scale),
                    dispatch(arch, sms, dtype, &small, causal, scale),
                ) {
                    (Ok(wide), Ok(narrow)) => format!("{} | {}", describe(wide), describe(narrow)),
                    (Err(why), _) | (_, Err(why)) => format!("unsupported: {why}"),
                };
                out!(
                    "  {:<4} d{:<3} {:<6} -> {target}",
                    dtype.name(),
                    d,
                    if causal { "causal" } else { "full" }
                );
            }
        }
    }
    // Those of these head dims that have no kernel of their own on this GPU's path.
    let padded: Vec<String> = [8, 32, 40, 80, 96, 160, 192, 248]
        .into_iter()
        .filter_map(|d| {
            let shape = AttnShape::square(8, 32, 4096, d);
            let cfg = dispatch(arch, sms, HalfType::F16, &shape, false, 0.1).ok()?;
            cfg.padded.then(|| format!("d{d} -> {}", cfg.id()))
        })
        .collect();
    out!(
        "  head dims without a kernel of their own (any multiple of 8 up to 256) run the next \
         larger one, padded: {}",
        padded.join(", ")
    );
    // Key windows and soft caps: twins of the kernels above.
    let big = AttnShape::square(8, 32, 4096, 128);
    let twins = dispatch(arch, sms, HalfType::Bf16, &big, true, 1.0 / 128f32.sqrt())
        .map(|c| {
            let (w, s, ws) = (c.windowed(), c.softcapped(), c.windowed().softcapped());
            format!("{} | {} | {}", w.id(), s.id(), ws.id())
        })
        .unwrap_or_else(|why| format!("unsupported: {why}"));
    out!(
        "  a key window runs the windowed twin of the causal kernel, a soft cap the \
         soft-capping twin (no split keys, no 192-row tiles; the scale folded on sm90a); bf16 \
         d128 causal with a window | a cap | both -> {twins}"
    );
    out!(
        "  up to {} queries per sequence against {} keys or more ({} where {} or more KV \
         heads each serve 4 query heads or more; packed batches by their mean key count): \
         the split-KV decode kernels (GQA packed), as `flashcore decode` runs them; not where \
         the forward kernels' items fill 3/4 to all of the SMs and the query rows per KV \
         head are {} or more",
        flashcore::kernels::attention::decode::MAX_QUERIES,
        flashcore::host::decode::FORWARD_DECODE_MIN_KEYS,
        flashcore::host::decode::FORWARD_DECODE_MIN_KEYS_GQA,
        flashcore::host::decode::FORWARD_DECODE_MIN_KV_HEADS,
        flashcore::host::decode::FORWARD_ONE_WAVE_ROWS
    );
    out!(
        "  decode against a cache with more than {} queries per sequence (a prefill chunk): \
         the forward kernels, reading each sequence's length (and on sm90a a paged cache's \
         block table, pages of 16 or more), for a 16-bit cache; the decode kernels for e4m3 \
         caches, smaller pages, paged caches off sm90a and the windowed kernels without \
         the length read (sm80, sm90a d256 64-row)",
        flashcore::kernels::attention::decode::MAX_QUERIES
    );
    out!(
        "  a serving batch's packed queries against a cache (decode_varlen): runs of up to \
         {0} queries on the decode kernels; with longer ones, where the sm90a forward \
         kernels read the cache, two launches split by each sequence's count on the device \
         (decode kernels up to {0}, forward kernels past it); elsewhere the decode kernels",
        flashcore::kernels::attention::decode::MAX_QUERIES
    );
    match detected {
        Some(arch) => fp8_info(arch),
        // No GPU here: the two architectures with FP8 tensor cores.
        None => [(8, 9), (9, 0)].into_iter().for_each(fp8_info),
    }
    Ok(())
}

/// The FP8 part of `flashcore info`: which kernel family each head dim takes on `arch`.
fn fp8_info(arch: (i32, i32)) {
    use flashcore::host::attention::PathChoice;
    use flashcore::host::fp8::{Fp8Problem, dispatch_fp8};
    use flashcore::kernels::attention::fp8::{Fp8Path, HEAD_DIMS};
    out!(
        "\nFP8 on sm_{}{} (e4m3 operands with per-block scales; f16 output, bf16 alike):",
        arch.0,
        arch.1
    );
    for d in HEAD_DIMS {
        for causal in [false, true] {
            let problem = Fp8Problem {
                shape: AttnShape::square(8, 32, 4096, d as usize),
                out: HalfType::F16,
                scale: 1.0,
                causal,
            };
            let target = match dispatch_fp8(arch, PathChoice::Best, &problem) {
                Ok(cfg) if arch >= (9, 0) && cfg.path == Fp8Path::Sm89 => format!(
                    "{} (no sm90a kernel yet: Hopper emulates its FP8 mma.sync, about 0.3x \
                     the 16-bit kernel)",
                    cfg.id()
                ),
                Ok(cfg) => cfg.id(),
                Err(why) => format!("unsupported: {why}"),
            };
            out!(
                "  e4m3 d{:<3} {:<6} -> {target}",
                d,
                if causal { "causal" } else { "full" }
            );
        }
    }
}

fn ptx(args: &[String]) -> Result<(), Failure> {
    match args.first().map(String::as_str) {
        Some("--list") => {
            for spec in catalog() {
                out!("{}", spec.id());
            }
            Ok(())
        }
        Some(id) => {
            let spec = flashcore::kernels::find(id).ok_or_else(|| {
                Failure::Usage(format!("no kernel `{id}` (see `flashcore ptx --list`)"))
            })?;
            let module = spec.generate().map_err(|e| Failure::Run(e.to_string()))?;
            out_raw(&module.to_ptx());
            Ok(())
        }
        None => Err(Failure::Usage("ptx needs --list or a kernel id".into())),
    }
}

/// Each kernel's tiling; with ptxas on PATH, its registers and spills for sm_80.
fn report() -> Result<(), Failure> {
    let ptxas = which("ptxas");
    out!(
        "{:<36} {:>9} {:>7} {:>9} {}",
        "kernel",
        "tile",
        "threads",
        "smem KiB",
        if ptxas.is_some() {
            "ptxas for its target (registers, spills)"
        } else {
            "(ptxas not on PATH: no register report)"
        }
    );
    for cfg in all_fwd_configs() {
        let t = cfg.tiling();
        let usage = match &ptxas {
            Some(p) => ptxas_usage(p, &cfg).unwrap_or_else(|e| format!("error: {e}")),
            None => String::new(),
        };
        out!(
            "{:<36} {:>9} {:>7} {:>9} {usage}",
            cfg.id(),
            format!("{}x{}", t.block_m, t.block_n),
            t.threads,
            t.smem_bytes / 1024
        );
    }
    Ok(())
}

fn which(tool: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(tool))
        .find(|p| p.is_file())
}

fn ptxas_usage(ptxas: &std::path::Path, cfg: &FwdConfig) -> Result<String, String> {
    let dir = std::env::temp_dir().join(format!("flashcore-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let src = dir.join(format!("{}.ptx", cfg.id()));
    let module = cfg.generate().map_err(|e| e.to_string())?;
    std::fs::write(&src, module.to_ptx()).map_err(|e| e.to_string())?;
    let out = std::process::Command::new(ptxas)
        .arg(format!("-arch={}", module.target().name()))
        .args(["-v", "-o"])
        .arg(dir.join("k.cubin"))
        .arg(&src)
        .output()
        .map_err(|e| e.to_string())?;
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        return Err(log);
    }
    let regs = log
        .split("Used ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .unwrap_or("?")
        .to_string();
    let spills = log
        .split(", ")
        .find(|s| s.contains("spill stores"))
        .unwrap_or("? spill stores");
    Ok(format!("{regs} registers, {}", spills.trim()))
}

/// Parses `--name value` pairs and `--flag` switches.
struct Opts<'a> {
    args: &'a [String],
}

impl<'a> Opts<'a> {
    fn value(&self, name: &str) -> Option<&'a str> {
        self.args
            .iter()
            .position(|a| a == name)
            .and_then(|i| self.args.get(i + 1))
            .map(String::as_str)
    }
    fn num(&self, name: &str, default: usize) -> Result<usize, Failure> {
        match self.value(name) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| Failure::Usage(format!("{name} takes a number, got `{v}`"))),
        }
    }
    fn flag(&self, name: &str) -> bool {
        self.args.iter().any(|a| a == name)
    }
    fn check_known(&self, known: &[&str], switches: &[&str]) -> Result<(), Failure> {
        let mut i = 0;
        while i < self.args.len() {
            let a = self.args[i].as_str();
            if switches.contains(&a) {
                i += 1;
            } else if known.contains(&a) {
                if i + 1 == self.args.len() {
                    return Err(Failure::Usage(format!("{a} takes a value")));
                }
                i += 2;
            } else {
                return Err(Failure::Usage(format!("unknown argument `{a}`")));
            }
        }
        Ok(())
    }
}

/// `--path best|sm80`: which kernel paths the dispatch may choose.
fn parse_path(s: Option<&str>) -> Result<PathChoice, Failure> {
    match s.unwrap_or("best") {
        "best" => Ok(PathChoice::Best),
        "sm80" => Ok(PathChoice::Sm80),
        other => Err(Failure::Usage(format!(
            "unknown path `{other}` (best or sm80)"
        ))),
    }
}

fn parse_dtype(s: &str) -> Result<HalfType, Failure> {
    match s {
        "f16" | "fp16" => Ok(HalfType::F16),
        "bf16" => Ok(HalfType::Bf16),
        other => Err(Failure::Usage(format!(
            "unknown dtype `{other}` (f16 or bf16{})",
            if other.eq_ignore_ascii_case("e4m3") {
                "; `e4m3`, lower case, where a command takes FP8"
            } else {
                ""
            }
        ))),
    }
}

/// The library's checks of a forward over these sizes (empty dimensions, head dim, head
/// ratio, the size limits, the address space), before a GPU is opened or a host buffer is
/// sized from them: the serving and FP8 commands size their buffers from the same numbers.
fn check_sizes(shape: AttnShape, dtype: HalfType, causal: bool) -> Result<(), Failure> {
    let case = FwdCase {
        shape,
        dtype,
        causal,
        window: Default::default(),
        layout: Layout::Bshd,
        kernel: None,
        softcap: None,
        softmax_scale: None,
    };
    Ok(case.validate()?)
}

/// [`check_sizes`] for the FP8 commands, whose kernels take head dims 64, 128 and 256,
/// with the quantizer's options as `options` asks for them.
fn check_fp8_sizes(
    shape: AttnShape,
    options: &flashcore::host::quantize::QuantizeOptions,
) -> Result<(), Failure> {
    let case = FwdCase {
        shape,
        dtype: HalfType::F16,
        causal: false,
        window: Default::default(),
        layout: Layout::Bshd,
        kernel: None,
        softcap: None,
        softmax_scale: None,
    };
    case.validate()?;
    Ok(case.validate_fp8(options)?)
}

fn run(args: &[String]) -> Result<(), Failure> {
    let o = Opts { args };
    o.check_known(
        &[
            "--batch",
            "--heads",
            "--kv-heads",
            "--seqlen",
            "--seqlen-q",
            "--seqlen-k",
            "--head-dim",
            "--dtype",
            "--layout",
            "--iters",
            "--block-m",
            "--split-keys",
            "--fold",
            "--narrow-keys",
            "--path",
            "--in-dtype",
            "--hadamard",
            "--window",
            "--softcap",
        ],
        &["--causal", "--smooth-k"],
    )?;
    let window = parse_window(o.value("--window"))?;
    let softcap = parse_softcap(o.value("--softcap"))?;
    let fp8 = o.value("--dtype") == Some("e4m3");
    let options = if fp8 {
        let forced = ["--block-m", "--split-keys", "--fold", "--narrow-keys"];
        if forced.iter().any(|f| o.value(f).is_some()) {
            return Err(Failure::Usage(
                "--block-m, --split-keys, --fold and --narrow-keys choose a 16-bit kernel; the \
                 e4m3 path has its own"
                    .into(),
            ));
        }
        let hadamard_seed = match o.value("--hadamard") {
            None => None,
            Some(v) => Some(parse_u64(v).ok_or_else(|| {
                Failure::Usage(format!("--hadamard takes a seed (a number), got `{v}`"))
            })?),
        };
        Some(flashcore::host::quantize::QuantizeOptions {
            smooth_k: o.flag("--smooth-k"),
            hadamard_seed,
        })
    } else {
        for name in ["--in-dtype", "--hadamard", "--smooth-k"] {
            if o.flag(name) {
                return Err(Failure::Usage(format!("{name} goes with --dtype e4m3")));
            }
        }
        None
    };
    // The e4m3 path draws 16-bit inputs (and writes O) in --in-dtype.
    let dtype = if fp8 {
        parse_dtype(o.value("--in-dtype").unwrap_or("f16"))?
    } else {
        parse_dtype(o.value("--dtype").unwrap_or("f16"))?
    };
    let seqlen = o.num("--seqlen", 512)?;
    let heads = o.num("--heads", 8)?;
    let case = FwdCase {
        shape: AttnShape {
            batch: o.num("--batch", 2)?,
            seqlen_q: o.num("--seqlen-q", seqlen)?,
            seqlen_k: o.num("--seqlen-k", seqlen)?,
            heads_q: heads,
            heads_kv: o.num("--kv-heads", heads)?,
            head_dim: o.num("--head-dim", 64)?,
        },
        dtype,
        causal: o.flag("--causal"),
        window,
        layout: match o.value("--layout").unwrap_or("bshd") {
            "bshd" => Layout::Bshd,
            "bhsd" => Layout::Bhsd,
            other => return Err(Failure::Usage(format!("unknown layout `{other}`"))),
        },
        kernel: None,
        softcap,
        softmax_scale: None,
    };
    let iters = o.num("--iters", 20)?;
    case.validate()?;
    if let Some(options) = &options {
        case.validate_fp8(options)?;
    }
    if !driver_present() {
        out!("no CUDA driver on this machine (libcuda not found): no forward pass can run here.");
        out!("The kernels flashcore would generate for a GPU:\n");
        report()?;
        return Err(Failure::Run("`flashcore run` needs an NVIDIA GPU".into()));
    }
    let dev = open_gpu()?;
    let stream = dev.context().default_stream();
    let attn = Attention::new(dev.clone())?.with_path(parse_path(o.value("--path"))?);
    if let Some(options) = options {
        return run_fp8(&dev, &attn, &stream, case, &options, iters);
    }
    let mut case = case;
    let on_off = |flag: &str| match o.value(flag) {
        None => Ok(None),
        Some("on") => Ok(Some(true)),
        Some("off") => Ok(Some(false)),
        Some(v) => Err(Failure::Usage(format!("{flag} takes on or off, got `{v}`"))),
    };
    let split_keys = on_off("--split-keys")?;
    let fold = on_off("--fold")?;
    let narrow_keys = on_off("--narrow-keys")?;
    if o.value("--block-m").is_some()
        || split_keys.is_some()
        || fold.is_some()
        || narrow_keys.is_some()
    {
        // Force a query tile, the split-keys kernel, the exponent's form or the key tile
        // (to compare kernels); otherwise the dispatch chooses. The split-keys kernel has
        // 64-row tiles; the scale folds where the default scale allows it, unless
        // `--fold off`; the key tile is the dispatch's unless `--narrow-keys` says.
        let planned = planned_kernel(&attn, &case)?;
        let block_m = match o.value("--block-m") {
            Some(b) => b.parse().map_err(|_| {
                Failure::Usage(format!("--block-m takes 64, 128 or 192, got `{b}`"))
            })?,
            None if split_keys == Some(true) => 64,
            None => planned.block_m,
        };
        let split_keys = split_keys.unwrap_or(false);
        let default_scale = 1.0 / (planned.head_dim as f32).sqrt();
        let folds = scale_folds(planned.dtype, planned.head_dim, default_scale);
        case.kernel = Some(FwdConfig {
            block_m,
            split_keys,
            fold_scale: planned.path == Path::Sm90 && !split_keys && fold.unwrap_or(folds),
            narrow_keys: narrow_keys.unwrap_or(planned.narrow_keys),
            ..planned
        });
    }
    let mut rng = Rng::from_entropy();
    let r = check_forward(&attn, &stream, case, &mut rng)?;
    out!("{}: {case}", dev.name());
    out!(
        "relative L2 error vs float64: out {:.3e} (tolerance {:.1e}), lse {:.3e} (tolerance {:.1e}), unwritten {} (seed {:#x})",
        r.out_err,
        flashcore::check::tolerance(case.dtype),
        r.lse_err,
        flashcore::check::LSE_TOLERANCE,
        r.unwritten,
        r.seed
    );
    if iters > 0 {
        let t = time_forward(&attn, &stream, case, iters, &mut rng)?;
        out!(
            "time: median {:.3} ms (min {:.3}, max {:.3}, {} runs) = {:.1} TFLOP/s",
            t.median_ms,
            t.min_ms,
            t.max_ms,
            t.iters,
            case.flops() / (t.median_ms as f64 * 1e9)
        );
    }
    for (id, _, regs, local) in attn.loaded_kernels() {
        out!("kernel {id}: {regs} registers, {local} bytes local memory");
    }
    if r.passes(case.dtype) {
        Ok(())
    } else {
        Err(Failure::Run("error above tolerance".into()))
    }
}

/// A key window as `--window` takes it: `LEFT,RIGHT` in FlashAttention's convention
/// (keys before and after each row's diagonal, −1 for no bound); none without the flag.
fn parse_window(v: Option<&str>) -> Result<flashcore::host::tensor::Window, Failure> {
    let Some(v) = v else {
        return Ok(Default::default());
    };
    let bad = || {
        Failure::Usage(format!(
            "--window takes LEFT,RIGHT (-1 for no bound), got `{v}`"
        ))
    };
    let (l, r) = v.split_once(',').ok_or_else(bad)?;
    let side = |x: &str| x.trim().parse::<i64>().map_err(|_| bad());
    Ok(flashcore::host::tensor::Window::from_flash(
        side(l)?,
        side(r)?,
    ))
}

/// A soft cap as `--softcap` takes it: a number, 0 for none (FlashAttention's
/// convention); none without the flag. The call checks the value.
fn parse_softcap(v: Option<&str>) -> Result<Option<f32>, Failure> {
    let Some(v) = v else {
        return Ok(None);
    };
    let cap: f32 = v
        .trim()
        .parse()
        .map_err(|_| Failure::Usage(format!("--softcap takes a number, got `{v}`")))?;
    Ok((cap != 0.0).then_some(cap))
}

/// A number as `--hadamard` takes it: decimal or `0x` hexadecimal.
fn parse_u64(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// `flashcore run --dtype e4m3`: 16-bit inputs quantized on the GPU, the FP8 forward,
/// the error against float64 attention on the 16-bit inputs, and the two steps' times.
fn run_fp8(
    dev: &Device,
    attn: &Attention,
    stream: &Arc<cudarc::driver::CudaStream>,
    case: FwdCase,
    options: &flashcore::host::quantize::QuantizeOptions,
    iters: usize,
) -> Result<(), Failure> {
    use flashcore::host::fp8::Fp8Problem;

    let problem = Fp8Problem {
        shape: case.shape,
        out: case.dtype,
        scale: 1.0,
        causal: case.causal,
    };
    // An unsupported GPU is refused here, before anything is drawn or uploaded.
    attn.plan_fp8(&problem)?;
    let mut rng = Rng::from_entropy();
    let r = check_forward_fp8(attn, stream, case, options, &mut rng)?;
    let mut opts = Vec::new();
    if options.smooth_k {
        opts.push("smooth_k".to_string());
    }
    if let Some(seed) = options.hadamard_seed {
        opts.push(format!("hadamard {seed:#x}"));
    }
    if opts.is_empty() {
        opts.push("none".into());
    }
    out!(
        "{}: {case}, e4m3 (quantized on the GPU from {}; options: {})",
        dev.name(),
        case.dtype.name(),
        opts.join(", ")
    );
    out!(
        "error vs float64 on the {} inputs: out {:.3e} (relative L2; tolerance \
         {FP8_TOLERANCE:.1e}), lse {:.3e} (rms absolute; tolerance {FP8_LSE_TOLERANCE:.1e}), \
         unwritten {} (seed {:#x})",
        case.dtype.name(),
        r.out_err,
        r.lse_err,
        r.unwritten,
        r.seed
    );
    if iters > 0 {
        let (q, f) = time_fp8(attn, stream, case, options, iters, &mut rng)?;
        let s = &case.shape;
        // Bytes the quantizer must move: each 16-bit input read once (K twice with
        // smoothing), each e4m3 code written once.
        let kv_reads = if options.smooth_k { 3 } else { 2 };
        let bytes = 2 * (s.q_len() + kv_reads * s.kv_len()) + s.q_len() + 2 * s.kv_len();
        out!(
            "quantize: median {:.3} ms (min {:.3}, max {:.3}, {} runs) = {:.0} GB/s",
            q.median_ms,
            q.min_ms,
            q.max_ms,
            q.iters,
            bytes as f64 / (q.median_ms as f64 * 1e6)
        );
        out!(
            "attention: median {:.3} ms (min {:.3}, max {:.3}, {} runs) = {:.1} TFLOP/s",
            f.median_ms,
            f.min_ms,
            f.max_ms,
            f.iters,
            case.flops() / (f.median_ms as f64 * 1e9)
        );
        out!(
            "both: {:.3} ms = {:.1} TFLOP/s",
            q.median_ms + f.median_ms,
            case.flops() / ((q.median_ms + f.median_ms) as f64 * 1e9)
        );
    }
    for (id, _, regs, local) in attn.loaded_kernels() {
        out!("kernel {id}: {regs} registers, {local} bytes local memory");
    }
    if r.passes() {
        Ok(())
    } else {
        Err(Failure::Run("error above tolerance".into()))
    }
}

fn bench(args: &[String]) -> Result<(), Failure> {
    let o = Opts { args };
    o.check_known(
        &[
            "--json",
            "--iters",
            "--dtype",
            "--path",
            "--shapes",
            "--fold",
            "--softcap",
        ],
        &[],
    )?;
    let iters = o.num("--iters", 30)?;
    // `--fold off`: the sm90 kernels with the scale left out of the exponent's FMA (what
    // the dispatch takes for scales that could overflow), to compare the two forms.
    let unfolded = match o.value("--fold") {
        None | Some("on") => false,
        Some("off") => true,
        Some(v) => return Err(Failure::Usage(format!("--fold takes on or off, got `{v}`"))),
    };
    let dtypes = o
        .value("--dtype")
        .unwrap_or("f16")
        .split(',')
        .map(parse_dtype)
        .collect::<Result<Vec<_>, _>>()?;
    let shapes: Vec<(usize, usize, usize, usize, usize)> = match o.value("--shapes") {
        None | Some("default") => BENCH_SHAPES
            .iter()
            .map(|&(b, h, s, d)| (b, h, h, s, d))
            .collect(),
        Some("hopper") => flashcore::check::hopper_bench_shapes(),
        Some("padded") => flashcore::check::padded_bench_shapes(),
        Some(other) => return Err(Failure::Usage(format!("unknown shapes `{other}`"))),
    };
    let choice = parse_path(o.value("--path"))?;
    // `--softcap CAP`: every shape with soft-capped scores, to weigh what the cap costs.
    let softcap = parse_softcap(o.value("--softcap"))?;
    let backend = match (choice, unfolded) {
        (PathChoice::Best, false) => "flashcore",
        (PathChoice::Best, true) => "flashcore-unfolded",
        (PathChoice::Sm80, _) => "flashcore-sm80",
    };
    let backend = match softcap {
        Some(_) => format!("{backend}-softcap"),
        None => backend.to_string(),
    };
    let dev = open_gpu()?;
    let stream = dev.context().default_stream();
    let attn = Attention::new(dev.clone())?.with_path(choice);
    let mut rng = Rng::from_entropy();
    let mut records = Vec::new();
    out!("{} ({}), {backend}", dev.name(), dev.arch_name());
    out!(
        "{:<28} {:<5} {:>7} {:>10} {:>9} {:>10}  kernel",
        "shape",
        "dtype",
        "causal",
        "ms",
        "TFLOP/s",
        "rel err"
    );
    let runs: Vec<_> = dtypes
        .iter()
        .flat_map(|&dt| {
            shapes
                .iter()
                .flat_map(move |&sh| [(dt, sh, false), (dt, sh, true)])
        })
        .collect();
    let total = runs.len();
    let mut failed = Vec::new();
    for (i, (dtype, (b, h, hkv, s, d), causal)) in runs.into_iter().enumerate() {
        eprintln!(
            "[{}/{total}] B{b} H{h}/{hkv} S{s} D{d} causal={causal}",
            i + 1
        );
        let shape = AttnShape {
            heads_kv: hkv,
            ..AttnShape::square(b, h, s, d)
        };
        let case = FwdCase {
            shape,
            dtype,
            causal,
            window: Default::default(),
            layout: Layout::Bhsd,
            kernel: None,
            softcap,
            softmax_scale: None,
        };
        // The float64 check of the largest shapes would take minutes on the CPU: check
        // the same kernel on one batch, one K/V head's group, and at most 1024 rows.
        let planned = planned_kernel(&attn, &case)?;
        let kernel = FwdConfig {
            fold_scale: planned.fold_scale && !unfolded,
            ..planned
        };
        let case = FwdCase {
            kernel: unfolded.then_some(kernel),
            ..case
        };
        let g = h / hkv;
        let checked = FwdCase {
            shape: AttnShape {
                batch: 1,
                heads_q: g.min(4),
                heads_kv: 1,
                ..AttnShape::square(1, 1, s.min(1024), d)
            },
            kernel: Some(kernel),
            ..case
        };
        let err = check_forward(&attn, &stream, checked, &mut rng)?;
        if !err.passes(dtype) {
            failed.push(format!("{shape} {} causal={causal}", dtype.name()));
        }
        let t = time_forward(&attn, &stream, case, iters, &mut rng)?;
        let tflops = case.flops() / (t.median_ms as f64 * 1e9);
        out!(
            "{:<28} {:<5} {:>7} {:>10.4} {:>9.1} {:>10.2e}  {}",
            shape.to_string(),
            dtype.name(),
            causal,
            t.median_ms,
            tflops,
            err.out_err,
            kernel.id()
        );
        records.push(format!(
            "{{\"batch\": {b}, \"heads\": {h}, \"kv_heads\": {hkv}, \"seqlen_q\": {s}, \
             \"seqlen_k\": {s}, \"head_dim\": {d}, \"dtype\": \"{}\", \"causal\": {causal}, \
             \"backend\": \"{backend}\", \"median_ms\": {:.6}, \"tflops\": {tflops:.3}, \
             \"rel_err\": {}, \"passes\": {}, \"kernel\": \"{}\"}}",
            dtype.name(),
            t.median_ms,
            // JSON has no inf or NaN: an output with unwritten or non-finite elements
            // (an infinite error) is null.
            if err.out_err.is_finite() {
                format!("{:.3e}", err.out_err)
            } else {
                "null".into()
            },
            err.passes(dtype),
            kernel.id()
        ));
    }
    if let Some(path) = o.value("--json") {
        std::fs::write(path, format!("[\n  {}\n]\n", records.join(",\n  ")))
            .map_err(|e| Failure::Run(format!("writing {path}: {e}")))?;
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Failure::Run(format!(
            "error above tolerance on {} of {total} rows: {}",
            failed.len(),
            failed.join(", ")
        )))
    }
}

/// Times the sm_90a warp-specialized GEMM (the Hopper building blocks' proof kernel):
/// median of CUDA-event timings of `C = A·Bᵀ` on random inputs, 8192³ by default.
fn gemm(args: &[String]) -> Result<(), Failure> {
    use flashcore::host::gemm::HopperProofs;
    use flashcore::kernels::gemm::{GemmConfig, GemmType};
    let o = Opts { args };
    o.check_known(&["--m", "--n", "--k", "--dtype", "--iters", "--json"], &[])?;
    let (m, n, k) = (
        o.num("--m", 8192)?,
        o.num("--n", 8192)?,
        o.num("--k", 8192)?,
    );
    let iters = o.num("--iters", 30)?;
    let types = match o.value("--dtype").unwrap_or("all") {
        "all" => vec![GemmType::Bf16, GemmType::F16, GemmType::E4m3],
        "bf16" => vec![GemmType::Bf16],
        "f16" | "fp16" => vec![GemmType::F16],
        "e4m3" | "fp8" => vec![GemmType::E4m3],
        other => return Err(Failure::Usage(format!("unknown dtype `{other}`"))),
    };
    let dev = open_gpu()?;
    let hp = HopperProofs::new(dev.clone())?;
    let stream = dev.context().default_stream();
    let drv = |e: cudarc::driver::DriverError| Failure::Run(format!("{e:?}"));
    // A pool of random values tiled over the inputs: real magnitudes (never zeros) without
    // drawing 10^8 normals on the host.
    let mut rng = Rng::from_entropy();
    let pool: Vec<f64> = (0..(1 << 20)).map(|_| rng.normal()).collect();
    let mut records = Vec::new();
    out!(
        "{} ({}), C[{m}x{n}] = A[{m}x{k}] B[{n}x{k}]^T",
        dev.name(),
        dev.arch_name()
    );
    out!("{:<8} {:>10} {:>9}  kernel", "dtype", "ms", "TFLOP/s");
    for dtype in types {
        let cfg = GemmConfig { dtype };
        let fill = |len: usize| -> Vec<u8> {
            match dtype {
                GemmType::E4m3 => (0..len)
                    .map(|i| float8::F8E4M3::from_f64(pool[i % pool.len()]).to_bits())
                    .collect(),
                GemmType::F16 => (0..len)
                    .flat_map(|i| half::f16::from_f64(pool[i % pool.len()]).to_le_bytes())
                    .collect(),
                GemmType::Bf16 => (0..len)
                    .flat_map(|i| half::bf16::from_f64(pool[i % pool.len()]).to_le_bytes())
                    .collect(),
            }
        };
        let a = stream.clone_htod(&fill(m * k)).map_err(drv)?;
        let b = stream.clone_htod(&fill(n * k)).map_err(drv)?;
        let c = stream.alloc_zeros::<u16>(m * n).map_err(drv)?;
        use cudarc::driver::DevicePtr;
        let ptrs = [
            a.device_ptr(&stream).0,
            b.device_ptr(&stream).0,
            c.device_ptr(&stream).0,
        ];
        let cu = stream.cu_stream();
        // SAFETY: A, B and C are live buffers of the sizes passed, on `cu`.
        let run = || unsafe { hp.gemm(&cfg, ptrs, [m, n, k], 1.0, cu) };
        // SAFETY: `cu` is the device's default stream, which `run` enqueues on.
        let t = unsafe { flashcore::host::timing::median_ms(dev.context(), cu, 3, iters, run) }?;
        let tflops = 2.0 * (m * n * k) as f64 / (t.median_ms as f64 * 1e9);
        out!(
            "{:<8} {:>10.4} {:>9.1}  {}",
            dtype.name(),
            t.median_ms,
            tflops,
            cfg.id()
        );
        records.push(format!(
            "{{\"op\": \"gemm\", \"m\": {m}, \"n\": {n}, \"k\": {k}, \"dtype\": \"{}\", \
             \"backend\": \"flashcore\", \"median_ms\": {:.6}, \"tflops\": {tflops:.3}}}",
            dtype.name(),
            t.median_ms
        ));
    }
    if let Some(path) = o.value("--json") {
        std::fs::write(path, format!("[\n  {}\n]\n", records.join(",\n  ")))
            .map_err(|e| Failure::Run(format!("writing {path}: {e}")))?;
    }
    Ok(())
}

/// The decode benchmark shapes: (batch, Skv), each with Hq 32, Hkv 8, D 128.
const DECODE_SHAPES: [(usize, usize); 4] = [(1, 8192), (1, 32768), (16, 8192), (64, 4096)];

/// Times split-KV decode (CUDA events, median; caches rotated past L2), contiguous and
/// paged; then one decode step with its merge captured in a CUDA graph. `--kv-dtype
/// e4m3` runs an FP8 cache (codes and per-(position, head) scales; GB/s count both).
/// (Correctness is `tests/gpu_decode.rs`'s.)
fn decode(args: &[String]) -> Result<(), Failure> {
    use flashcore::host::decode::Workspace;
    use flashcore::host::decode_varlen::{PackedQueries, validate_decode_varlen};
    use flashcore::host::kv_cache::{CacheLayout, KvCache, KvScales};
    use flashcore::host::tensor::{AttentionParams, LseView, TensorView};

    let o = Opts { args };
    o.check_known(
        &[
            "--json",
            "--iters",
            "--dtype",
            "--heads",
            "--kv-heads",
            "--head-dim",
            "--seqlen-q",
            "--shapes",
            "--pages",
            "--kv-dtype",
            "--cache-layout",
            "--window",
            "--softcap",
            "--q-lens",
        ],
        &["--causal", "--packed"],
    )?;
    let iters = o.num("--iters", 100)?;
    // The queries packed `[1, B·Sq, Hq, D]` with offsets (`Attention::decode_varlen`, a
    // serving batch's call) rather than `[B, Sq, Hq, D]`.
    // `--q-lens n0,n1,...`: a serving batch of those query counts, packed (the shapes'
    // batch becomes their count).
    let q_lens: Option<Vec<usize>> = match o.value("--q-lens") {
        None => None,
        Some(list) => Some(
            list.split(',')
                .map(|n| {
                    n.parse()
                        .map_err(|_| Failure::Usage(format!("--q-lens takes N,N,..., got `{n}`")))
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    let packed = o.flag("--packed") || q_lens.is_some();
    let window = parse_window(o.value("--window"))?;
    let softcap = parse_softcap(o.value("--softcap"))?;
    // A contiguous cache as `[B, Skv, Hkv, D]` (the serving layout) or with each head's
    // rows together, `[B, Hkv, Skv, D]` (SDPA's layout), passed as a strided view.
    let head_major = match o.value("--cache-layout").unwrap_or("bshd") {
        "bshd" => false,
        "bhsd" => true,
        t => {
            return Err(Failure::Usage(format!(
                "--cache-layout takes bshd or bhsd, got `{t}`"
            )));
        }
    };
    let dtype = parse_dtype(o.value("--dtype").unwrap_or("f16"))?;
    // A 16-bit cache has the queries' dtype; e4m3 serves either.
    let fp8 = match o.value("--kv-dtype") {
        None => false,
        Some("e4m3") => true,
        Some(t) if t == dtype.name() => false,
        Some(t) => {
            return Err(Failure::Usage(format!(
                "--kv-dtype takes e4m3 or the query dtype {}, got `{t}`",
                dtype.name()
            )));
        }
    };
    let (hq, hkv, d) = (
        o.num("--heads", 32)?,
        o.num("--kv-heads", 8)?,
        o.num("--head-dim", 128)?,
    );
    let sq = match &q_lens {
        Some(lens) => lens.iter().copied().max().unwrap_or(1).max(1),
        None => o.num("--seqlen-q", 1)?,
    };
    let causal = o.flag("--causal");
    let shapes: Vec<(usize, usize)> = match o.value("--shapes") {
        None => DECODE_SHAPES.to_vec(),
        Some(list) => list
            .split(',')
            .map(|s| {
                let (b, k) = s.split_once('x').unwrap_or(("", ""));
                match (b.parse(), k.parse()) {
                    (Ok(b), Ok(k)) => Ok((b, k)),
                    _ => Err(Failure::Usage(format!(
                        "--shapes takes BxSKV,..., got `{s}`"
                    ))),
                }
            })
            .collect::<Result<_, _>>()?,
    };
    let pages: Vec<usize> = o
        .value("--pages")
        .unwrap_or("0,16,64")
        .split(',')
        .map(|p| {
            p.parse()
                .map_err(|_| Failure::Usage(format!("bad page size `{p}`")))
        })
        .collect::<Result<_, _>>()?;
    let shapes: Vec<(usize, usize)> = match &q_lens {
        Some(lens) => shapes.iter().map(|&(_, skv)| (lens.len(), skv)).collect(),
        None => shapes,
    };
    // Each sequence's queries.
    let runs = |b: usize| q_lens.clone().unwrap_or_else(|| vec![sq; b]);
    for &(b, skv) in &shapes {
        let shape = AttnShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: skv,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
        };
        check_sizes(shape, dtype, causal)?;
    }
    let dev = open_gpu()?;
    let stream = dev.context().default_stream();
    let attn = Attention::new(dev.clone())?;
    let mut rng = Rng::from_entropy();
    let dt = flashcore::host::tensor::DType::from(dtype);
    let cache_dt = if fp8 {
        flashcore::host::tensor::DType::E4m3
    } else {
        dt
    };
    let elem = cache_dt.size_bytes();
    let err = |e: cudarc::driver::DriverError| Failure::Run(format!("CUDA: {e}"));
    let params = AttentionParams {
        softmax_scale: None,
        causal,
        window,
        softcap,
    };
    out!(
        "{} ({}), flashcore decode, {} cache, contiguous as {}",
        dev.name(),
        dev.arch_name(),
        cache_dt.name(),
        if head_major { "bhsd" } else { "bshd" }
    );
    out!(
        "{:<34} {:>6} {:>10} {:>9}  kernel",
        "shape",
        "splits",
        "us",
        "GB/s"
    );
    let mut records = Vec::new();
    let mut busy = stream.alloc_zeros::<u8>(1 << 30).map_err(err)?;
    for &(b, skv) in &shapes {
        for &page in &pages {
            let kv_elems = b * skv * hkv * d;
            // Bytes a step reads: K and V, and an e4m3 cache's scales (4 bytes a row);
            // with a window on the left, only the keys some query's window holds.
            let scale_bytes = if fp8 { kv_elems / d * 4 } else { 0 };
            let cache_bytes = 2 * (kv_elems * elem + scale_bytes);
            let seen = window.left.map_or(skv, |l| skv.min(l as usize + sq));
            let kv_bytes = cache_bytes / skv.max(1) * seen;
            // Enough copies of the cache that one call's K/V is never in L2.
            let copies = (3 * dev.l2_bytes() as usize).div_ceil(cache_bytes).max(1) + 1;
            let (pool_pages, max_pages) = if page == 0 {
                (0, 0)
            } else {
                (b * skv.div_ceil(page), skv.div_ceil(page))
            };
            let n = if page == 0 {
                kv_elems
            } else {
                pool_pages * page * hkv * d
            };
            let (pool, _) = flashcore::reference::random_half(&mut rng, 1 << 16, dtype);
            // The cache as bytes: 16-bit values, or e4m3 codes (no NaN: 0x7f, 0xff)
            // with scales near those of N(0, 1) rows.
            let fill: Vec<u8> = if fp8 {
                (0..n)
                    .map(|i| (pool[(i * 7 + 13) % pool.len()] % 0xfe) as u8 & 0xfe)
                    .collect()
            } else {
                (0..n)
                    .flat_map(|i| pool[(i * 7 + 13) % pool.len()].to_le_bytes())
                    .collect()
            };
            let scale_fill: Vec<f32> = (0..n / d).map(|i| 0.005 + (i % 7) as f32 * 1e-3).collect();
            let mut caches = Vec::new();
            let mut scales = Vec::new();
            for _ in 0..copies {
                let k = stream.clone_htod(&fill).map_err(err)?;
                let v = stream.clone_htod(&fill).map_err(err)?;
                if fp8 {
                    scales.push((
                        stream.clone_htod(&scale_fill).map_err(err)?,
                        stream.clone_htod(&scale_fill).map_err(err)?,
                    ));
                }
                // Pages in random order over the pool.
                let mut order: Vec<i32> = (0..pool_pages as i32).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                let order = if order.is_empty() { vec![0] } else { order };
                let table = stream.clone_htod(&order).map_err(err)?;
                caches.push((k, v, table));
            }
            let lens = stream.clone_htod(&vec![skv as i32; b]).map_err(err)?;
            let nq = b * sq * hq * d;
            let q = stream
                .clone_htod(
                    &pool[..nq.min(pool.len())].repeat(nq.div_ceil(pool.len()))[..nq].to_vec(),
                )
                .map_err(err)?;
            let out = stream.alloc_zeros::<u16>(nq).map_err(err)?;
            let lse = stream.alloc_zeros::<f32>(b * hq * sq).map_err(err)?;
            use cudarc::driver::DevicePtr;
            let views: Vec<KvCache> = caches
                .iter()
                .enumerate()
                .map(|(i, (k, v, t))| {
                    let (k, v) = (k.device_ptr(&stream).0, v.device_ptr(&stream).0);
                    let (outer, rows) = match page {
                        0 => (b, skv),
                        p => (pool_pages, p),
                    };
                    let scales = scales.get(i).map(|(ks, vs)| {
                        let view = |x: &cudarc::driver::CudaSlice<f32>| {
                            TensorView::bshd(
                                x.device_ptr(&stream).0,
                                flashcore::host::tensor::DType::F32,
                                outer,
                                rows,
                                hkv,
                                1,
                            )
                        };
                        KvScales {
                            k: view(ks),
                            v: view(vs),
                        }
                    });
                    let view = |ptr| match (page, head_major) {
                        (0, true) => TensorView::bhsd(ptr, cache_dt, outer, rows, hkv, d),
                        _ => TensorView::bshd(ptr, cache_dt, outer, rows, hkv, d),
                    };
                    KvCache {
                        k: view(k),
                        v: view(v),
                        seqlens: lens.device_ptr(&stream).0,
                        layout: match page {
                            0 => CacheLayout::Contiguous,
                            _ => CacheLayout::Paged {
                                block_table: t.device_ptr(&stream).0,
                                max_pages,
                                table_stride: max_pages,
                            },
                        },
                        scales,
                    }
                })
                .collect();
            let (qv, ov) = {
                let total: usize = runs(b).iter().sum();
                let (outer, rows) = if packed { (1, total) } else { (b, sq) };
                let view = |ptr| TensorView::bshd(ptr, dt, outer, rows, hq, d);
                (
                    view(q.device_ptr(&stream).0),
                    view(out.device_ptr(&stream).0),
                )
            };
            let lv = LseView {
                ptr: lse.device_ptr(&stream).0,
            };
            let offsets: Vec<i32> = std::iter::once(0)
                .chain(runs(b).iter().scan(0, |at, &n| {
                    *at += n as i32;
                    Some(*at)
                }))
                .collect();
            let offsets = stream.clone_htod(&offsets).map_err(err)?;
            let queries = PackedQueries {
                cu_seqlens_q: offsets.device_ptr(&stream).0,
                batch: b,
                max_seqlen_q: sq,
                host: None,
            };
            let ws_bytes = if packed {
                attn.decode_varlen_workspace_bytes(&qv, &views[0], &queries)?
            } else {
                attn.decode_workspace_bytes(&qv, &views[0])?
            };
            let ws = stream
                .alloc_zeros::<u8>(ws_bytes.max(1) + 256)
                .map_err(err)?;
            let workspace = (ws_bytes > 0).then(|| Workspace {
                ptr: ws.device_ptr(&stream).0.next_multiple_of(256),
                bytes: ws_bytes,
            });
            let problem = if packed {
                validate_decode_varlen(&qv, &views[0], &queries, &ov, Some(&lv), &params)?
            } else {
                flashcore::host::decode::decode_problem(&qv, &views[0], &params)?
            };
            let plan = attn.decode_plan(&problem)?;
            // More than 16 queries run on the forward kernels where they can read the cache.
            let (splits, kernel) = match attn.decode_forward_plan(&problem, &views[0]) {
                Some((_, cfg)) => (1, cfg.id()),
                None => (plan.splits, plan.config.id()),
            };
            // SAFETY: every view points into the buffers above, alive until the end of
            // this iteration, on their own stream.
            let us = unsafe {
                median_us_queued(&dev, &stream, &mut busy, iters, |turn| {
                    let cache = &views[turn % views.len()];
                    let cu = stream.cu_stream();
                    if packed {
                        let (q, o, l) = (&qv, &ov, Some(&lv));
                        attn.decode_varlen(q, cache, &queries, None, o, l, &params, workspace, cu)
                    } else {
                        attn.decode(&qv, cache, None, &ov, Some(&lv), &params, workspace, cu)
                    }
                })
            }?;
            let gbps = kv_bytes as f64 / (us * 1e3);
            let layout = match (page, packed) {
                (0, false) => "contiguous".to_string(),
                (0, true) => "contiguous packed".to_string(),
                (p, false) => format!("page{p}"),
                (p, true) => format!("page{p} packed"),
            };
            let queries = match &q_lens {
                Some(lens) => format!("Sq{}max{sq}", lens.iter().sum::<usize>()),
                None => format!("Sq{sq}"),
            };
            let name = match window.left {
                Some(l) => format!("B{b} Hq{hq} Hkv{hkv} {queries} Skv{skv} D{d} {layout} W{l}"),
                None => format!("B{b} Hq{hq} Hkv{hkv} {queries} Skv{skv} D{d} {layout}"),
            };
            // Query-key pairs each query head scores: a causal query `i` of `Sq` sees
            // keys up to `Skv − Sq + i` (a window's left side is not counted off).
            let pairs_of = |sq: usize| {
                if causal {
                    (0..sq)
                        .map(|i| (skv + i + 1).saturating_sub(sq))
                        .sum::<usize>()
                } else {
                    sq * skv
                }
            };
            let pairs: usize = runs(b).into_iter().map(pairs_of).sum();
            let tflops = 4.0 * (hq * d * pairs) as f64 / (us * 1e6);
            let tflops = if sq > 16 {
                format!(" ({tflops:.1} TFLOP/s)")
            } else {
                String::new()
            };
            out!("{name:<34} {splits:>6} {us:>10.1} {gbps:>9.0}  {kernel}{tflops}");
            records.push(format!(
                "{{\"batch\": {b}, \"heads_q\": {hq}, \"heads_kv\": {hkv}, \"seqlen_q\": {sq}, \
                 \"seqlen_k\": {skv}, \"head_dim\": {d}, \"dtype\": \"{}\", \"page\": {page}, \
                 \"causal\": {causal}, \"window_left\": {}, \"splits\": {}, \"us\": {us:.3}, \
                 \"gbps\": {gbps:.1}, \"kv_bytes\": {kv_bytes}, \"kv_dtype\": \"{}\", \
                 \"kernel\": \"{}\"}}",
                dtype.name(),
                window.left.map_or(-1, i64::from),
                splits,
                cache_dt.name(),
                kernel
            ));
            // One decode step (and its merge) captured in a CUDA graph per cache copy;
            // the replays rotate over them (as the SDPA bench's graphs rotate over its
            // inputs), so each replay reads its cache from HBM, not from L2.
            if (b, skv, page, packed) == (1, 8192, 0, false) {
                let side = dev.context().new_stream().map_err(err)?;
                let mut graphs = Vec::new();
                for view in &views {
                    side.begin_capture(
                        cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                    )
                    .map_err(err)?;
                    // SAFETY: as above; the graphs replay on `side`, which the buffers
                    // outlive.
                    let captured = unsafe {
                        attn.decode(
                            &qv,
                            view,
                            None,
                            &ov,
                            Some(&lv),
                            &params,
                            workspace,
                            side.cu_stream(),
                        )
                    };
                    let graph = side
                        .end_capture(
                            cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
                        )
                        .map_err(err)?;
                    captured?;
                    graphs.push(graph.ok_or_else(|| Failure::Run("empty graph".into()))?);
                }
                let mut replay = 0;
                // SAFETY: `side` is a live stream of this context.
                let g = unsafe {
                    flashcore::host::timing::median_ms(
                        dev.context(),
                        side.cu_stream(),
                        5,
                        iters,
                        || {
                            replay += 1;
                            graphs[replay % graphs.len()].launch().map_err(|e| {
                                flashcore::Error::Driver {
                                    call: "cuGraphLaunch",
                                    code: e.to_string(),
                                }
                            })
                        },
                    )
                }?;
                let gus = g.median_ms as f64 * 1e3;
                out!("  CUDA graph (decode + merge), B1 Skv8192: {gus:.1} us");
                records.push(format!(
                    "{{\"graph\": true, \"batch\": 1, \"seqlen_k\": 8192, \"us\": {gus:.3}}}"
                ));
            }
        }
    }
    if let Some(path) = o.value("--json") {
        std::fs::write(path, format!("[\n  {}\n]\n", records.join(",\n  ")))
            .map_err(|e| Failure::Run(format!("writing {path}: {e}")))?;
    }
    Ok(())
}

/// A prompt batch of mixed lengths (Llama-class serving prefill).
const VARLEN_LENS: [usize; 8] = [4096, 333, 2048, 1500, 777, 3000, 128, 1024];

/// Times a packed variable-length batch against the padded dense call a caller without
/// it would make (every sequence at the longest length), on the same GPU and inputs.
/// TFLOP/s count only the real (unpadded, causal-visible) work.
fn varlen(args: &[String]) -> Result<(), Failure> {
    use cudarc::driver::DevicePtr;
    use flashcore::host::tensor::{AttentionParams, LseView, TensorView};
    use flashcore::host::varlen::{Varlen, VarlenHost};

    let o = Opts { args };
    o.check_known(
        &[
            "--json",
            "--iters",
            "--dtype",
            "--heads",
            "--kv-heads",
            "--head-dim",
            "--lens",
            "--q-lens",
            "--path",
        ],
        &["--causal"],
    )?;
    let iters = o.num("--iters", 50)?;
    let dtype = parse_dtype(o.value("--dtype").unwrap_or("f16"))?;
    let (hq, hkv, d) = (
        o.num("--heads", 32)?,
        o.num("--kv-heads", 8)?,
        o.num("--head-dim", 128)?,
    );
    let causal = o.flag("--causal");
    let list = |name: &str| -> Result<Option<Vec<usize>>, Failure> {
        o.value(name)
            .map(|list| {
                list.split(',')
                    .map(|x| {
                        x.parse()
                            .map_err(|_| Failure::Usage(format!("bad length `{x}` in {name}")))
                    })
                    .collect::<Result<Vec<usize>, _>>()
            })
            .transpose()
    };
    // Key lengths, and query lengths (the same unless given: a batch of prompts).
    let lens = list("--lens")?.unwrap_or_else(|| VARLEN_LENS.to_vec());
    let q_lens = list("--q-lens")?.unwrap_or_else(|| lens.clone());
    if q_lens.len() != lens.len() {
        return Err(Failure::Usage(format!(
            "--q-lens has {} lengths, --lens {}",
            q_lens.len(),
            lens.len()
        )));
    }
    let b = lens.len();
    let longest = |l: &[usize]| l.iter().copied().max().unwrap_or(0);
    let (longest_q, longest_k) = (longest(&q_lens), longest(&lens));
    // The padded tensors below are [B, longest, H, D]; the offsets are i32.
    let padded = AttnShape {
        batch: b,
        seqlen_q: longest_q,
        seqlen_k: longest_k,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
    };
    check_sizes(padded, dtype, causal)?;
    let sum = |l: &[usize], name: &str| {
        l.iter()
            .try_fold(0usize, |t, &l| t.checked_add(l))
            .filter(|&t| t <= i32::MAX as usize)
            .ok_or_else(|| Failure::Usage(format!("{name} add up to more than 2^31 - 1 rows")))
    };
    let (total_q, total_k) = (sum(&q_lens, "--q-lens")?, sum(&lens, "--lens")?);
    let dev = open_gpu()?;
    let stream = dev.context().default_stream();
    let attn = Attention::new(dev.clone())?.with_path(parse_path(o.value("--path"))?);
    let err = |e: cudarc::driver::DriverError| Failure::Run(format!("CUDA: {e}"));
    let dt = flashcore::host::tensor::DType::from(dtype);
    let mut rng = Rng::from_entropy();
    let (pool, _) = flashcore::reference::random_half(&mut rng, 1 << 16, dtype);
    let fill = |n: usize| -> Vec<u16> { (0..n).map(|i| pool[(i * 7 + 13) % pool.len()]).collect() };
    // The padded tensors hold the packed ones' room too: [B, longest, H, D].
    let padded_q = b * longest_q * hq * d;
    let padded_kv = b * longest_k * hkv * d;
    let q = stream.clone_htod(&fill(padded_q)).map_err(err)?;
    let k = stream.clone_htod(&fill(padded_kv)).map_err(err)?;
    let v = stream.clone_htod(&fill(padded_kv)).map_err(err)?;
    let out = stream.alloc_zeros::<u16>(padded_q).map_err(err)?;
    let lse = stream.alloc_zeros::<f32>(b * hq * longest_q).map_err(err)?;
    let offsets = |l: &[usize]| -> Vec<i32> {
        std::iter::once(0)
            .chain(l.iter().scan(0i32, |t, &l| {
                *t += l as i32;
                Some(*t)
            }))
            .collect()
    };
    let (cu_q, cu_k) = (offsets(&q_lens), offsets(&lens));
    let cu_q_dev = stream.clone_htod(&cu_q).map_err(err)?;
    let cu_k_dev = stream.clone_htod(&cu_k).map_err(err)?;
    let p = |x: &cudarc::driver::CudaSlice<u16>| x.device_ptr(&stream).0;
    let params = AttentionParams {
        softmax_scale: None,
        causal,
        ..Default::default()
    };
    let lv = LseView {
        ptr: lse.device_ptr(&stream).0,
    };
    let varlen = Varlen {
        cu_seqlens_q: cu_q_dev.device_ptr(&stream).0,
        cu_seqlens_k: cu_k_dev.device_ptr(&stream).0,
        batch: b,
        max_seqlen_q: longest_q,
        host: Some(VarlenHost {
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
        }),
    };
    // (query, key) pairs the mask lets through: query i of sq sees keys up to
    // sk − sq + i (bottom-right aligned) when causal.
    let visible: f64 = q_lens
        .iter()
        .zip(&lens)
        .map(|(&sq, &sk)| {
            if !causal {
                return (sq * sk) as f64;
            }
            (0..sq)
                .map(|i| (sk + i + 1).saturating_sub(sq).min(sk) as f64)
                .sum()
        })
        .sum();
    let flops = 4.0 * visible * (hq * d) as f64;
    // K and V of every sequence, read once.
    let kv_bytes = (2 * total_k * hkv * d * 2) as f64;
    let mut busy = stream.alloc_zeros::<u8>(1 << 30).map_err(err)?;
    let mut time = |packed: bool| -> Result<f64, Failure> {
        let (rows_q, rows_k) = if packed {
            (total_q, total_k)
        } else {
            (longest_q, longest_k)
        };
        let batch = if packed { 1 } else { b };
        let view = |ptr, rows, h| TensorView::bshd(ptr, dt, batch, rows, h, d);
        let (qv, kv, vv, ov) = (
            view(p(&q), rows_q, hq),
            view(p(&k), rows_k, hkv),
            view(p(&v), rows_k, hkv),
            view(p(&out), rows_q, hq),
        );
        // SAFETY: the views lie inside the buffers above (sized for the padded batch),
        // which outlive the timing, on their own stream.
        unsafe {
            median_us_queued(&dev, &stream, &mut busy, iters, |_| {
                if packed {
                    attn.forward_varlen(
                        &qv,
                        &kv,
                        &vv,
                        &ov,
                        Some(&lv),
                        &varlen,
                        &params,
                        stream.cu_stream(),
                    )
                } else {
                    attn.forward(&qv, &kv, &vv, &ov, Some(&lv), &params, stream.cu_stream())
                }
            })
        }
    };
    let packed_us = time(true)?;
    let padded_us = time(false)?;
    out!("{} ({}), flashcore varlen", dev.name(), dev.arch_name());
    if q_lens == lens {
        out!(
            "{b} sequences {lens:?} (total {total_k}), Hq{hq} Hkv{hkv} D{d} {}{}",
            dtype.name(),
            if causal { " causal" } else { "" }
        );
    } else {
        out!(
            "{b} sequences, queries {q_lens:?} (total {total_q}), keys {lens:?} (total \
             {total_k}), Hq{hq} Hkv{hkv} D{d} {}{}",
            dtype.name(),
            if causal { " causal" } else { "" }
        );
    }
    for (what, us) in [
        ("packed (varlen)", packed_us),
        ("padded (dense)", padded_us),
    ] {
        out!(
            "  {what:<16} {us:>9.1} us  {:>6.1} TFLOP/s of real work  {:>7.1} GB/s of K+V",
            flops / (us * 1e6),
            kv_bytes / (us * 1e3)
        );
    }
    out!("  packed / padded speed: {:.2}x", padded_us / packed_us);
    if let Some(path) = o.value("--json") {
        let json = format!(
            "{{\"lens\": {lens:?}, \"q_lens\": {q_lens:?}, \"heads_q\": {hq}, \"heads_kv\": {hkv}, \"head_dim\": {d}, \
             \"dtype\": \"{}\", \"causal\": {causal}, \"packed_us\": {packed_us:.3}, \
             \"padded_us\": {padded_us:.3}, \"flops\": {flops}}}\n",
            dtype.name()
        );
        std::fs::write(path, json).map_err(|e| Failure::Run(format!("writing {path}: {e}")))?;
    }
    Ok(())
}

/// Times the FP8 quantizer (CUDA events, median) on `[B, S, H, D]` Q, K and V with each
/// option set, and a device-to-device copy of Q's bytes as the bandwidth it is measured
/// against. GB/s count the bytes the call must move: each 16-bit input read once (K twice
/// with smoothing: its mean first), each code, scale, mean and `lse_shift` written once.
fn quantize_bench(args: &[String]) -> Result<(), Failure> {
    use cudarc::driver::DevicePtr;
    use flashcore::host::decode::Workspace;
    use flashcore::host::quantize::{Fp8Layout, QuantizeOptions};
    use flashcore::host::tensor::TensorView;

    let o = Opts { args };
    o.check_known(
        &[
            "--batch",
            "--heads",
            "--kv-heads",
            "--seqlen",
            "--head-dim",
            "--dtype",
            "--iters",
            "--json",
        ],
        &[],
    )?;
    let iters = o.num("--iters", 50)?;
    let dtype = parse_dtype(o.value("--dtype").unwrap_or("f16"))?;
    let (b, s, hq, d) = (
        o.num("--batch", 4)?,
        o.num("--seqlen", 8192)?,
        o.num("--heads", 32)?,
        o.num("--head-dim", 128)?,
    );
    let hkv = o.num("--kv-heads", hq)?;
    let shape = AttnShape {
        batch: b,
        seqlen_q: s,
        seqlen_k: s,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
    };
    let all_options = QuantizeOptions {
        smooth_k: true,
        hadamard_seed: Some(1),
    };
    // Sizes first, before a GPU is opened: the library's checks, then the layout, which
    // refuses operands past the address space (so the element counts below fit).
    check_fp8_sizes(shape, &all_options)?;
    let ws_bytes = Fp8Layout::new(&shape, &all_options)?.bytes;
    let dev = open_gpu()?;
    let stream = dev.context().default_stream();
    let attn = Attention::new(dev.clone())?;
    let err = |e: cudarc::driver::DriverError| Failure::Run(format!("CUDA: {e}"));
    let dt = flashcore::host::tensor::DType::from(dtype);
    let mut rng = Rng::from_entropy();
    let (pool, _) = flashcore::reference::random_half(&mut rng, 1 << 16, dtype);
    let fill = |n: usize| -> Vec<u16> { (0..n).map(|i| pool[(i * 7 + 13) % pool.len()]).collect() };
    let (nq, nkv) = (shape.q_len(), shape.kv_len());
    let q = stream.clone_htod(&fill(nq)).map_err(err)?;
    let k = stream.clone_htod(&fill(nkv)).map_err(err)?;
    let v = stream.clone_htod(&fill(nkv)).map_err(err)?;
    let mut copy = stream.alloc_zeros::<u16>(nq).map_err(err)?;
    let ws = stream
        .alloc_zeros::<u8>(ws_bytes + Fp8Layout::ALIGN)
        .map_err(err)?;
    let workspace = Workspace {
        ptr: ws
            .device_ptr(&stream)
            .0
            .next_multiple_of(Fp8Layout::ALIGN as u64),
        bytes: ws_bytes,
    };
    let p = |x: &cudarc::driver::CudaSlice<u16>| x.device_ptr(&stream).0;
    let (qv, kv, vv) = (
        TensorView::bshd(p(&q), dt, b, s, hq, d),
        TensorView::bshd(p(&k), dt, b, s, hkv, d),
        TensorView::bshd(p(&v), dt, b, s, hkv, d),
    );
    let mut busy = stream.alloc_zeros::<u8>(1 << 30).map_err(err)?;

    // SAFETY: `q` and `copy` are live buffers of `nq` elements on `stream`.
    let copy_us = unsafe {
        median_us_queued(&dev, &stream, &mut busy, iters, |_| {
            stream
                .memcpy_dtod(&q, &mut copy)
                .map_err(|e| flashcore::Error::Driver {
                    call: "cuMemcpyDtoDAsync",
                    code: e.to_string(),
                })
        })
    }?;
    let copy_gbps = (4 * nq) as f64 / (copy_us * 1e3);
    out!(
        "{} ({}), flashcore quantize-bench, B{b} S{s} Hq{hq} Hkv{hkv} D{d} {}",
        dev.name(),
        dev.arch_name(),
        dtype.name()
    );
    out!("copy of q (device to device): {copy_us:.1} us, {copy_gbps:.0} GB/s read+write");
    out!(
        "{:<22} {:>10} {:>9} {:>8}",
        "options",
        "us",
        "GB/s",
        "of copy"
    );
    let mut records = vec![format!(
        "{{\"op\": \"copy\", \"bytes\": {}, \"us\": {copy_us:.3}, \"gbps\": {copy_gbps:.1}}}",
        4 * nq
    )];
    for (name, options) in [
        ("none", QuantizeOptions::default()),
        (
            "smooth_k",
            QuantizeOptions {
                smooth_k: true,
                hadamard_seed: None,
            },
        ),
        (
            "hadamard",
            QuantizeOptions {
                smooth_k: false,
                hadamard_seed: Some(1),
            },
        ),
        ("smooth_k+hadamard", all_options),
    ] {
        let layout = Fp8Layout::new(&shape, &options)?;
        // Inputs read (K twice with smoothing) and every output region written.
        let reads = 2 * (nq + 2 * nkv + if options.smooth_k { nkv } else { 0 });
        let writes = layout.q.bytes
            + layout.k.bytes
            + layout.vt.bytes
            + layout.q_scale.bytes
            + layout.k_scale.bytes
            + layout.v_scale.bytes
            + layout.k_mean.map_or(0, |r| r.bytes)
            + layout.k_mean_rotated.map_or(0, |r| r.bytes)
            + layout.lse_shift.map_or(0, |r| r.bytes);
        let bytes = reads + writes;
        // SAFETY: the views and the workspace lie in the live buffers above, on `stream`.
        let us = unsafe {
            median_us_queued(&dev, &stream, &mut busy, iters, |_| {
                attn.quantize_fp8(&qv, &kv, &vv, &options, workspace, stream.cu_stream())
                    .map(|_| ())
            })
        }?;
        let gbps = bytes as f64 / (us * 1e3);
        out!(
            "{name:<22} {us:>10.1} {gbps:>9.0} {:>7.0}%",
            100.0 * gbps / copy_gbps
        );
        records.push(format!(
            "{{\"op\": \"quantize\", \"options\": \"{name}\", \"batch\": {b}, \"seqlen\": {s}, \
             \"heads_q\": {hq}, \"heads_kv\": {hkv}, \"head_dim\": {d}, \"dtype\": \"{}\", \
             \"bytes\": {bytes}, \"us\": {us:.3}, \"gbps\": {gbps:.1}, \
             \"fraction_of_copy\": {:.3}}}",
            dtype.name(),
            gbps / copy_gbps
        ));
    }
    if let Some(path) = o.value("--json") {
        std::fs::write(path, format!("[\n  {}\n]\n", records.join(",\n  ")))
            .map_err(|e| Failure::Run(format!("writing {path}: {e}")))?;
    }
    Ok(())
}

/// The median time of `call(turn)` in µs (CUDA events, 5 warm-up calls, then `iters`),
/// with GPU work queued ahead of the timed calls (`busy` cleared as often as
/// [`flashcore::host::timing::Backlog::covering`] says): the host then queues them faster
/// than they run, so each span is GPU time, not launch overhead (as the SDPA benches'
/// sleep does).
///
/// # Safety
///
/// As for [`flashcore::host::timing::median_ms`]: whatever `call` launches must be valid
/// work on `stream`.
unsafe fn median_us_queued(
    dev: &Device,
    stream: &Arc<cudarc::driver::CudaStream>,
    busy: &mut cudarc::driver::CudaSlice<u8>,
    iters: usize,
    mut call: impl FnMut(usize) -> flashcore::Result<()>,
) -> Result<f64, Failure> {
    use cudarc::driver::DevicePtrMut;
    let ptr = busy.device_ptr_mut(stream).0;
    let backlog = flashcore::host::timing::Backlog::covering(ptr, busy.len(), iters);
    let mut turn = 0;
    // SAFETY: `stream` is a live stream of the device's context and `busy` live memory of
    // it that nothing else uses meanwhile; the caller vouches for what `call` launches.
    let t = unsafe {
        flashcore::host::timing::median_ms_queued(
            dev.context(),
            stream.cu_stream(),
            backlog,
            5,
            iters,
            || {
                turn += 1;
                call(turn)
            },
        )
    }?;
    Ok(t.median_ms as f64 * 1e3)
}

/// The FP8 benchmark shapes: rows of the Hopper grid (batch × S = 16384, H = 2048 / D,
/// as `sdpa_bench.py --shapes hopper`) at S >= 4096, so SDPA's figures line up.
const FP8_SHAPES: [(usize, usize, usize, usize); 8] = [
    (4, 16, 4096, 128),
    (2, 16, 8192, 128),
    (1, 16, 16384, 128),
    (4, 8, 4096, 256),
    (2, 8, 8192, 256),
    (1, 8, 16384, 256),
    (4, 32, 4096, 64),
    (2, 32, 8192, 64),
];

/// `flashcore fp8`: the FP8 forward (on operands the GPU quantizer made from N(0, 1) f16
/// draws, its time reported beside) against our 16-bit forward on the same shapes, causal
/// and not, in one run.
fn fp8_bench(args: &[String]) -> Result<(), Failure> {
    use cudarc::driver::DevicePtr;
    use flashcore::host::decode::Workspace;
    use flashcore::host::quantize::{Fp8Layout, QuantizeOptions};
    use flashcore::host::tensor::{AttentionParams, DType, LseView, TensorView};

    let o = Opts { args };
    o.check_known(&["--shapes", "--path", "--iters"], &[])?;
    let iters = o.num("--iters", 30)?;
    let shapes: Vec<(usize, usize, usize, usize)> = match o.value("--shapes") {
        None => FP8_SHAPES.to_vec(),
        Some(list) => list
            .split(',')
            .map(|x| {
                let n: Option<Vec<usize>> = x.split(':').map(|v| v.parse().ok()).collect();
                match n.as_deref() {
                    Some(&[b, h, s, d]) => Ok((b, h, s, d)),
                    _ => Err(Failure::Usage(format!("shape `{x}` is not B:H:S:D"))),
                }
            })
            .collect::<Result<_, _>>()?,
    };
    for &(b, h, s, d) in &shapes {
        check_fp8_sizes(AttnShape::square(b, h, s, d), &QuantizeOptions::default())?;
    }
    let dev = open_gpu()?;
    let stream = dev.context().default_stream();
    let attn = Attention::new(dev.clone())?.with_path(parse_path(o.value("--path"))?);
    let err = |e: cudarc::driver::DriverError| Failure::Run(format!("CUDA: {e}"));
    let mut busy = stream.alloc_zeros::<u8>(64 << 20).map_err(err)?;
    let mut rng = Rng::from_entropy();
    // N(0, 1) f16 draws, repeated (drawing every element of a 16k-token batch would cost
    // more than the timing).
    let (pool, _) = flashcore::reference::random_half(&mut rng, 1 << 16, HalfType::F16);
    let fill16 = |n: usize, salt: usize| -> Vec<u16> {
        (0..n).map(|i| pool[(i * 7 + salt) % pool.len()]).collect()
    };
    out!(
        "{}: FP8 (e4m3, per-block scales) against our f16 forward; quant = the GPU quantizer \
         (Q, K, V to codes, scales and Vᵀ), e2e = quant + fp8",
        dev.name()
    );
    out!(
        "{:<26} {:<6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "shape",
        "mask",
        "fp8 us",
        "TFLOP/s",
        "quant us",
        "e2e TF/s",
        "f16 us",
        "TFLOP/s",
        "fp8/f16",
        "e2e/f16"
    );
    for (b, h, s, d) in shapes {
        for causal in [false, true] {
            let shape = AttnShape::square(b, h, s, d);
            let case = FwdCase {
                shape,
                dtype: HalfType::F16,
                causal,
                window: Default::default(),
                layout: Layout::Bshd,
                kernel: None,
                softcap: None,
                softmax_scale: None,
            };
            let flops = case.flops();
            let f16 = flashcore::check::DeviceCase::for_timing(&stream, case, &mut rng)?;
            let params = AttentionParams {
                softmax_scale: None,
                causal,
                ..Default::default()
            };
            // SAFETY: the case's buffers are live allocations of this context.
            let f16_us = unsafe {
                median_us_queued(&dev, &stream, &mut busy, iters, |_| f16.run(&attn, &params))
            }?;
            drop(f16);
            // 16-bit inputs, quantized on the GPU with the default options: the FP8
            // forward runs on real codes and scales, and the quantizer's time is reported.
            let n = b * s * h * d;
            let q16 = stream.clone_htod(&fill16(n, 1)).map_err(err)?;
            let k16 = stream.clone_htod(&fill16(n, 2)).map_err(err)?;
            let v16 = stream.clone_htod(&fill16(n, 3)).map_err(err)?;
            let p16 = |x: &cudarc::driver::CudaSlice<u16>| x.device_ptr(&stream).0;
            let (qv, kv, vv) = (
                TensorView::bshd(p16(&q16), DType::F16, b, s, h, d),
                TensorView::bshd(p16(&k16), DType::F16, b, s, h, d),
                TensorView::bshd(p16(&v16), DType::F16, b, s, h, d),
            );
            let options = QuantizeOptions::default();
            let layout = Fp8Layout::new(&shape, &options)?;
            let ws = stream
                .alloc_zeros::<u8>(layout.bytes + Fp8Layout::ALIGN)
                .map_err(err)?;
            let workspace = Workspace {
                ptr: ws
                    .device_ptr(&stream)
                    .0
                    .next_multiple_of(Fp8Layout::ALIGN as u64),
                bytes: layout.bytes,
            };
            let cu = stream.cu_stream();
            // SAFETY: the views and the workspace are live allocations of this context
            // sized by the shape; nothing else touches them meanwhile.
            let quant_us = unsafe {
                median_us_queued(&dev, &stream, &mut busy, iters, |_| {
                    attn.quantize_fp8(&qv, &kv, &vv, &options, workspace, cu)
                        .map(|_| ())
                })
            }?;
            // SAFETY: as above.
            let ops = unsafe { attn.quantize_fp8(&qv, &kv, &vv, &options, workspace, cu) }?;
            let out = stream.alloc_zeros::<u16>(n).map_err(err)?;
            let lse = stream.alloc_zeros::<f32>(b * h * s).map_err(err)?;
            let ov = TensorView::bshd(out.device_ptr(&stream).0, DType::F16, b, s, h, d);
            let lv = LseView {
                ptr: lse.device_ptr(&stream).0,
            };
            // SAFETY: every view points at a live allocation of this context sized by it.
            let fp8_us = unsafe {
                median_us_queued(&dev, &stream, &mut busy, iters, |_| {
                    attn.forward_fp8(&ops, &ov, Some(&lv), &params, stream.cu_stream())
                })
            }?;
            let tf = |us: f64| flops / (us * 1e6);
            let e2e_us = fp8_us + quant_us;
            out!(
                "B{b:<2} H{h:<3} S{s:<6} D{d:<4}  {:<6} {fp8_us:>8.1} {:>8.1} {quant_us:>8.1} {:>8.1} {f16_us:>8.1} {:>8.1} {:>8.2} {:>8.2}",
                if causal { "causal" } else { "full" },
                tf(fp8_us),
                tf(e2e_us),
                tf(f16_us),
                f16_us / fp8_us,
                f16_us / e2e_us
            );
        }
    }
    for (id, _, regs, local) in attn.loaded_kernels() {
        out!("kernel {id}: {regs} registers, {local} bytes local memory");
    }
    Ok(())
}

/// `flashcore calibrate`: the FP8 calibration suite ([`flashcore::calibrate`]).
fn calibrate(args: &[String]) -> Result<(), Failure> {
    use flashcore::calibrate::{self as cal, Distribution, Method, Record};
    let o = Opts { args };
    o.check_known(
        &[
            "--seqlens",
            "--heads",
            "--head-dim",
            "--rows",
            "--inputs",
            "--path",
            "--seed",
            "--json",
        ],
        &["--cpu"],
    )?;
    let list = |name: &str, default: &str| -> Vec<String> {
        o.value(name)
            .unwrap_or(default)
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let seqlens = list("--seqlens", "512,2048,8192,16384")
        .iter()
        .map(|s| {
            s.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| Failure::Usage(format!("--seqlens: `{s}` is not a length")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let dists = match o.value("--inputs") {
        None => Distribution::ALL.to_vec(),
        Some(_) => list("--inputs", "")
            .iter()
            .map(|n| {
                Distribution::ALL
                    .into_iter()
                    .find(|d| d.name() == n)
                    .ok_or_else(|| Failure::Usage(format!("--inputs: unknown input `{n}`")))
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    if seqlens.is_empty() || dists.is_empty() {
        return Err(Failure::Usage(
            "--seqlens and --inputs each need at least one entry".into(),
        ));
    }
    let heads = o.num("--heads", 8)?;
    let head_dim = o.num("--head-dim", 128)?;
    let max_rows = o.num("--rows", 512)?;
    if max_rows == 0 {
        return Err(Failure::Usage("--rows takes a count of at least 1".into()));
    }
    let seed = o.num("--seed", 0x0CA1)? as u64;
    let path = parse_path(o.value("--path"))?;
    // Every method's operands (the options included) at every length, as the library
    // checks them, before anything is drawn or a GPU opened.
    let all_options = flashcore::host::quantize::QuantizeOptions {
        smooth_k: true,
        hadamard_seed: Some(seed),
    };
    for &seqlen in &seqlens {
        let shape = AttnShape::square(1, heads, seqlen, head_dim);
        check_fp8_sizes(shape, &all_options)?;
    }
    let cpu = o.flag("--cpu");
    let gpu = if cpu {
        None
    } else {
        let dev = open_gpu()?;
        let stream = dev.context().default_stream();
        let attn = Attention::new(dev.clone())?.with_path(path);
        Some((dev, stream, attn))
    };
    let context = match &gpu {
        Some((dev, _, attn)) => format!(
            "{} ({:?} path), B1 H{heads} D{head_dim}, non-causal, up to {max_rows} sampled rows per head, seed {seed:#x}",
            dev.name(),
            attn.path_choice()
        ),
        None => format!(
            "CPU model of the FP8 kernels (128-key tiles, exact sums), B1 H{heads} D{head_dim}, non-causal, up to {max_rows} sampled rows per head, seed {seed:#x}"
        ),
    };
    out!("FP8 calibration: {context}");
    let mut records = Vec::new();
    for &seqlen in &seqlens {
        let shape = AttnShape {
            batch: 1,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            heads_q: heads,
            heads_kv: heads,
            head_dim,
        };
        let rows = cal::sample_rows(seqlen, max_rows);
        for &dist in &dists {
            // The input's index in the full suite, so that a subset draws what the whole
            // suite would for the same length and seed.
            let di = Distribution::ALL
                .iter()
                .position(|&d| d == dist)
                .unwrap_or(0);
            let mut rng = Rng::new(seed ^ ((seqlen as u64) << 8) ^ di as u64);
            let x = cal::draw(dist, shape, &mut rng);
            let want = cal::reference(&x, &rows);
            for method in Method::ALL {
                let fp8 = cal::quantize(&x, method);
                let (got, nonfinite) = match (&gpu, &fp8) {
                    (Some((_, stream, attn)), _) => {
                        cal::run_gpu(attn, stream, &x, fp8.as_ref(), &rows)?
                    }
                    (None, Some(f)) => (cal::fp8_model(&x, f, &rows, 128), 0),
                    (None, None) => continue,
                };
                let measured = cal::measure(&shape, &got, &want, nonfinite);
                out!(
                    "{:<16} S{:<6} {:<19} rmse {:.3e}  rel L2 {:.3e}  worst head {:.3e}  lse {:.2e}{}",
                    dist.name(),
                    seqlen,
                    method.name(),
                    measured.rmse,
                    measured.rel_l2,
                    measured.worst_head_rel_l2,
                    measured.lse_max_abs,
                    if measured.nonfinite > 0 {
                        format!("  {} NaN/Inf", measured.nonfinite)
                    } else {
                        String::new()
                    }
                );
                records.push(Record {
                    dist,
                    seqlen,
                    method,
                    measured,
                });
            }
        }
    }
    out!("\n{}", cal::table(&records));
    let verdicts = cal::verdicts(&records);
    for v in &verdicts {
        out!(
            "{} {}: {}",
            match v.met {
                Some(true) => "MET ",
                Some(false) => "MISS",
                None => "n/a ",
            },
            v.target,
            v.detail
        );
    }
    if let Some(path) = o.value("--json") {
        std::fs::write(path, cal::json(&records, &verdicts, &context))
            .map_err(|e| Failure::Run(format!("writing {path}: {e}")))?;
    }
    Ok(())
}
