//! The PTX builder: golden snippets of emitted text, determinism, and the mistakes it
//! refuses to emit. (Type mistakes do not compile at all: see the `compile_fail` examples
//! in `src/ptx/mod.rs`.)

use flashcore::kernels::catalog;
use flashcore::ptx::*;

/// The lines of a kernel body between the register declarations and the final `ret`.
fn body(k: Kernel) -> Vec<String> {
    body_for(Target::Sm80, k)
}

/// [`body`] for an sm_90a module.
fn body_90a(k: Kernel) -> Vec<String> {
    body_for(Target::Sm90a, k)
}

/// The whole module text of `k` alone, declarations and parameters included.
fn module_text(target: Target, k: Kernel) -> String {
    let mut m = Module::new(target);
    m.push(k.finish().expect("a valid kernel")).unwrap();
    m.to_ptx()
}

/// Fails naming the first of `wants` that `text` does not contain.
fn assert_contains_all(text: &str, wants: &[&str]) {
    for want in wants {
        assert!(text.contains(want), "missing `{want}` in:\n{text}");
    }
}

fn body_for(target: Target, k: Kernel) -> Vec<String> {
    module_text(target, k)
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
    let q = k.not_pred(p);
    let _ = k.and_pred(p, q);
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
            "not.pred %p1, %p0;",
            "and.pred %p2, %p0, %p1;",
        ]
    );
}

/// `2^x` on the FMA pipe: clamp (NaN kept), split into floor and fraction by a
/// round-down add of 1.5 · 2^23, a cubic for `2^f`, and `2^j` built from `t`'s low bits
/// (`t · 2^23 + (127 << 23)`), multiplied in so that NaN stays NaN. Its values are
/// checked on the GPU (`tests/gpu_math.rs`).
#[test]
fn ex2_on_the_fma_pipe_golden() {
    let mut k = Kernel::new("ex2_fma");
    let x = k.mov::<F32>(-2.5f32);
    let _ = k.ex2_fma(x);
    assert_eq!(
        body(k),
        [
            "mov.f32 %f0, 0fC0200000;",
            "max.NaN.f32 %f2, %f0, 0fC2FE0000;",
            "add.rm.f32 %f3, %f2, 0f4B400000;",
            "sub.f32 %f4, %f3, 0f4B400000;",
            "sub.f32 %f5, %f2, %f4;",
            "fma.rn.f32 %f6, %f5, 0f3D9FCB56, 0f3E677E28;",
            "fma.rn.f32 %f6, %f6, %f5, 0f3F322225;",
            "fma.rn.f32 %f6, %f6, %f5, 0f3F7FFB1A;",
            "mov.b32 %r0, %f3;",
            "mad.lo.u32 %r1, %r0, 8388608, 1065353216;",
            "mov.b32 %f7, %r1;",
            "mul.rn.f32 %f1, %f6, %f7;",
        ]
    );
}

#[test]
fn tensor_core_and_async_copy_golden() {
    let mut k = Kernel::new("mma");
    let mut plan = SmemPlan::new();
    let slot = plan.tile(SmemLayout::new(16, 64, 2, Swizzle::B128), 1);
    let shared = k.shared_memory(&plan);
    let smem = shared.tile(&mut k, slot, 0);
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
    let mine = k.setp(Cmp::Gt, acc[0], 0f32);
    let all = k.vote_all(mine);
    let _ = k.vote_any(all);
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
    assert!(lines.contains(&"vote.sync.all.pred %p1, %p0, 0xffffffff;".to_string()));
    assert!(lines.contains(&"vote.sync.any.pred %p2, %p1, 0xffffffff;".to_string()));
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
fn refuses_comments_ptxas_cannot_read() {
    let mut k = Kernel::new("commented");
    k.comment("scores scaled by log2(e)");
    assert!(k.finish().is_ok());
    let mut k = Kernel::new("commented");
    k.comment("O = \u{3a3} w_i O_i");
    assert!(matches!(rejected(k), PtxError::BadOperand(_)));
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
    assert!(text.needs.contains(Feature::Fp8));
    let err = Module::new(Target::Sm80)
        .push(text.clone())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(
            err,
            PtxError::MissingFeature {
                feature: Feature::Fp8,
                target: Target::Sm80,
                ..
            }
        ),
        "{err}"
    );
    assert!(Module::new(Target::Sm89).push(text).is_ok());
}

#[test]
fn advance_stage_wraps_the_index_in_place() {
    let mut k = Kernel::new("ring");
    let stage = k.mov::<U32>(0u32);
    let _wrapped = k.advance_stage(stage, 3);
    assert_eq!(
        body_for(Target::Sm80, k),
        [
            "mov.u32 %r0, 0;",
            "add.u32 %r1, %r0, 1;",
            "setp.eq.u32 %p0, %r1, 3;",
            "selp.b32 %r0, 0, %r1, %p0;",
        ]
    );
}

#[test]
fn gpu_scope_fences_around_a_ticket_on_every_target() {
    // The last-block pattern: publish, take a ticket, then read what others published.
    for target in [Target::Sm80, Target::Sm89, Target::Sm90] {
        let mut k = Kernel::new("ticket");
        let counter = k.mov::<U64>(64u64);
        k.fence_acq_rel_gpu();
        let ticket = k.atom_global_add_u32(counter, 0, 1u32);
        k.fence_acq_rel_gpu();
        assert_eq!(
            body_for(target, k),
            [
                "mov.u64 %rd0, 64;",
                "fence.acq_rel.gpu;",
                &format!("atom.global.add.u32 {}, [%rd0], 1;", ticket.name()),
                "fence.acq_rel.gpu;",
            ]
        );
    }
}

#[test]
fn grid_dependency_wait_and_loads_into_live_registers() {
    let mut k = Kernel::new("pdl");
    k.grid_dependency_wait();
    let table = k.mov::<U64>(64u64);
    let entry = k.mov::<U32>(0u32);
    k.ld_global_into(entry, table, 4);
    let text = k.finish().unwrap();
    // griddepcontrol is sm_90's: an sm_80 or sm_89 module refuses it.
    assert!(text.needs.contains(Feature::Hopper));
    for target in [Target::Sm80, Target::Sm89] {
        assert!(matches!(
            Module::new(target).push(text.clone()),
            Err(PtxError::MissingFeature {
                feature: Feature::Hopper,
                ..
            })
        ));
    }
    let mut k = Kernel::new("pdl");
    k.grid_dependency_wait();
    let table = k.mov::<U64>(64u64);
    let entry = k.mov::<U32>(0u32);
    k.ld_global_into(entry, table, 4);
    assert_eq!(
        body_for(Target::Sm90, k),
        [
            "griddepcontrol.wait;",
            "mov.u64 %rd0, 64;",
            "mov.u32 %r0, 0;",
            "ld.global.b32 %r0, [%rd0+4];",
        ]
    );
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
fn swizzled_rows_hit_distinct_bank_groups() {
    let swizzle = |off: u32| Swizzle::B128.apply(off);
    // The 8 rows an ldmatrix reads at one logical column land in 8 distinct bank groups.
    for col in 0..8u32 {
        let groups: std::collections::BTreeSet<u32> = (0..8u32)
            .map(|row| (swizzle(row * 128 + col * 16) % 128) / 16)
            .collect();
        assert_eq!(groups.len(), 8);
    }
}

// ---- Hopper building blocks ------------------------------------------------------------

/// A kernel with one 64x64 bf16 tile and a 2-stage ring, barriers initialised and fenced.
fn hopper_kernel(name: &str) -> (Kernel, Smem, TileSlot, RingBarriers) {
    let mut k = Kernel::new(name);
    k.max_threads(384).min_blocks_per_sm(1);
    let mut plan = SmemPlan::new();
    let tile = plan.tile(SmemLayout::new(64, 64, 2, Swizzle::B128), 2);
    let ring = RingBarriers::plan(&mut plan, 2);
    let smem = k.shared_memory(&plan);
    ring.init(&mut k, &smem, 1, 256);
    k.sync_threads();
    (k, smem, tile, ring)
}

#[test]
fn mbarrier_and_stage_ring_golden() {
    let (mut k, smem, tile, ring) = hopper_kernel("ring");
    let mut producer = ring.producer(&mut k, smem);
    producer.acquire(&mut k);
    producer.arrive_expect_tx(&mut k, 16384);
    let _ = producer.slot(&mut k, tile);
    producer.advance(&mut k);
    let consumer = ring.consumer(&mut k, smem);
    consumer.wait_full(&mut k);
    consumer.release(&mut k);
    let lines = body_90a(k);
    let text = lines.join("\n");
    assert_contains_all(
        &text,
        &[
            "mbarrier.init.shared::cta.b64 [%r1], 1;",
            "mbarrier.init.shared::cta.b64 [%r2], 256;",
            "fence.mbarrier_init.release.cluster;",
            "bar.sync 0;",
            "mbarrier.try_wait.parity.shared::cta.b64 %p0, [%r",
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r",
            "], 16384;",
            "mbarrier.arrive.shared::cta.b64 _, [%r",
        ],
    );
    // The producer's phase starts at 1, the consumer's at 0; both waits use it.
    assert!(lines.contains(&"mov.u32 %r6, 1;".to_string()), "{text}");
    let waits: Vec<&String> = lines.iter().filter(|l| l.contains("try_wait")).collect();
    assert_eq!(waits.len(), 2);
    assert!(waits[0].ends_with(", %r6;"), "{}", waits[0]);
    // advance: the index wraps at 2 and the phase flips only then.
    assert!(text.contains("setp.eq.u32"), "{text}");
    assert!(text.contains("xor.b32"), "{text}");
}

/// `StageRing::fill` is the producer's whole turn at a stage, in order: wait for the
/// consumers' release, announce the bytes, the copies onto the stage's FULL barrier,
/// then the next stage (the same PTX as those four steps written out).
#[test]
fn stage_ring_fill_is_acquire_expect_copy_advance() {
    let kernel = |by_fill: bool| {
        let (mut k, smem, tile, ring) = hopper_kernel("fill");
        let map = k.tensor_map_param("tmap_a");
        let mut producer = ring.producer(&mut k, smem);
        let copy = |k: &mut Kernel, ring: &StageRing, full: Mbarrier| {
            let at = ring.slot(k, tile);
            let x = k.mov::<S32>(64i32);
            k.tma_load(at, map, [x, x], full);
        };
        for _ in 0..3 {
            if by_fill {
                producer.fill(&mut k, 8192, copy);
            } else {
                producer.acquire(&mut k);
                producer.arrive_expect_tx(&mut k, 8192);
                let full = producer.full_barrier(&mut k);
                copy(&mut k, &producer, full);
                producer.advance(&mut k);
            }
        }
        body_90a(k)
    };
    let (filled, spelled_out) = (kernel(true), kernel(false));
    assert_eq!(filled, spelled_out);
    let text = filled.join("\n");
    let at = |what: &str| {
        text.find(what)
            .unwrap_or_else(|| panic!("no {what}: {text}"))
    };
    assert!(at("try_wait") < at("expect_tx"), "{text}");
    assert!(at("expect_tx") < at("cp.async.bulk.tensor"), "{text}");
    assert!(at("cp.async.bulk.tensor") < at("xor.b32"), "{text}");
    assert_eq!(text.matches("cp.async.bulk.tensor").count(), 3, "{text}");
}

#[test]
fn plain_full_arrivals_and_global_tickets() {
    let (mut k, smem, _, ring) = hopper_kernel("tickets");
    let counter = k.param::<U64>("counter");
    let counter = k.load_param(counter);
    let ticket = k.atom_global_add_u32(counter, 4, 1u32);
    // Moving the counter past tickets no one needs: no result register.
    k.red_global_max_u32(counter, 4, ticket);
    let producer = ring.producer(&mut k, smem);
    producer.arrive_full(&mut k);
    let lines = body_90a(k);
    let text = lines.join("\n");
    let atom = format!("atom.global.add.u32 {}, [%rd", ticket.name());
    assert!(text.contains(&atom) && text.contains("+4], 1;"), "{text}");
    let red = format!("+4], {};", ticket.name());
    assert!(
        text.lines()
            .any(|l| l.contains("red.global.max.u32 [%rd") && l.ends_with(&red)),
        "{text}"
    );
    // A FULL arrival without copies announces no bytes.
    assert_eq!(
        text.matches("mbarrier.arrive.shared::cta.b64 _, [%r")
            .count(),
        1
    );
    assert!(!text.contains("expect_tx"), "{text}");
}

#[test]
fn tma_golden() {
    let (mut k, smem, tile, ring) = hopper_kernel("tma");
    let map = k.tensor_map_param("tmap_a");
    let ring_p = ring.producer(&mut k, smem);
    let bar = ring_p.full_barrier(&mut k);
    let dst = smem.tile(&mut k, tile, 1);
    let x = k.mov::<S32>(64i32);
    let y = k.mov::<S32>(0i32);
    k.tma_load(dst, map, [x, y], bar);
    k.tma_load_hint(dst, map, [x, y], bar, CachePolicy::EvictLast);
    k.fence_proxy_async();
    k.tma_store(map, [x, y], dst);
    k.bulk_commit_group();
    k.bulk_wait_group_read(0);
    k.tma_prefetch_desc(map);
    assert_contains_all(
        &module_text(Target::Sm90a, k),
        &[
            ".param .align 64 .b8 tmap_a[128]",
            "mov.b64 %rd0, tmap_a;",
            "cvta.param.u64 %rd0, %rd0;",
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r",
            "], [%rd0, {%r",
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%r",
            "mov.b64 %rd1, 0x14f0000000000000;",
            "fence.proxy.async.shared::cta;",
            "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd0, {%r",
            "cp.async.bulk.commit_group;",
            "cp.async.bulk.wait_group.read 0;",
            "prefetch.tensormap [%rd0];",
        ],
    );
}

#[test]
fn bulk_load_golden_and_refusals() {
    let (mut k, smem, tile, ring) = hopper_kernel("bulk");
    let src = k.param::<U64>("src");
    let src = k.load_param(src);
    let bar = ring.producer(&mut k, smem).full_barrier(&mut k);
    let dst = smem.tile(&mut k, tile, 0);
    k.bulk_load(dst, src, 512, bar);
    let text = module_text(Target::Sm90a, k);
    assert_contains_all(
        &text,
        &[
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r",
            "], [%rd",
            "], 512, [%r",
        ],
    );
    // Sizes the copy engine cannot move are refused when the kernel is finished.
    for bytes in [0, 24] {
        let (mut k, smem, tile, ring) = hopper_kernel("bulk_bad");
        let src = k.param::<U64>("src");
        let src = k.load_param(src);
        let bar = ring.producer(&mut k, smem).full_barrier(&mut k);
        let dst = smem.tile(&mut k, tile, 0);
        k.bulk_load(dst, src, bytes, bar);
        let err = k.finish().unwrap_err();
        assert!(err.to_string().contains("multiple of 16"), "{bytes}: {err}");
    }
}

#[test]
fn a_tensor_map_taken_again_where_it_is_used() {
    let (mut k, smem, tile, _) = hopper_kernel("tma_here");
    let _first = k.tensor_map_param("tmap_a");
    let map = k.tensor_map_param("tmap_b");
    let src = smem.tile(&mut k, tile, 0);
    let x = k.mov::<S32>(0i32);
    let here = k.tensor_map_here(map);
    k.tma_store(here, [x, x], src);
    // The parameter's address is taken at the start and again, into a new register,
    // for the store, which reads only the new one.
    assert_contains_all(
        &module_text(Target::Sm90a, k),
        &[
            "mov.b64 %rd1, tmap_b;",
            "mov.b64 %rd2, tmap_b;",
            "cvta.param.u64 %rd2, %rd2;",
            "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd2, {%r",
        ],
    );
}

#[test]
fn wgmma_golden() {
    let (mut k, smem, tile, _) = hopper_kernel("mma90");
    let layout = tile.layout;
    let a_at = smem.tile(&mut k, tile, 0);
    let b_at = smem.tile(&mut k, tile, 1);
    let a = k.smem_desc::<KMajor>(a_at, &layout);
    let b = k.smem_desc::<MnMajor>(b_at, &layout);
    let acc = k.acc::<N64>();
    let f = k.wgmma_ss::<Bf16x2, N64, KMajor, MnMajor>(acc, a, b, ScaleD::Zero);
    let a2 = k.desc_advance(a, 32);
    let f = k.wgmma_ss::<Bf16x2, N64, KMajor, MnMajor>(f, a2, b, ScaleD::Accumulate);
    k.wgmma_commit();
    k.wgmma_wait(0);
    let acc = k.wgmma_retire(f);
    assert_eq!(acc.regs().len(), 32);
    assert_eq!(acc.tiles().len(), 8);
    let p: [Reg<Bf16x2>; 4] = std::array::from_fn(|i| {
        let t = acc.tiles()[i];
        k.pack_half2(t[0], t[1])
    });
    let f = k.wgmma_rs::<Bf16x2, N64, MnMajor>(acc, &p, b, ScaleD::Accumulate);
    k.wgmma_commit();
    k.wgmma_wait(0);
    let _ = k.wgmma_retire(f);
    let lines = body_90a(k);
    let text = lines.join("\n");
    // Descriptor: start address >> 4 in 14 bits, OR'ed with LBO/SBO/swizzle.
    // K-major SW128: LBO 16 (1), SBO 1024 (64), layout 1.
    assert!(
        text.contains("or.b64 %rd1, %rd0, 0x4000004000010000;"),
        "{text}"
    );
    // MN-major: LBO = one column block (64 rows x 128 B = 8192 -> 512), SBO 1024.
    assert!(text.contains("0x4000004002000000;"), "{text}");
    let fences = lines
        .iter()
        .filter(|l| *l == "wgmma.fence.sync.aligned;")
        .count();
    assert_eq!(
        fences, 2,
        "a fence before each group that starts from a readable Acc"
    );
    let ss: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("wgmma.mma_async"))
        .collect();
    assert_eq!(ss.len(), 3);
    assert!(ss[0].starts_with("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f0, %f1,"));
    assert!(ss[0].ends_with(", %rd1, %rd3, 0, 1, 1, 0, 1;"), "{}", ss[0]);
    assert!(ss[1].ends_with(", 1, 1, 1, 0, 1;"), "{}", ss[1]);
    assert!(ss[2].contains("f31}, {%r"), "{}", ss[2]);
    assert!(ss[2].ends_with(", %rd3, 1, 1, 1, 1;"), "{}", ss[2]);
    assert!(
        text.contains("add.u64 %rd4, %rd1, 2;"),
        "advancing 32 bytes adds 2: {text}"
    );
    assert!(lines.contains(&"wgmma.commit_group.sync.aligned;".to_string()));
    assert!(lines.contains(&"wgmma.wait_group.sync.aligned 0;".to_string()));
}

#[test]
fn fp8_wgmma_has_no_transpose_bits() {
    let mut k = Kernel::new("fp8mma");
    let mut plan = SmemPlan::new();
    let layout = SmemLayout::new(64, 128, 1, Swizzle::B128);
    let slot = plan.tile(layout, 1);
    let smem = k.shared_memory(&plan);
    let at = smem.tile(&mut k, slot, 0);
    let d = k.smem_desc::<KMajor>(at, &layout);
    let acc = k.acc::<N128>();
    let f = k.wgmma_ss::<E4m3x4, N128, KMajor, KMajor>(acc, d, d, ScaleD::Zero);
    k.wgmma_commit();
    k.wgmma_wait(0);
    let acc = k.wgmma_retire(f);
    let a: [Reg<E4m3x4>; 4] = std::array::from_fn(|_| k.mov::<B32>(0u32).cast());
    let f = k.wgmma_rs::<E4m3x4, N128, KMajor>(acc, &a, d, ScaleD::Accumulate);
    k.wgmma_commit();
    k.wgmma_wait(0);
    let _ = k.wgmma_retire(f);
    let text = body_90a(k).join("\n");
    assert!(text.contains("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"));
    assert!(text.contains(", %rd1, %rd1, 0, 1, 1;"), "{text}");
    assert!(
        text.contains(", %rd1, 1, 1, 1;") || text.contains("}, %rd1, 1, 1;"),
        "{text}"
    );
}

#[test]
fn warp_specialization_golden() {
    let mut k = Kernel::new("roles");
    k.max_threads(384).min_blocks_per_sm(1);
    let consumers = k.named_barrier(256);
    let other = k.named_barrier(256);
    assert_eq!(
        (consumers.id(), other.id(), consumers.threads()),
        (1, 2, 256)
    );
    k.setmaxnreg_dec(40);
    k.setmaxnreg_inc(232);
    k.bar_arrive(consumers);
    k.bar_wait(other);
    let leader = k.elect_one();
    let a = k.mov::<B32>(0x0403_0201u32);
    let b = k.mov::<B32>(0x0807_0605u32);
    let _ = k.prmt(a, b, 0x6420);
    let mut plan = SmemPlan::new();
    let slot = plan.tile(SmemLayout::new(16, 64, 2, Swizzle::B128), 1);
    let smem = k.shared_memory(&plan);
    let at = smem.tile(&mut k, slot, 0);
    let v: [Reg<F16x2>; 4] = std::array::from_fn(|_| k.mov::<B32>(0u32).cast());
    k.guarded(leader, true, |k| k.stmatrix_x4(at, v, false));
    k.stmatrix_x4(at, v, true);
    let lines = body_90a(k);
    for want in [
        "setmaxnreg.dec.sync.aligned.u32 40;",
        "setmaxnreg.inc.sync.aligned.u32 232;",
        "bar.arrive 1, 256;",
        "bar.sync 2, 256;",
        "elect.sync _|%p0, 0xffffffff;",
        "prmt.b32 %r2, %r0, %r1, 0x6420;",
        "@%p0 stmatrix.sync.aligned.x4.m8n8.shared.b16 [%r3], {%r4, %r5, %r6, %r7};",
        "stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%r3], {%r4, %r5, %r6, %r7};",
    ] {
        assert!(
            lines.contains(&want.to_string()),
            "missing `{want}` in {lines:#?}"
        );
    }
}

#[test]
fn refuses_setmaxnreg_without_launch_bounds() {
    let mut k = Kernel::new("regs");
    k.max_threads(384);
    k.setmaxnreg_inc(240);
    assert!(matches!(rejected(k), PtxError::BadSync(_)));
    let mut k = Kernel::new("regs_range");
    k.max_threads(384).min_blocks_per_sm(1);
    k.setmaxnreg_inc(250);
    assert!(matches!(rejected(k), PtxError::BadOperand(_)));
}

#[test]
fn refuses_barriers_used_before_their_init_is_fenced() {
    let mut k = Kernel::new("early");
    let mut plan = SmemPlan::new();
    let bars = plan.mbarriers(1);
    let smem = k.shared_memory(&plan);
    let bar = smem.barrier(&mut k, bars, 0);
    k.mbarrier_init(bar, 1);
    k.mbarrier_arrive(bar);
    assert!(matches!(rejected(k), PtxError::BadSync(_)));

    let mut k = Kernel::new("unfenced");
    let mut plan = SmemPlan::new();
    let bars = plan.mbarriers(1);
    let smem = k.shared_memory(&plan);
    let bar = smem.barrier(&mut k, bars, 0);
    k.mbarrier_init(bar, 1);
    assert!(matches!(rejected(k), PtxError::BadSync(_)));
}

#[test]
fn refuses_accumulators_read_in_flight() {
    let (mut k, smem, tile, _) = hopper_kernel("inflight");
    let at = smem.tile(&mut k, tile, 0);
    let d = k.smem_desc::<KMajor>(at, &tile.layout);
    let acc = k.acc::<N64>();
    let f = k.wgmma_ss::<F16x2, N64, KMajor, KMajor>(acc, d, d, ScaleD::Zero);
    k.wgmma_commit();
    let _ = k.wgmma_retire(f); // no wait
    assert!(matches!(rejected(k), PtxError::BadSync(_)));

    // A wait that leaves the newest group in flight does not retire it either.
    let (mut k, smem, tile, _) = hopper_kernel("inflight2");
    let at = smem.tile(&mut k, tile, 0);
    let d = k.smem_desc::<KMajor>(at, &tile.layout);
    let acc = k.acc::<N64>();
    let f = k.wgmma_ss::<F16x2, N64, KMajor, KMajor>(acc, d, d, ScaleD::Zero);
    k.wgmma_commit();
    k.wgmma_wait(1);
    let _ = k.wgmma_retire(f);
    assert!(matches!(rejected(k), PtxError::BadSync(_)));
}

#[test]
fn refuses_wgmma_on_targets_without_it() {
    let (mut k, smem, tile, _) = hopper_kernel("no_wgmma");
    let at = smem.tile(&mut k, tile, 0);
    let d = k.smem_desc::<KMajor>(at, &tile.layout);
    let acc = k.acc::<N64>();
    let f = k.wgmma_ss::<F16x2, N64, KMajor, KMajor>(acc, d, d, ScaleD::Zero);
    k.wgmma_commit();
    k.wgmma_wait(0);
    let _ = k.wgmma_retire(f);
    let text = k.finish().unwrap();
    for target in [Target::Sm100a, Target::Sm90, Target::Sm80] {
        let err = Module::new(target)
            .push(text.clone())
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(err, PtxError::MissingFeature { .. }),
            "{target}: {err}"
        );
    }
    assert!(Module::new(Target::Sm90a).push(text).is_ok());
}

#[test]
fn refuses_named_barrier_exhaustion_and_bad_ring_slots() {
    let mut k = Kernel::new("bars");
    for _ in 0..15 {
        let _ = k.named_barrier(128);
    }
    let _ = k.named_barrier(128);
    assert!(matches!(rejected(k), PtxError::BadOperand(_)));

    let (mut k, smem, _, ring) = hopper_kernel("slots");
    let mut plan = SmemPlan::new();
    let three = plan.tile(SmemLayout::new(64, 64, 2, Swizzle::B128), 3);
    let p = ring.producer(&mut k, smem);
    let _ = p.slot(&mut k, three);
    assert!(matches!(rejected(k), PtxError::BadShared(_)));

    let (mut k, smem, tile, ring) = hopper_kernel("rank");
    let map = k.tensor_map_param("m");
    let p = ring.producer(&mut k, smem);
    let bar = p.full_barrier(&mut k);
    let dst = smem.tile(&mut k, tile, 0);
    let c = k.mov::<S32>(0i32);
    k.tma_load(dst, map, [c; 6], bar);
    assert!(matches!(rejected(k), PtxError::BadOperand(_)));
}

/// The producer's issuing thread: warp 0 by `tid >> 5`, then the lane `elect.sync` picks.
#[test]
fn elected_thread_of_warp_0_nests_warp_test_and_election() {
    let mut k = Kernel::new("golden_elected");
    let out_p = k.param::<U64>("out");
    let out = k.load_param(out_p);
    let tid = k.special(Special::TidX);
    k.elected_thread_of_warp_0(tid, |k| k.st_global(out, 0, tid));
    assert_eq!(
        body_90a(k),
        [
            "ld.param.u64 %rd0, [out];",
            "mov.u32 %r0, %tid.x;",
            "shr.u32 %r1, %r0, 5;",
            "setp.eq.u32 %p0, %r1, 0;",
            "@!%p0 bra $L_0;",
            "elect.sync _|%p1, 0xffffffff;",
            "@!%p1 bra $L_1;",
            "st.global.b32 [%rd0], %r0;",
            "$L_1:",
            "$L_0:",
        ]
    );
}
