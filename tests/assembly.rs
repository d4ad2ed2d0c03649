//! Offline assembly of every catalog kernel with NVIDIA's `ptxas`, no GPU needed.
//!
//! For each kernel of [`flashcore::kernels::catalog`], the generated PTX is assembled for
//! every architecture its `.target` is meant to run on (an `sm_80` module: sm_80, sm_89
//! and sm_90), and the test checks that:
//!
//! - ptxas accepts it,
//! - `ptxas -v` reports 0 bytes of spill stores and spill loads,
//! - the SASS (`cuobjdump --dump-sass`) contains `HMMA` (`mma.sync`) and `LDGSTS`
//!   (`cp.async`), i.e. the tensor-core and async-copy paths survived assembly,
//! - a warp-MMA kernel has few register moves per `HMMA` (see [`MAX_MOVES_PER_4_HMMA`]).
//!
//! Tools: `ptxas` and `cuobjdump` (which runs `nvdisasm`) are looked up in the directory
//! `$FLASHCORE_CUDA_BIN` when it is set, else on `PATH`. Without them the tests FAIL (they
//! never pass silently); install them with `scripts/install-cuda-tools.sh DIR` and put
//! `DIR/nvidia/cu13/bin` on `PATH` (or in `FLASHCORE_CUDA_BIN`).
//!
//! Run with `cargo test --release --test assembly -- --nocapture` to see the table of
//! registers, spills and shared memory per kernel and architecture.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use flashcore::kernels;
use flashcore::ptx::{
    F16x2, F32, Kernel, Module, SmemLayout, SmemPlan, Special, Swizzle, Target, U64,
};

// ---- tool discovery ---------------------------------------------------------------------

const INSTALL_HINT: &str = "run the tests with `scripts/test.sh`, which installs the pinned \
CUDA tools (pip wheels, no GPU or CUDA toolkit needed) and puts them on PATH";

/// Where ptxas and cuobjdump were found.
struct Tools {
    ptxas: PathBuf,
    cuobjdump: PathBuf,
    /// PATH for child processes: the tools' directory first, so cuobjdump finds nvdisasm.
    child_path: OsString,
}

fn is_executable(p: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    }
    #[cfg(not(unix))]
    {
        p.is_file()
    }
}

fn find_tool(name: &str) -> Result<PathBuf, String> {
    let exe = format!("{name}{}", std::env::consts::EXE_SUFFIX);
    if let Some(dir) = std::env::var_os("FLASHCORE_CUDA_BIN").filter(|d| !d.is_empty()) {
        let p = PathBuf::from(&dir).join(&exe);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(format!(
                "`{name}` not found: FLASHCORE_CUDA_BIN={} has no executable {exe}; {INSTALL_HINT}",
                PathBuf::from(dir).display()
            ))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(&exe))
        .find(|p| is_executable(p))
        .ok_or_else(|| {
            format!("`{name}` not found on PATH (and FLASHCORE_CUDA_BIN is unset); {INSTALL_HINT}")
        })
}

/// Finds the tools or fails the test with instructions.
fn tools() -> Tools {
    let ptxas = find_tool("ptxas").unwrap_or_else(|e| panic!("{e}"));
    let cuobjdump = find_tool("cuobjdump").unwrap_or_else(|e| panic!("{e}"));
    let mut dirs: Vec<PathBuf> = Vec::new();
    for t in [&ptxas, &cuobjdump] {
        if let Some(d) = t.parent() {
            dirs.push(d.to_path_buf());
        }
    }
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let child_path = std::env::join_paths(dirs).expect("PATH entries are joinable");
    Tools {
        ptxas,
        cuobjdump,
        child_path,
    }
}

// ---- temp dirs --------------------------------------------------------------------------

/// A fresh directory under the system temp dir; removed on drop unless `keep` is set
/// (kept after a failure, so the PTX and cubins can be inspected).
struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "flashcore-{tag}-{}-{nanos}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        TempDir { path, keep: false }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.keep {
            eprintln!("assembly: kept work files in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

// ---- ptxas -v parsing -------------------------------------------------------------------

/// What `ptxas -v` reports for one entry function.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct FnStats {
    name: String,
    registers: u32,
    stack_frame: u32,
    spill_stores: u32,
    spill_loads: u32,
    /// Static shared memory (dynamic shared memory is sized at launch and not reported).
    smem: u32,
}

/// The number right before `what` in `line` (`"0 bytes spill stores"` -> 0).
fn number_before(line: &str, what: &str) -> Option<u32> {
    let at = line.find(what)?;
    line[..at].split_whitespace().last()?.parse().ok()
}

/// Parses `ptxas -v` output (stdout and stderr together) into one record per function.
///
/// ```text
/// ptxas info    : Compiling entry function 'k' for 'sm_80'
/// ptxas info    : Function properties for k
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 168 registers, used 1 barriers, 32768 bytes smem, 400 bytes cmem[0]
/// ```
fn parse_ptxas_verbose(out: &str) -> Vec<FnStats> {
    let mut fns: Vec<FnStats> = Vec::new();
    for line in out.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            fns.push(FnStats {
                name,
                ..FnStats::default()
            });
            continue;
        }
        let Some(cur) = fns.last_mut() else { continue };
        if line.contains("bytes spill stores") {
            cur.stack_frame = number_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = number_before(line, "bytes spill stores").unwrap_or(u32::MAX);
            cur.spill_loads = number_before(line, "bytes spill loads").unwrap_or(u32::MAX);
        } else if line.contains("Used ") && line.contains(" registers") {
            cur.registers = number_before(line, "registers").unwrap_or(0);
            cur.smem = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    fns
}

// ---- assembling -------------------------------------------------------------------------

/// The `ptxas -arch` values a module is meant to run on: every tested architecture at or
/// above its `.target` (`sm_80` -> sm_80, sm_89, sm_90); an arch-specific target (`sm_90a`)
/// runs only on itself.
fn archs_for(target: Target) -> Vec<String> {
    const TESTED: [u32; 3] = [80, 89, 90];
    let name = target.name();
    if name.ends_with('a') || name.ends_with('f') {
        return vec![name.to_string()];
    }
    let cc: u32 = name.trim_start_matches("sm_").parse().unwrap_or(0);
    let v: Vec<String> = TESTED
        .iter()
        .filter(|&&a| a >= cc)
        .map(|a| format!("sm_{a}"))
        .collect();
    if v.is_empty() {
        vec![name.to_string()]
    } else {
        v
    }
}

/// The result of assembling one module for one architecture.
struct Assembled {
    arch: String,
    fns: Vec<FnStats>,
    sass: String,
    /// ptxas' own output (`-v` resource lines and any warnings).
    log: String,
}

fn run(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: cannot run: {e}"))?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        Ok(text)
    } else {
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Err(format!(
            "{what} failed ({}):\n{}",
            out.status,
            tail.join("\n")
        ))
    }
}

/// `ptxas -arch=<arch> -v` then `cuobjdump --dump-sass`.
fn assemble(tools: &Tools, ptx_file: &Path, arch: &str) -> Result<Assembled, String> {
    let cubin = ptx_file.with_extension(format!("{arch}.cubin"));
    let verbose = run(
        Command::new(&tools.ptxas)
            .env("PATH", &tools.child_path)
            .arg(format!("-arch={arch}"))
            .arg("-v")
            .arg("-o")
            .arg(&cubin)
            .arg(ptx_file),
        &format!("ptxas -arch={arch}"),
    )?;
    let fns = parse_ptxas_verbose(&verbose);
    if fns.is_empty() {
        return Err(format!("could not parse `ptxas -v` output:\n{verbose}"));
    }
    let sass = run(
        Command::new(&tools.cuobjdump)
            .env("PATH", &tools.child_path)
            .arg("--dump-sass")
            .arg(&cubin),
        "cuobjdump --dump-sass",
    )?;
    Ok(Assembled {
        arch: arch.to_string(),
        fns,
        sass,
        log: verbose,
    })
}

/// ptxas performance warnings that mean a Hopper kernel silently lost what it exists for:
/// C7508, `setmaxnreg` ignored (no register count at entry), and C7515, wgmma serialized
/// (accumulators touched while in flight, or wgmma in a non-warpgroup-uniform branch).
const FORBIDDEN_WARNINGS: [&str; 2] = ["C7508", "C7515"];

/// A warp-MMA kernel may have at most one register move per four `HMMA`s, plus
/// [`MOVE_ALLOWANCE`] for setup and epilogue. `mma.sync` takes each operand fragment in
/// aligned, consecutive registers; when `ldmatrix` delivers them in another order, ptxas
/// re-pairs them with a `MOV` per register per tile, which cost the sm80 forward ~10% at
/// one point (one `MOV` per `HMMA`) while every other check stayed green.
const MAX_MOVES_PER_4_HMMA: usize = 1;
const MOVE_ALLOWANCE: usize = 64;

/// `(register moves, HMMA)` instruction counts of a SASS listing.
fn moves_and_hmma(sass: &str) -> (usize, usize) {
    let ops = sass.lines().filter_map(|l| {
        // `        /*0690*/                   MOV R4, R36 ;`: the opcode follows the address.
        let rest = l.trim_start().strip_prefix("/*")?;
        let (_, inst) = rest.split_once("*/")?;
        inst.split_whitespace().find(|w| !w.starts_with('@'))
    });
    ops.fold((0, 0), |(m, h), op| {
        let is_move = op == "MOV" || op.starts_with("MOV.") || op == "IMAD.MOV.U32";
        (
            m + usize::from(is_move),
            h + usize::from(op.starts_with("HMMA")),
        )
    })
}

/// Checks one assembly; returns every problem found.
fn check(id: &str, a: &Assembled, entries: &[String], expected_sass: &[&str]) -> Vec<String> {
    let mut errs = Vec::new();
    for f in &a.fns {
        if f.spill_stores != 0 || f.spill_loads != 0 {
            errs.push(format!(
                "{id} [{}]: `{}` spills: {} bytes stores, {} bytes loads ({} registers)",
                a.arch, f.name, f.spill_stores, f.spill_loads, f.registers
            ));
        }
    }
    for e in entries {
        if !a.fns.iter().any(|f| &f.name == e) {
            errs.push(format!(
                "{id} [{}]: ptxas did not report entry `{e}`",
                a.arch
            ));
        }
    }
    for entry in expected_sass {
        // `sm_NN:OP` is expected on sm_NN only.
        let op = match entry.split_once(':') {
            Some((arch, op)) if arch == a.arch => op,
            Some(_) => continue,
            None => entry,
        };
        if !a.sass.contains(op) {
            errs.push(format!(
                "{id} [{}]: SASS has no {op} (its instruction is missing or was lowered to \
                 something else)",
                a.arch
            ));
        }
    }
    if expected_sass.contains(&"HMMA") {
        let (moves, hmma) = moves_and_hmma(&a.sass);
        if moves > hmma * MAX_MOVES_PER_4_HMMA / 4 + MOVE_ALLOWANCE {
            errs.push(format!(
                "{id} [{}]: {moves} register moves for {hmma} HMMA: fragments are \
                 re-paired in the loop (check the ldmatrix lane roles)",
                a.arch
            ));
        }
    }
    // ptxas lowers a 64-bit integer division, even by a constant, to a call of a routine
    // of about a hundred instructions that starts from this conversion.
    if a.sass.contains("I2F.U64.RP") {
        errs.push(format!(
            "{id} [{}]: SASS calls the 64-bit integer division routine (I2F.U64.RP): divide \
             by a shift or a reciprocal instead",
            a.arch
        ));
    }
    for w in FORBIDDEN_WARNINGS {
        if a.log.contains(w) {
            let line = a.log.lines().find(|l| l.contains(w)).unwrap_or(w);
            errs.push(format!("{id} [{}]: ptxas warned: {line}", a.arch));
        }
    }
    errs
}

/// Maps `f` over `items` on `available_parallelism` threads, keeping the order.
fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .min(items.len().max(1));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= items.len() {
                        break;
                    }
                    let r = f(&items[i]);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.expect("every item was processed"))
        .collect()
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

/// One module to assemble: its id, the dynamic shared memory its launch asks for (not
/// visible to ptxas) and the SASS instruction classes it must show.
struct Job {
    id: String,
    module: Module,
    dyn_smem: Option<u32>,
    expect: &'static [&'static str],
}

struct Row {
    id: String,
    arch: String,
    stats: FnStats,
    dyn_smem: Option<u32>,
}

fn print_table(rows: &[Row]) {
    let w = rows.iter().map(|r| r.id.len()).max().unwrap_or(2).max(2);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<w$}  {:<6}  {:>4}  {:>11}  {:>11}  {:>5}  {:>9}  {:>9}",
        "id", "arch", "regs", "spill st B", "spill ld B", "stack", "smem B", "dyn smem B"
    );
    for r in rows {
        let dynamic = r
            .dyn_smem
            .map(|b| b.to_string())
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "{:<w$}  {:<6}  {:>4}  {:>11}  {:>11}  {:>5}  {:>9}  {:>9}",
            r.id,
            r.arch,
            r.stats.registers,
            r.stats.spill_stores,
            r.stats.spill_loads,
            r.stats.stack_frame,
            r.stats.smem,
            dynamic
        );
    }
    println!("{s}");
}

/// Assembles `modules` (id, module) for every architecture each is meant for; prints the
/// table and returns every failure.
fn assemble_all(tools: &Tools, dir: &Path, modules: &[Job]) -> (Vec<Row>, Vec<String>) {
    let mut jobs: Vec<(usize, String, PathBuf)> = Vec::new();
    let mut failures = Vec::new();
    for (i, Job { id, module: m, .. }) in modules.iter().enumerate() {
        let ptx_file = dir.join(format!("{id}.ptx"));
        if let Err(e) = std::fs::write(&ptx_file, m.to_ptx()) {
            failures.push(format!("{id}: cannot write {}: {e}", ptx_file.display()));
            continue;
        }
        for arch in archs_for(m.target()) {
            jobs.push((i, arch, ptx_file.clone()));
        }
    }
    let results = par_map(&jobs, |(i, arch, ptx_file)| {
        let job = &modules[*i];
        let entries: Vec<String> = job.module.entry_names().map(str::to_string).collect();
        let id = &job.id;
        match assemble(tools, ptx_file, arch) {
            Ok(a) => {
                let errs = check(id, &a, &entries, job.expect);
                (Some(a), errs)
            }
            Err(e) => (None, vec![format!("{id} [{arch}]: {e}")]),
        }
    });
    let mut rows = Vec::new();
    for ((i, _, _), (a, errs)) in jobs.iter().zip(results) {
        let job = &modules[*i];
        if let Some(a) = a {
            for f in a.fns {
                rows.push(Row {
                    id: job.id.clone(),
                    arch: a.arch.clone(),
                    stats: f,
                    dyn_smem: job.dyn_smem,
                });
            }
        }
        failures.extend(errs);
    }
    print_table(&rows);
    (rows, failures)
}

fn fail_with(dir: &mut TempDir, what: &str, failures: &[String]) -> ! {
    dir.keep = true;
    panic!(
        "{what}: {} failure(s):\n\n{}\n",
        failures.len(),
        failures.join("\n\n")
    );
}

// ---- tests ------------------------------------------------------------------------------

/// Every catalog kernel assembles for every architecture it targets, without spills and
/// without ptxas' C7508/C7515 warnings, and its SASS shows the instruction classes the
/// kernel declares (`KernelSpec::expected_sass`: HMMA + LDGSTS for the sm80 path, HGMMA
/// or QGMMA + UTMALDG + SYNCS for sm_90a kernels, QMMA on sm_89 for the FP8 fallback).
///
/// `FLASHCORE_ASSEMBLY_FILTER=text` assembles only the kernels whose id contains `text`.
#[test]
fn catalog_kernels_assemble_without_spills() {
    let tools = tools();
    let mut specs = kernels::catalog();
    assert!(!specs.is_empty(), "the kernel catalog is empty");
    if let Some(filter) = std::env::var_os("FLASHCORE_ASSEMBLY_FILTER") {
        let filter = filter.to_string_lossy().into_owned();
        specs.retain(|s| s.id().contains(&filter));
        assert!(
            !specs.is_empty(),
            "no catalog kernel id contains {filter:?}"
        );
    }

    let generated = par_map(&specs, |spec| {
        let id = spec.id();
        let r = catch_unwind(AssertUnwindSafe(|| spec.generate()));
        let smem = catch_unwind(AssertUnwindSafe(|| spec.smem_bytes())).ok();
        (
            id,
            r.map_err(|p| panic_message(p.as_ref())),
            smem,
            spec.expected_sass(),
        )
    });
    let mut failures = Vec::new();
    let mut modules = Vec::new();
    for (id, r, dyn_smem, expect) in generated {
        match r {
            Ok(Ok(m)) => {
                if !m.entry_names().any(|e| e == id) {
                    let names: Vec<&str> = m.entry_names().collect();
                    failures.push(format!(
                        "{id}: the module has no entry named after the id (entries: {names:?})"
                    ));
                }
                modules.push(Job {
                    id,
                    module: m,
                    dyn_smem,
                    expect,
                });
            }
            Ok(Err(e)) => failures.push(format!("{id}: generate() returned an error: {e}")),
            Err(msg) => failures.push(format!("{id}: generate() panicked: {msg}")),
        }
    }

    let mut dir = TempDir::new("assembly");
    let (rows, asm_failures) = assemble_all(&tools, &dir.path, &modules);
    failures.extend(asm_failures);
    println!(
        "assembly: {} kernels in the catalog, {} generated, {} (kernel, arch) assemblies reported",
        specs.len(),
        modules.len(),
        rows.len()
    );
    if !failures.is_empty() {
        fail_with(&mut dir, "catalog assembly", &failures);
    }
}

/// Catalog ids are unique and `find` returns the spec for each id (and nothing for others).
#[test]
fn catalog_ids_are_unique_and_find_round_trips() {
    let specs = kernels::catalog();
    assert!(!specs.is_empty(), "the kernel catalog is empty");
    let mut seen = HashSet::new();
    let mut failures = Vec::new();
    for spec in &specs {
        let id = spec.id();
        if !seen.insert(id.clone()) {
            failures.push(format!("duplicate id `{id}`"));
        }
        let valid = !id.is_empty()
            && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !id.starts_with(|c: char| c.is_ascii_digit());
        if !valid {
            failures.push(format!("id `{id}` is not a valid PTX identifier"));
        }
        match kernels::find(&id) {
            Some(found) if found == *spec => {}
            Some(found) => failures.push(format!(
                "find({id:?}) returned {found:?}, expected {spec:?}"
            )),
            None => failures.push(format!("find({id:?}) returned None")),
        }
    }
    for bogus in ["", "attn_fwd", "no_such_kernel"] {
        if let Some(s) = kernels::find(bogus) {
            failures.push(format!("find({bogus:?}) returned {s:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "catalog problems:\n{}",
        failures.join("\n")
    );
}

/// A small hand-made kernel: `cp.async` a 512-byte tile into shared memory, `ldmatrix`
/// it, run one f16 and one bf16 `mma.sync` m16n8k16, store the accumulators.
fn harness_module() -> Module {
    let mut k = Kernel::new("flashcore_harness_mma_cp_async");
    k.max_threads(32);
    let src_p = k.param::<U64>("src");
    let dst_p = k.param::<U64>("dst");
    let src = k.load_param(src_p);
    let dst = k.load_param(dst_p);
    let mut plan = SmemPlan::new();
    let slot = plan.tile(SmemLayout::new(32, 8, 2, Swizzle::None), 1);
    let shared = k.shared_memory(&plan);
    let smem = shared.tile(&mut k, slot, 0);
    let lane = k.special(Special::TidX);

    // 32 lanes x 16 bytes: four 8x8 f16 matrices, one row per lane.
    let lane_off = k.mul_wide_u32(lane, 16u32);
    let gsrc = k.add(src, lane_off);
    let row_off = k.mul(lane, 16u32);
    let srow = k.smem_offset(smem, row_off);
    k.cp_async_16(srow, gsrc, 16u32);
    k.cp_async_commit();
    k.cp_async_wait(0);
    k.sync_threads();

    let a = k.ldmatrix_x4::<F16x2>(srow, false);
    let lane16 = k.and(lane, 15u32);
    let b_off = k.mul(lane16, 16u32);
    let b_row = k.smem_offset(smem, b_off);
    let b = k.ldmatrix_x2::<F16x2>(b_row, true);

    let acc: [_; 4] = std::array::from_fn(|_| k.mov::<F32>(0.0f32));
    k.mma_m16n8k16(&acc, &a, &b, &acc);
    let a_bf = a.map(|r| r.cast());
    let b_bf = b.map(|r| r.cast());
    k.mma_m16n8k16::<flashcore::ptx::Bf16x2>(&acc, &a_bf, &b_bf, &acc);

    let gdst = k.add(dst, lane_off);
    k.st_global_v4(gdst, 0, acc);

    let mut m = Module::new(Target::Sm80);
    m.push(k.finish().expect("the harness kernel builds"))
        .expect("the harness kernel fits sm_80");
    m
}

/// Permanent check of this harness and of the DSL's emission: a hand-made `mma.sync` +
/// `cp.async` module assembles for sm_80/89/90 with no spills and shows HMMA and LDGSTS.
#[test]
fn harness_assembles_a_dsl_module() {
    // The parser on a known sample (format of ptxas 12.x/13.x).
    let sample = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'k' for 'sm_80'\n\
        ptxas info    : Function properties for k\n    \
        8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
        ptxas info    : Used 168 registers, used 1 barriers, 32768 bytes smem, 400 bytes cmem[0]\n";
    assert_eq!(
        parse_ptxas_verbose(sample),
        vec![FnStats {
            name: "k".into(),
            registers: 168,
            stack_frame: 8,
            spill_stores: 4,
            spill_loads: 12,
            smem: 32768
        }]
    );
    assert_eq!(archs_for(Target::Sm80), ["sm_80", "sm_89", "sm_90"]);
    assert_eq!(archs_for(Target::Sm90a), ["sm_90a"]);

    let tools = tools();
    let m = harness_module();
    let id = "flashcore_harness_mma_cp_async".to_string();
    let mut dir = TempDir::new("assembly-harness");
    let job = Job {
        id: id.clone(),
        module: m,
        dyn_smem: Some(512),
        expect: &["HMMA", "LDGSTS"],
    };
    let (rows, mut failures) = assemble_all(&tools, &dir.path, &[job]);
    let archs: Vec<&str> = rows.iter().map(|r| r.arch.as_str()).collect();
    if archs != ["sm_80", "sm_89", "sm_90"] {
        failures.push(format!(
            "{id}: expected one report per sm_80/89/90, got {archs:?}"
        ));
    }
    if rows.iter().any(|r| r.stats.registers == 0) {
        failures.push(format!("{id}: a register count did not parse"));
    }
    if !failures.is_empty() {
        fail_with(&mut dir, "harness assembly", &failures);
    }
}

/// The checks are not vacuous: a kernel with neither `mma.sync` nor `cp.async` is reported
/// as missing HMMA and LDGSTS on every architecture.
#[test]
fn harness_flags_a_kernel_without_mma() {
    let tools = tools();
    let mut k = Kernel::new("flashcore_harness_no_mma");
    let dst_p = k.param::<U64>("dst");
    let dst = k.load_param(dst_p);
    let lane = k.special(Special::TidX);
    k.st_global(dst, 0, lane);
    let mut m = Module::new(Target::Sm80);
    m.push(k.finish().expect("the kernel builds"))
        .expect("fits sm_80");
    let dir = TempDir::new("assembly-negative");
    let job = Job {
        id: "flashcore_harness_no_mma".into(),
        module: m,
        dyn_smem: None,
        expect: &["HMMA", "LDGSTS"],
    };
    let (rows, failures) = assemble_all(&tools, &dir.path, &[job]);
    assert_eq!(rows.len(), 3, "one report per architecture: {failures:?}");
    for op in ["no HMMA", "no LDGSTS"] {
        let n = failures.iter().filter(|f| f.contains(op)).count();
        assert_eq!(n, 3, "expected `{op}` for sm_80/89/90, got {failures:?}");
    }
    assert_eq!(failures.len(), 6, "unexpected failures: {failures:?}");
}

/// A kernel that uses every Hopper instruction method of the DSL once: mbarriers and the
/// stage ring, TMA loads (plain and with an L2 hint), stores, bulk groups and the
/// descriptor prefetch, wgmma SS and RS for f16, bf16 and e4m3 with fences, commits and
/// waits, named barriers, elect.sync, setmaxnreg, stmatrix, prmt and the proxy fence.
fn hopper_harness_module() -> Module {
    use flashcore::ptx::*;
    let mut k = Kernel::new("flashcore_harness_hopper");
    k.max_threads(384).min_blocks_per_sm(1);
    let map = k.tensor_map_param("tmap");
    let out_p = k.param::<U64>("out");
    let out = k.load_param(out_p);
    let mut plan = SmemPlan::new();
    let l16 = SmemLayout::new(64, 64, 2, Swizzle::B128);
    let l8 = SmemLayout::new(64, 128, 1, Swizzle::B128);
    let t16 = plan.tile(l16, 2);
    let t8 = plan.tile(l8, 2);
    let ring = RingBarriers::plan(&mut plan, 2);
    let smem = k.shared_memory(&plan);
    let tid = k.special(Special::TidX);
    let first = k.setp(Cmp::Eq, tid, 0u32);
    k.if_(first, |k| ring.init(k, &smem, 1, 4));
    k.sync_threads();
    let wg = k.shr(tid, 7);
    let producer = k.setp(Cmp::Eq, wg, 0u32);
    let done = k.named_barrier(256);
    k.if_else(
        producer,
        |k| {
            k.setmaxnreg_dec(40);
            let leader = k.elect_one();
            let mut p = ring.producer(k, smem);
            k.if_(leader, |k| {
                k.tma_prefetch_desc(map);
                p.acquire(k);
                p.arrive_expect_tx(k, 2 * l16.bytes());
                let bar = p.full_barrier(k);
                let a = p.slot(k, t16);
                let (x, y) = (k.mov::<S32>(0i32), k.mov::<S32>(0i32));
                k.tma_load(a, map, [x, y], bar);
                let a64 = k.smem_offset(a, l16.bytes());
                k.tma_load_hint(a64, map, [x, y], bar, CachePolicy::EvictFirst);
            });
            p.advance(k);
        },
        |k| {
            k.setmaxnreg_inc(232);
            let c = ring.consumer(k, smem);
            c.wait_full(k);
            let a = c.slot(k, t16);
            let d = k.smem_desc::<KMajor>(a, &l16);
            let dt = k.smem_desc::<MnMajor>(a, &l16);
            let acc = k.acc::<N64>();
            let f = k.wgmma_ss::<F16x2, N64, KMajor, MnMajor>(acc, d, dt, ScaleD::Zero);
            k.wgmma_commit();
            k.wgmma_wait(0);
            let acc = k.wgmma_retire(f);
            let tiles = acc.tiles();
            let p: [Reg<Bf16x2>; 4] = std::array::from_fn(|i| {
                let t = tiles[i];
                k.pack_half2(t[0], t[1])
            });
            let f = k.wgmma_rs::<Bf16x2, N64, KMajor>(acc, &p, d, ScaleD::Accumulate);
            k.wgmma_commit();
            let a8 = smem.tile(k, t8, 0);
            let d8 = k.smem_desc::<KMajor>(a8, &l8);
            let acc8 = k.acc::<N32>();
            let f8 = k.wgmma_ss::<E4m3x4, N32, KMajor, KMajor>(acc8, d8, d8, ScaleD::Zero);
            k.wgmma_commit();
            k.wgmma_wait(0);
            let acc = k.wgmma_retire(f);
            let acc8 = k.wgmma_retire(f8);
            let q: [Reg<E4m3x4>; 4] = std::array::from_fn(|i| {
                let lo = k.pack_e4m3x2(acc8.regs()[i], acc8.regs()[i + 4]);
                let hi = k.pack_e4m3x2(acc8.regs()[i + 8], acc8.regs()[i + 12]);
                k.join_b16x2(lo, hi).cast()
            });
            let f8 = k.wgmma_rs::<E4m3x4, N32, KMajor>(acc8, &q, d8, ScaleD::Accumulate);
            k.wgmma_commit();
            k.wgmma_wait(0);
            let acc8 = k.wgmma_retire(f8);
            let lane_leader = k.elect_one();
            k.guarded(lane_leader, true, |k| c.release(k));
            let words: [Reg<F16x2>; 4] = std::array::from_fn(|i| {
                let t = acc.tiles()[i];
                k.pack_half2(t[0], t[1])
            });
            k.stmatrix_x4(a, words, false);
            k.stmatrix_x4(a, words, true);
            k.fence_proxy_async();
            k.bar_arrive(done);
            k.bar_wait(done);
            let (x, y) = (k.mov::<S32>(0i32), k.mov::<S32>(0i32));
            k.guarded(first, false, |k| k.tma_store(map, [x, y], a));
            k.bulk_commit_group();
            k.bulk_wait_group_read(0);
            k.bulk_wait_group(0);
            let mix = k.prmt(words[0].cast(), words[1].cast(), 0x5140);
            let sum = k.add(acc8.regs()[0], acc.regs()[1]);
            k.st_global(out, 0, mix);
            k.st_global(out, 4, sum);
        },
    );
    let mut m = Module::new(Target::Sm90a);
    m.push(k.finish().expect("the Hopper harness builds"))
        .expect("fits sm_90a");
    m
}

/// Every Hopper instruction the DSL emits is accepted by ptxas for sm_90a and lands in
/// the SASS as the hardware's own instructions (HGMMA, QGMMA, UTMALDG, UTMASTG, SYNCS,
/// STSM), without C7508/C7515.
#[test]
fn hopper_harness_assembles() {
    let tools = tools();
    let dir = TempDir::new("assembly-hopper");
    let job = Job {
        id: "flashcore_harness_hopper".into(),
        module: hopper_harness_module(),
        dyn_smem: None,
        expect: &[
            "HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "SYNCS", "STSM", "ELECT",
        ],
    };
    let (rows, failures) = assemble_all(&tools, &dir.path, &[job]);
    assert_eq!(rows.len(), 1, "{failures:?}");
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The Hopper checks are not vacuous: ptxas' C7508 (setmaxnreg ignored without launch
/// bounds; the DSL refuses such a kernel, so it is written by hand here) is reported.
#[test]
fn harness_flags_ignored_setmaxnreg() {
    let tools = tools();
    let dir = TempDir::new("assembly-c7508");
    let ptx = ".version 8.4\n.target sm_90a\n.address_size 64\n\n\
        .visible .entry flashcore_harness_c7508(.param .u64 out)\n{\n\
        .reg .b32 %r<2>;\n.reg .b64 %rd<1>;\n\
        ld.param.u64 %rd0, [out];\nsetmaxnreg.inc.sync.aligned.u32 240;\n\
        mov.u32 %r0, %tid.x;\nst.global.u32 [%rd0], %r0;\nret;\n}\n";
    let file = dir.path.join("c7508.ptx");
    std::fs::write(&file, ptx).unwrap();
    let a = assemble(&tools, &file, "sm_90a").expect("ptxas accepts it, with a warning");
    let errs = check("c7508", &a, &["flashcore_harness_c7508".into()], &[]);
    assert!(
        errs.iter().any(|e| e.contains("C7508")),
        "C7508 not reported: {errs:?}\n{}",
        a.log
    );
}

/// The move budget reads opcodes (not operands, not predicates) and fires on a loop that
/// re-pairs every fragment, as the sm80 forward once did.
#[test]
fn move_budget_counts_opcodes_and_flags_re_pairing() {
    let line = |op: &str| format!("        /*0690*/                   {op} ;\n");
    let sass = [
        "MOV R4, R36",
        "IMAD.MOV.U32 R6, RZ, RZ, R37",
        "@!P0 MOV R5, R38",
        "HMMA.16816.F32 R152, R80, R4, RZ",
        "LDSM.16.M88.4 R104, [R229+UR4+0x9800]",
        "FMUL R1, R2, R3",
        "UMOV UR4, 0x400",
    ]
    .map(line)
    .concat();
    assert_eq!(moves_and_hmma(&sass), (3, 1));

    let assembled = |moves: usize, hmma: usize| Assembled {
        arch: "sm_90".into(),
        fns: Vec::new(),
        sass: [
            line("MOV R4, R36").repeat(moves),
            line("HMMA.16816.F32 R1, R2, R4, RZ").repeat(hmma),
        ]
        .concat(),
        log: String::new(),
    };
    let flags = |a: &Assembled, expect: &[&str]| {
        check("k", a, &[], expect)
            .iter()
            .any(|e| e.contains("register moves"))
    };
    assert!(
        !flags(&assembled(64 + 128, 512), &["HMMA"]),
        "within budget"
    );
    assert!(flags(&assembled(64 + 129, 512), &["HMMA"]), "one move over");
    assert!(flags(&assembled(512, 512), &["HMMA"]), "one move per HMMA");
    // Only warp-MMA kernels have the budget (a wgmma kernel moves accumulators freely).
    assert!(!flags(&assembled(512, 512), &["HGMMA"]));
}

/// An `sm_NN:OP` expectation is checked on sm_NN's machine code and nowhere else.
#[test]
fn arch_qualified_expectations_apply_to_their_arch() {
    let line = |op: &str| format!("        /*0690*/                   {op} ;\n");
    let on = |arch: &str, sass: &str| Assembled {
        arch: arch.into(),
        fns: Vec::new(),
        sass: line(sass),
        log: String::new(),
    };
    let expect = ["sm_89:QMMA.16832.F32.E4M3", "sm_90:HMMA.16816.F32"];
    let qmma = "QMMA.16832.F32.E4M3.E4M3 R4, R8, R12, RZ";
    let hmma = "HMMA.16816.F32 R4, R8, R12, RZ";
    assert!(check("k", &on("sm_89", qmma), &[], &expect).is_empty());
    assert!(check("k", &on("sm_90", hmma), &[], &expect).is_empty());
    let errs = check("k", &on("sm_89", hmma), &[], &expect);
    assert!(
        errs.len() == 1 && errs[0].contains("no QMMA.16832.F32.E4M3"),
        "{errs:?}"
    );
    assert_eq!(check("k", &on("sm_90", qmma), &[], &expect).len(), 1);
}
