//! The kernel builder: registers, parameters, labels, structured control flow, emission.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::marker::PhantomData;

use super::error::PtxError;
use super::target::{Feature, Features};
use super::types::*;

/// A virtual register of PTX type `T`. Copy it freely: it is a name, not a value.
#[derive(Debug)]
pub struct Reg<T: PtxType> {
    index: u32,
    kernel: u32,
    _ty: PhantomData<T>,
}

impl<T: PtxType> Clone for Reg<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: PtxType> Copy for Reg<T> {}

impl<T: PtxType> Reg<T> {
    /// Its PTX name (`%r7`, `%f12`, ...).
    pub fn name(&self) -> String {
        format!("{}{}", T::CLASS.prefix(), self.index)
    }
    /// The same register seen as another type of its class (`u32` as `s32`, `f16x2` as `b32`).
    /// Only types sharing a register class convert, which the trait bound enforces.
    pub fn cast<U: SameClass<T>>(self) -> Reg<U> {
        Reg {
            index: self.index,
            kernel: self.kernel,
            _ty: PhantomData,
        }
    }
}

/// Marks two types that live in the same register class, so a [`Reg::cast`] between them
/// is a reinterpretation, never a conversion.
pub trait SameClass<T: PtxType>: PtxType {}
macro_rules! same_class {
    ($($a:ident),*) => { same_class!(@outer [$($a),*] [$($a),*]); };
    (@outer [$($a:ident),*] $all:tt) => { $( same_class!(@inner $a $all); )* };
    (@inner $a:ident [$($b:ident),*]) => { $( impl SameClass<$b> for $a {} )* };
}
same_class!(B32, U32, S32, F16x2, Bf16x2, E4m3x4);
same_class!(B64, U64, S64);

/// A source operand of type `T`: a register of that type or an immediate of the matching
/// Rust type (`u32` for `U32`, `f32` for `F32`, ...).
pub trait Src<T: PtxType> {
    /// How the operand is spelled in PTX.
    fn operand(&self) -> String;
    /// The kernel a register operand belongs to (immediates belong everywhere).
    fn owner(&self) -> Option<u32> {
        None
    }
}

impl<T: PtxType> Src<T> for Reg<T> {
    fn operand(&self) -> String {
        self.name()
    }
    fn owner(&self) -> Option<u32> {
        Some(self.kernel)
    }
}
impl<T: PtxType> Src<T> for &Reg<T> {
    fn operand(&self) -> String {
        self.name()
    }
    fn owner(&self) -> Option<u32> {
        Some(self.kernel)
    }
}
impl Src<U32> for u32 {
    fn operand(&self) -> String {
        self.to_string()
    }
}
impl Src<B32> for u32 {
    fn operand(&self) -> String {
        format!("{self:#x}")
    }
}
impl Src<S32> for i32 {
    fn operand(&self) -> String {
        self.to_string()
    }
}
impl Src<U64> for u64 {
    fn operand(&self) -> String {
        self.to_string()
    }
}
impl Src<S64> for i64 {
    fn operand(&self) -> String {
        self.to_string()
    }
}
impl Src<B64> for u64 {
    fn operand(&self) -> String {
        format!("{self:#x}")
    }
}
impl Src<F32> for f32 {
    /// Exact: PTX's `0f` hex form carries the bits, so no decimal rounding happens.
    fn operand(&self) -> String {
        format!("0f{:08X}", self.to_bits())
    }
}

/// A kernel parameter of type `T`, read with [`Kernel::load_param`].
#[derive(Debug, Clone, Copy)]
pub struct Param<T: PtxType> {
    index: usize,
    _ty: PhantomData<T>,
}

/// A by-value struct parameter (see [`Kernel::param_bytes`]).
#[derive(Debug, Clone, Copy)]
pub struct ParamBytes {
    index: usize,
    size: usize,
}

/// A branch target. Place it exactly once with [`Kernel::place`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Label(u32);

/// Special registers read with [`Kernel::special`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    TidX,
    TidY,
    NtidX,
    CtaidX,
    CtaidY,
    CtaidZ,
    NctaidX,
    NctaidY,
    LaneId,
}

impl Special {
    fn name(self) -> &'static str {
        match self {
            Special::TidX => "%tid.x",
            Special::TidY => "%tid.y",
            Special::NtidX => "%ntid.x",
            Special::CtaidX => "%ctaid.x",
            Special::CtaidY => "%ctaid.y",
            Special::CtaidZ => "%ctaid.z",
            Special::NctaidX => "%nctaid.x",
            Special::NctaidY => "%nctaid.y",
            Special::LaneId => "%laneid",
        }
    }
}

/// Integer and float comparisons for `setp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Cmp {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Cmp::Eq => "eq",
            Cmp::Ne => "ne",
            Cmp::Lt => "lt",
            Cmp::Le => "le",
            Cmp::Gt => "gt",
            Cmp::Ge => "ge",
        }
    }
}

#[derive(Debug, Clone)]
struct ParamDecl {
    name: String,
    decl: String,
}

static NEXT_KERNEL_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

/// Builds one `.entry`. Instructions are methods (one file per family under `ptx/`);
/// mistakes that types cannot catch are recorded and returned by [`Kernel::finish`].
#[derive(Debug)]
pub struct Kernel {
    id: u32,
    name: String,
    params: Vec<ParamDecl>,
    counts: BTreeMap<RegClass, u32>,
    body: Vec<String>,
    dynamic_smem: Option<(String, u32)>,
    max_ntid: Option<u32>,
    min_ctas_per_sm: Option<u32>,
    labels_made: u32,
    labels_placed: Vec<bool>,
    labels_used: Vec<bool>,
    guard: Option<String>,
    depth: usize,
    needs: Features,
    error: Option<PtxError>,
    /// What `finish` and the Hopper instruction methods check (see [`SyncState`]).
    pub(super) sync: SyncState,
}

/// Ordering rules the builder tracks in emission order, which is execution order for
/// the straight-line and loop-balanced code the generators write.
#[derive(Debug, Default)]
pub(super) struct SyncState {
    /// `mbarrier.init` emitted since the last `fence.mbarrier_init`.
    pub(super) unfenced_inits: bool,
    /// At least one `mbarrier.init` has been fenced.
    pub(super) fenced_any: bool,
    /// `setmaxnreg` used: `finish` requires `.maxntid` and `.minnctapersm`.
    pub(super) setmaxnreg: bool,
    /// wgmma commit groups closed so far.
    pub(super) wgmma_committed: u32,
    /// wgmma groups known complete (by a `wgmma.wait_group`).
    pub(super) wgmma_retired: u32,
    /// Named-barrier ids handed out (bit i = id i).
    pub(super) named_barriers: u16,
}

/// A finished kernel: the text of its `.entry` plus what the module needs around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelText {
    pub name: String,
    /// The instruction families the kernel uses; a module's target must have them all.
    pub needs: Features,
    pub(crate) module_decls: Vec<String>,
    pub(crate) entry: String,
}

impl Kernel {
    /// Starts a kernel named `name` (a PTX identifier).
    pub fn new(name: &str) -> Self {
        let mut k = Kernel {
            id: NEXT_KERNEL_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            name: name.to_string(),
            params: Vec::new(),
            counts: BTreeMap::new(),
            body: Vec::new(),
            dynamic_smem: None,
            max_ntid: None,
            min_ctas_per_sm: None,
            labels_made: 0,
            labels_placed: Vec::new(),
            labels_used: Vec::new(),
            guard: None,
            depth: 1,
            needs: Features::NONE,
            error: None,
            sync: SyncState::default(),
        };
        let valid = !name.is_empty()
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit());
        if !valid {
            k.fail(PtxError::BadName(name.to_string()));
        }
        k
    }

    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Records the first error; later instructions still build so the caller's code
    /// reads straight, and [`Kernel::finish`] reports it.
    pub(super) fn fail(&mut self, e: PtxError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    /// Notes that an instruction needs `feature`; [`super::Module::push`] checks it.
    pub(super) fn requires(&mut self, feature: Feature) {
        self.needs = self.needs.with(feature);
    }

    /// Checks that every register operand was made by this kernel.
    pub(super) fn check_owner(&mut self, owners: &[Option<u32>]) {
        if owners.iter().flatten().any(|&o| o != self.id) {
            self.fail(PtxError::ForeignRegister(self.name.clone()));
        }
    }

    /// `.maxntid n, 1, 1`: the block never has more than `n` threads.
    pub fn max_threads(&mut self, n: u32) -> &mut Self {
        self.max_ntid = Some(n);
        self
    }

    /// `.minnctapersm n`: ask ptxas to fit `n` blocks per SM.
    pub fn min_blocks_per_sm(&mut self, n: u32) -> &mut Self {
        self.min_ctas_per_sm = Some(n);
        self
    }

    // ---- registers ------------------------------------------------------------------

    /// A fresh virtual register.
    pub fn reg<T: PtxType>(&mut self) -> Reg<T> {
        let n = self.counts.entry(T::CLASS).or_insert(0);
        let index = *n;
        *n += 1;
        Reg {
            index,
            kernel: self.id,
            _ty: PhantomData,
        }
    }

    /// `N` fresh registers.
    pub fn regs<T: PtxType, const N: usize>(&mut self) -> [Reg<T>; N] {
        std::array::from_fn(|_| self.reg())
    }

    /// A register holding a copy of `src` (`mov`).
    pub fn mov<T: PtxType>(&mut self, src: impl Src<T>) -> Reg<T> {
        let d = self.reg();
        self.mov_to(d, src);
        d
    }

    /// `mov` into an existing register.
    pub fn mov_to<T: PtxType>(&mut self, dst: Reg<T>, src: impl Src<T>) {
        self.check_owner(&[dst.owner(), src.owner()]);
        self.emit(format!("mov.{} {}, {};", T::MOV, dst.name(), src.operand()));
    }

    /// Reads a special register (`%tid.x`, `%ctaid.y`, ...).
    pub fn special(&mut self, s: Special) -> Reg<U32> {
        let d = self.reg();
        self.emit(format!("mov.u32 {}, {};", d.name(), s.name()));
        d
    }

    // ---- parameters -----------------------------------------------------------------

    /// Declares a scalar parameter (`.param .u64 name`).
    pub fn param<T: PtxType>(&mut self, name: &str) -> Param<T> {
        if T::CLASS == RegClass::Pred {
            self.fail(PtxError::BadParam(format!(
                "{name}: predicates cannot be parameters"
            )));
        }
        self.params.push(ParamDecl {
            name: name.to_string(),
            decl: format!(".param .{} {name}", T::MOV),
        });
        Param {
            index: self.params.len() - 1,
            _ty: PhantomData,
        }
    }

    /// Loads a scalar parameter into a register (`ld.param`).
    pub fn load_param<T: PtxType>(&mut self, p: Param<T>) -> Reg<T> {
        let d = self.reg::<T>();
        let name = self.params[p.index].name.clone();
        self.emit(format!("ld.param.{} {}, [{name}];", T::MOV, d.name()));
        d
    }

    /// Declares a parameter of `size` raw bytes (`.param .align A .b8 name[size]`): a
    /// `#[repr(C)]` argument struct passed by value, read field by field with
    /// [`Kernel::load_param_at`].
    pub fn param_bytes(&mut self, name: &str, size: usize, align: usize) -> ParamBytes {
        if size == 0 || !align.is_power_of_two() {
            self.fail(PtxError::BadParam(format!(
                "{name}: {size} bytes aligned {align}"
            )));
        }
        self.params.push(ParamDecl {
            name: name.to_string(),
            decl: format!(".param .align {align} .b8 {name}[{size}]"),
        });
        ParamBytes {
            index: self.params.len() - 1,
            size,
        }
    }

    /// Loads the field at byte `offset` of a by-value struct parameter. The offset must
    /// be in bounds and aligned to the field's size.
    pub fn load_param_at<T: PtxType>(&mut self, p: ParamBytes, offset: usize) -> Reg<T> {
        let width = if T::CLASS == RegClass::B64 { 8 } else { 4 };
        if !offset.is_multiple_of(width) || offset + width > p.size || T::CLASS == RegClass::Pred {
            self.fail(PtxError::BadParam(format!(
                "field at byte {offset} of a {}-byte struct",
                p.size
            )));
        }
        let d = self.reg::<T>();
        let name = self.params[p.index].name.clone();
        self.emit(format!(
            "ld.param.{} {}, [{name}+{offset}];",
            T::MOV,
            d.name()
        ));
        d
    }

    // ---- parameters in place -------------------------------------------------------

    /// The generic address (`mov` + `cvta.param`) of a by-value parameter the kernel
    /// never copies to registers: how a `CUtensorMap` passed by value (a
    /// `__grid_constant__` parameter) is handed to TMA.
    pub(super) fn param_address(&mut self, p: ParamBytes) -> Reg<U64> {
        let pname = self.params[p.index].name.clone();
        let d = self.reg::<U64>();
        self.emit(format!("mov.b64 {}, {pname};", d.name()));
        self.emit(format!("cvta.param.u64 {0}, {0};", d.name()));
        d
    }

    // ---- shared memory --------------------------------------------------------------

    /// Declares the dynamic shared-memory buffer (size set at launch) and returns its
    /// 32-bit shared-window address. Called once, by [`super::smem::SmemPlan`]'s
    /// `Kernel::shared_memory`; kernels declare no static `.shared`, so the buffer starts
    /// at the window's (1024-byte aligned) base.
    pub(super) fn declare_dynamic_smem(&mut self, align: u32) -> Reg<U32> {
        if self.dynamic_smem.is_some() {
            self.fail(PtxError::BadShared(
                "dynamic shared memory declared twice".into(),
            ));
        }
        if !align.is_power_of_two() {
            self.fail(PtxError::BadShared(format!(
                "alignment {align} is not a power of two"
            )));
        }
        let sym = format!("{}_smem", self.name);
        self.dynamic_smem = Some((sym.clone(), align));
        let d = self.reg::<U32>();
        self.emit(format!("mov.u32 {}, {sym};", d.name()));
        d
    }

    // ---- emission -------------------------------------------------------------------

    /// Appends one instruction line (with the active guard, if any). Private to the
    /// builder: generators reach every instruction through a typed, checked method.
    pub(super) fn emit(&mut self, line: String) {
        let pad = "    ".repeat(self.depth);
        match &self.guard {
            Some(g) => self.body.push(format!("{pad}{g} {line}")),
            None => self.body.push(format!("{pad}{line}")),
        }
    }

    /// A comment line in the output (for readers of `flashcore ptx <id>`). ASCII only:
    /// ptxas refuses a module with any other character, comments included.
    pub fn comment(&mut self, text: &str) {
        if !text.is_ascii() {
            self.fail(PtxError::BadOperand(format!(
                "comment {text:?} is not ASCII (ptxas refuses the module)"
            )));
        }
        let pad = "    ".repeat(self.depth);
        for line in text.lines() {
            self.body.push(format!("{pad}// {line}"));
        }
    }

    // ---- labels and control flow ---------------------------------------------------

    /// A new label, not yet placed.
    pub fn label(&mut self) -> Label {
        self.labels_made += 1;
        self.labels_placed.push(false);
        self.labels_used.push(false);
        Label(self.labels_made - 1)
    }

    fn label_name(&self, l: Label) -> String {
        format!("$L_{}", l.0)
    }

    /// Places `l` here. Placing a label twice is an error.
    pub fn place(&mut self, l: Label) {
        if self.guard.is_some() {
            self.fail(PtxError::BadControlFlow(
                "label placed inside a guarded region".into(),
            ));
        }
        match self.labels_placed.get_mut(l.0 as usize) {
            Some(p) if !*p => *p = true,
            _ => self.fail(PtxError::BadControlFlow(format!(
                "label {} placed twice",
                l.0
            ))),
        }
        let pad = "    ".repeat(self.depth.saturating_sub(1));
        let name = self.label_name(l);
        self.body.push(format!("{pad}{name}:"));
    }

    /// Unconditional branch (uniform across the warp: `bra.uni`).
    pub fn bra(&mut self, l: Label) {
        self.use_label(l);
        let name = self.label_name(l);
        self.emit(format!("bra.uni {name};"));
    }

    /// Branch to `l` when `p` is true (`when == true`) or false (`when == false`).
    pub fn bra_if(&mut self, p: Reg<Pred>, when: bool, l: Label) {
        self.use_label(l);
        self.check_owner(&[p.owner()]);
        let name = self.label_name(l);
        let bang = if when { "" } else { "!" };
        self.emit(format!("@{bang}{} bra {name};", p.name()));
    }

    fn use_label(&mut self, l: Label) {
        match self.labels_used.get_mut(l.0 as usize) {
            Some(u) => *u = true,
            None => self.fail(PtxError::BadControlFlow(format!("unknown label {}", l.0))),
        }
    }

    /// Runs `body` only where `p` is true (a forward branch around it).
    pub fn if_(&mut self, p: Reg<Pred>, body: impl FnOnce(&mut Self)) {
        let skip = self.label();
        self.bra_if(p, false, skip);
        self.depth += 1;
        body(self);
        self.depth -= 1;
        self.place(skip);
    }

    /// `if p { then } else { other }`.
    pub fn if_else(
        &mut self,
        p: Reg<Pred>,
        then: impl FnOnce(&mut Self),
        other: impl FnOnce(&mut Self),
    ) {
        let else_ = self.label();
        let end = self.label();
        self.bra_if(p, false, else_);
        self.depth += 1;
        then(self);
        self.bra(end);
        self.depth -= 1;
        self.place(else_);
        self.depth += 1;
        other(self);
        self.depth -= 1;
        self.place(end);
    }

    /// `for (i = start; i < end; i += step) body(i)` over signed 32-bit integers; the loop
    /// variable is a register the body must not write. Runs zero times when `start >= end`.
    pub fn for_range(
        &mut self,
        start: impl Src<S32>,
        end: impl Src<S32>,
        step: i32,
        body: impl FnOnce(&mut Self, Reg<S32>),
    ) {
        if step == 0 {
            self.fail(PtxError::BadControlFlow("for_range with step 0".into()));
        }
        let end_op = end.operand();
        self.check_owner(&[end.owner()]);
        let i = self.mov::<S32>(start);
        let (top, exit) = (self.label(), self.label());
        let cmp = if step > 0 { "ge" } else { "le" };
        let done = self.reg::<Pred>();
        self.place(top);
        self.emit(format!(
            "setp.{cmp}.s32 {}, {}, {end_op};",
            done.name(),
            i.name()
        ));
        self.bra_if(done, true, exit);
        self.depth += 1;
        body(self, i);
        self.emit(format!("add.s32 {0}, {0}, {step};", i.name()));
        self.bra(top);
        self.depth -= 1;
        self.place(exit);
    }

    /// [`Kernel::for_range`] whose body threads a value from one turn to the next: the
    /// type state of registers that live across the loop, an in-flight wgmma
    /// accumulator say. The body receives the value and returns it (the same registers)
    /// for the next turn; what the last turn returns comes back.
    pub fn for_range_carry<T>(
        &mut self,
        start: impl Src<S32>,
        end: impl Src<S32>,
        step: i32,
        carried: T,
        body: impl FnOnce(&mut Self, Reg<S32>, T) -> T,
    ) -> T {
        let mut slot = Some(carried);
        let mut out = None;
        self.for_range(start, end, step, |k, i| {
            let v = slot.take().expect("the loop body is emitted once");
            out = Some(body(k, i, v));
        });
        out.expect("the loop body is emitted once")
    }

    /// `for (i = start; i < end; i += stride) body(i)` with a run-time stride (a persistent
    /// kernel's grid size, say), which must be positive.
    pub fn for_stride(
        &mut self,
        start: impl Src<S32>,
        end: impl Src<S32>,
        stride: Reg<S32>,
        body: impl FnOnce(&mut Self, Reg<S32>),
    ) {
        let end_op = end.operand();
        self.check_owner(&[end.owner(), Src::<S32>::owner(&stride)]);
        let i = self.mov::<S32>(start);
        let (top, exit) = (self.label(), self.label());
        let done = self.reg::<Pred>();
        self.place(top);
        self.emit(format!(
            "setp.ge.s32 {}, {}, {end_op};",
            done.name(),
            i.name()
        ));
        self.bra_if(done, true, exit);
        self.depth += 1;
        body(self, i);
        self.emit(format!("add.s32 {0}, {0}, {1};", i.name(), stride.name()));
        self.bra(top);
        self.depth -= 1;
        self.place(exit);
    }

    /// `for item in (blockIdx.x..count).step_by(gridDim.x) { body(item) }`: a persistent
    /// grid's walk over its work items.
    pub fn for_grid_stride(
        &mut self,
        count: impl Src<S32>,
        body: impl FnOnce(&mut Self, Reg<S32>),
    ) {
        let first = self.special(Special::CtaidX);
        let stride = self.special(Special::NctaidX);
        self.for_stride(first.cast::<S32>(), count, stride.cast(), body);
    }

    /// Runs `body` while `cond` (emitted at the top of each turn) gives true.
    pub fn while_(
        &mut self,
        cond: impl FnOnce(&mut Self) -> Reg<Pred>,
        body: impl FnOnce(&mut Self),
    ) {
        let (top, exit) = (self.label(), self.label());
        self.place(top);
        let go = cond(self);
        self.bra_if(go, false, exit);
        self.depth += 1;
        body(self);
        self.bra(top);
        self.depth -= 1;
        self.place(exit);
    }

    /// Predicates every instruction `body` emits with `@p` (or `@!p` when `when` is false).
    /// No branches or labels inside; no nesting.
    pub fn guarded(&mut self, p: Reg<Pred>, when: bool, body: impl FnOnce(&mut Self)) {
        if self.guard.is_some() {
            self.fail(PtxError::BadControlFlow("nested guarded regions".into()));
        }
        self.check_owner(&[p.owner()]);
        let bang = if when { "" } else { "!" };
        self.guard = Some(format!("@{bang}{}", p.name()));
        body(self);
        self.guard = None;
    }

    /// `ret;`
    pub fn ret(&mut self) {
        self.emit("ret;".to_string());
    }

    // ---- finishing ------------------------------------------------------------------

    /// Checks the kernel and renders it. Any recorded mistake is returned here.
    pub fn finish(mut self) -> Result<KernelText, PtxError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if self.sync.setmaxnreg && (self.max_ntid.is_none() || self.min_ctas_per_sm.is_none()) {
            // Without a register count at entry ptxas ignores setmaxnreg (warning C7508),
            // and the warpgroups' register budgets silently do not happen.
            return Err(PtxError::BadSync(
                "setmaxnreg needs .maxntid and .minnctapersm (max_threads, min_blocks_per_sm)"
                    .into(),
            ));
        }
        if self.sync.unfenced_inits {
            return Err(PtxError::BadSync(
                "mbarrier.init never followed by fence.mbarrier_init".into(),
            ));
        }
        for (i, (&placed, &used)) in self.labels_placed.iter().zip(&self.labels_used).enumerate() {
            if used && !placed {
                return Err(PtxError::BadControlFlow(format!(
                    "label {i} used but never placed"
                )));
            }
        }
        let mut module_decls = Vec::new();
        if let Some((sym, align)) = &self.dynamic_smem {
            module_decls.push(format!(".extern .shared .align {align} .b8 {sym}[];"));
        }
        let mut s = String::new();
        let params: Vec<String> = self
            .params
            .iter()
            .map(|p| format!("    {}", p.decl))
            .collect();
        let _ = writeln!(s, ".visible .entry {}(", self.name);
        let _ = writeln!(s, "{}", params.join(",\n"));
        let _ = writeln!(s, ")");
        if let Some(n) = self.max_ntid {
            let _ = writeln!(s, ".maxntid {n}, 1, 1");
        }
        if let Some(n) = self.min_ctas_per_sm {
            let _ = writeln!(s, ".minnctapersm {n}");
        }
        let _ = writeln!(s, "{{");
        for class in RegClass::ALL {
            if let Some(&n) = self.counts.get(&class).filter(|&&n| n > 0) {
                let _ = writeln!(s, "    .reg {} {}<{n}>;", class.decl(), class.prefix());
            }
        }
        let _ = writeln!(s);
        for line in &self.body {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s, "    ret;");
        let _ = writeln!(s, "}}");
        Ok(KernelText {
            name: self.name,
            needs: self.needs,
            module_decls,
            entry: s,
        })
    }
}
