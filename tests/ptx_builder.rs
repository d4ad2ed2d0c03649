//! The PTX builder: golden snippets of emitted text, determinism, and the mistakes it
//! refuses to emit. (Type mistakes do not compile at all: see the `compile_fail` examples
//! in `src/ptx/mod.rs`.)

use flashcore::kernels::catalog;
use flashcore::ptx::*;

/// The lines of a kernel body between the register declarations and the final `ret`.
fn body(k: Kernel) -> Vec<String> {
    let mut m = Module::new(Target::Sm80);
    m.push(k.finish().expect("a valid kernel")).unwrap();
    m.to_ptx()
        .lines()
        .skip_while(|l| *l != "{")
        .skip(1)
        .map(str::trim)
        .filter(|l| {
            !l.is_empty()
                && !l.starts_with(".reg")
                && !l.starts_with("//")
                && *l != "ret;"
                && *l != "}"
        })
        .map(String::from)
        .collect()
}

#[test]
fn module_header_and_entry() {
    let mut k = Kernel::new("golden");
    k.max_threads(128).min_blocks_per_sm(1);
    let p = k.param::<U64>("out");
    let out = k.load_param(p);
    let tid = k.special(Special::TidX);
    k.st_global(out, 4, tid);
    let mut m = Module::new(Target::Sm80);
    m.push(k.finish().unwrap()).unwrap();
    let want = "\
.version 8.4
.target sm_80
.address_size 64

.visible .entry golden(
    .param .u64 out
)
.maxntid 128, 1, 1
.minnctapersm 1
{
    .reg .b32 %r<1>;
    .reg .b64 %rd<1>;

    ld.param.u64 %rd0, [out];
    mov.u32 %r0, %tid.x;
    st.global.b32 [%rd0+4], %r0;
    ret;
}
";
    let ptx = m.to_ptx();
    assert!(ptx.ends_with(want), "got:\n{ptx}");
}

#[test]
fn arithmetic_golden() {
    let mut k = Kernel::new("arith");
    let a = k.mov::<F32>(1.5f32);
    let b = k.mov::<F32>(f32::NEG_INFINITY);
    let s = k.mad(a, b, 2.0f32);
    let e = k.ex2(s);
    let i = k.mov::<S32>(-3i32);
    let j = k.shr(i, 1);
    let p = k.setp(Cmp::Lt, j, 0i32);
    let _ = k.selp(e, 0f32, p);
    let w = k.mul_wide_u32(7u32, 9u32);
    let _ = k.add(w, 16u64);
    assert_eq!(
        body(k),
        [
            "mov.f32 %f0, 0f3FC00000;",
            "mov.f32 %f1, 0fFF800000;",
            "fma.rn.f32 %f2, %f0, %f1, 0f40000000;",
            "ex2.approx.ftz.f32 %f3, %f2;",
            "mov.s32 %r0, -3;",
            "shr.s32 %r1, %r0, 1;",
            "setp.lt.s32 %p0, %r1, 0;",
            "selp.f32 %f4, %f3, 0f00000000, %p0;",
            "mul.wide.u32 %rd0, 7, 9;",
            "add.u64 %rd1, %rd0, 16;",
        ]
    );
}

#[test]
fn tensor_core_and_async_copy_golden() {
    let mut k = Kernel::new("mma");
    let smem = k.dynamic_shared(1024);
    let src = k.mov::<U64>(0u64);
    k.cp_async_16(smem, src, 16u32);
    k.cp_async_commit();
    k.cp_async_wait(0);
    k.sync_threads();
    let a = k.ldmatrix_x4::<Bf16x2>(smem, false);
    let [b0, b1] = k.ldmatrix_x2::<Bf16x2>(smem, true);
    let acc: [Reg<F32>; 4] = std::array::from_fn(|_| k.mov(0f32));
    k.mma_m16n8k16(&acc, &a, &[b0, b1], &acc);
    let packed = k.pack_half2::<Bf16x2>(acc[0], acc[1]);
    let _ = k.shfl_bfly(packed, 2);
    let lines = body(k);
    let want = [
        "mov.u32 %r0, mma_smem;",
        "mov.u64 %rd0, 0;",
        "cp.async.cg.shared.global [%r0], [%rd0], 16, 16;",
        "cp.async.commit_group;",
        "cp.async.wait_group 0;",
        "bar.sync 0;",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r0];",
        "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%r5, %r6}, [%r0];",
    ];
    assert_eq!(&lines[..want.len()], want);
    assert!(lines.contains(&"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f0, %f1, %f2, %f3}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f0, %f1, %f2, %f3};".to_string()));
    // cvt takes the high half first: lo = acc[0] (%f0) must be the last operand.
    assert!(lines.contains(&"cvt.rn.bf16x2.f32 %r7, %f1, %f0;".to_string()));
    assert!(lines.contains(&"shfl.sync.bfly.b32 %r8, %r7, 2, 0x1f, 0xffffffff;".to_string()));
}

#[test]
fn structured_control_flow_golden() {
    let mut k = Kernel::new("flow");
    let n = k.mov::<S32>(4i32);
    let acc = k.mov::<S32>(0i32);
    k.for_range(0i32, n, 1, |k, i| k.add_to(acc, acc, i));
    let p = k.setp(Cmp::Gt, acc, 5i32);
    k.if_(p, |k| k.mov_to(acc, 5i32));
    k.guarded(p, false, |k| k.mov_to(acc, 0i32));
    assert_eq!(
        body(k),
        [
            "mov.s32 %r0, 4;",
            "mov.s32 %r1, 0;",
            "mov.s32 %r2, 0;",
            "$L_0:",
            "setp.ge.s32 %p0, %r2, %r0;",
            "@%p0 bra $L_1;",
            "add.s32 %r1, %r1, %r2;",
            "add.s32 %r2, %r2, 1;",
            "bra.uni $L_0;",
            "$L_1:",
            "setp.gt.s32 %p1, %r1, 5;",
            "@!%p1 bra $L_2;",
            "mov.s32 %r1, 5;",
            "$L_2:",
            "@!%p1 mov.s32 %r1, 0;",
        ]
    );
}

#[test]
fn generation_is_deterministic() {
    for spec in catalog() {
        let a = spec.generate().unwrap().to_ptx();
        let b = spec.generate().unwrap().to_ptx();
        assert_eq!(a, b, "{} differs between two generations", spec.id());
        assert!(a.contains(&format!(".visible .entry {}(", spec.id())));
    }
}

fn rejected(k: Kernel) -> PtxError {
    k.finish()
        .expect_err("the builder should refuse this kernel")
}

#[test]
fn refuses_a_label_placed_twice() {
    let mut k = Kernel::new("twice");
    let l = k.label();
    k.place(l);
    k.place(l);
    assert!(matches!(rejected(k), PtxError::BadControlFlow(_)));
}

#[test]
fn refuses_a_branch_to_a_label_never_placed() {
    let mut k = Kernel::new("dangling");
    let l = k.label();
    k.bra(l);
    assert!(matches!(rejected(k), PtxError::BadControlFlow(_)));
}

#[test]
fn refuses_nested_guards() {
    let mut k = Kernel::new("nested");
    let p = k.setp::<U32>(Cmp::Eq, 1u32, 1u32);
    k.guarded(p, true, |k| k.guarded(p, true, |k| k.sync_threads()));
    assert!(matches!(rejected(k), PtxError::BadControlFlow(_)));
}

#[test]
fn refuses_a_register_of_another_kernel() {
    let mut other = Kernel::new("other");
    let foreign = other.mov::<U32>(1u32);
    let mut k = Kernel::new("mine");
    let _ = k.add(foreign, 1u32);
    assert!(matches!(rejected(k), PtxError::ForeignRegister(_)));
}

#[test]
fn refuses_bad_identifiers() {
    assert!(matches!(
        rejected(Kernel::new("9lives")),
        PtxError::BadName(_)
    ));
    assert!(matches!(
        rejected(Kernel::new("has-dash")),
        PtxError::BadName(_)
    ));
}

#[test]
fn refuses_out_of_range_immediates() {
    let mut k = Kernel::new("lanes");
    let v = k.mov::<F32>(1f32);
    let _ = k.shfl_bfly(v, 32);
    assert!(matches!(rejected(k), PtxError::BadOperand(_)));

    let mut k = Kernel::new("barrier");
    k.bar_sync(16, None);
    assert!(matches!(rejected(k), PtxError::BadOperand(_)));

    let mut k = Kernel::new("barrier_count");
    k.bar_sync(1, Some(48));
    assert!(matches!(rejected(k), PtxError::BadOperand(_)));

    let mut k = Kernel::new("wait");
    k.cp_async_wait(8);
    assert!(matches!(rejected(k), PtxError::BadOperand(_)));
}

#[test]
fn refuses_struct_fields_out_of_bounds_or_misaligned() {
    let mut k = Kernel::new("fields");
    let args = k.param_bytes("args", 16, 8);
    let _ = k.load_param_at::<U64>(args, 12);
    assert!(matches!(rejected(k), PtxError::BadParam(_)));

    let mut k = Kernel::new("fields2");
    let args = k.param_bytes("args", 16, 8);
    let _ = k.load_param_at::<U32>(args, 6);
    assert!(matches!(rejected(k), PtxError::BadParam(_)));
}

#[test]
fn refuses_instructions_the_target_lacks() {
    let mut k = Kernel::new("fp8");
    let x = k.mov::<F32>(1f32);
    let _ = k.pack_e4m3x2(x, x);
    let text = k.finish().unwrap();
    assert_eq!(text.needs, Target::Sm89);
    let err = Module::new(Target::Sm80)
        .push(text.clone())
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, PtxError::TargetTooOld { .. }), "{err}");
    assert!(Module::new(Target::Sm89).push(text).is_ok());
}

#[test]
fn refuses_two_entries_with_one_name() {
    let mut m = Module::new(Target::Sm80);
    m.push(Kernel::new("same").finish().unwrap()).unwrap();
    let err = m
        .push(Kernel::new("same").finish().unwrap())
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, PtxError::BadName(_)));
}

#[test]
fn swizzle_is_a_permutation_of_each_1024_byte_atom() {
    use flashcore::kernels::attention::sm80::swizzle;
    for atom in 0..4u32 {
        let mut seen = [false; 64];
        for chunk in 0..64u32 {
            let off = atom * 1024 + chunk * 16;
            let s = swizzle(off);
            assert_eq!(s / 1024, atom, "stays in its atom");
            assert_eq!(s / 128, off / 128, "stays in its 128-byte line");
            seen[((s % 1024) / 16) as usize] = true;
        }
        assert!(seen.iter().all(|&x| x));
    }
    // The 8 rows an ldmatrix reads at one logical column land in 8 distinct bank groups.
    for col in 0..8u32 {
        let groups: std::collections::BTreeSet<u32> = (0..8u32)
            .map(|row| (swizzle(row * 128 + col * 16) % 128) / 16)
            .collect();
        assert_eq!(groups.len(), 8);
    }
}
