use super::*;

fn config(head_dim: u32, dtype: HalfType, causal: bool) -> FwdConfig {
    FwdConfig {
        path: super::super::Path::Sm90,
        dtype,
        head_dim,
        causal,
        window: false,
        block_m: BLOCK_M,
        split_keys: false,
        fold_scale: true,
        padded: false,
        narrow_keys: false,
        softcap: false,
    }
}

/// The arrival count of every `mbarrier.init` in `ptx`.
fn mbarrier_counts(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter(|l| l.contains("mbarrier.init"))
        .filter_map(|l| l.trim().strip_suffix(';')?.rsplit(", ").next())
        .collect()
}

/// The one-consumer kernel: 256 threads, 64-row Q (and O) tiles, EMPTY barriers
/// counting its four warps, no ping-pong barriers; the two-consumer kernel keeps its
/// pair.
#[test]
fn one_consumer_kernel_takes_no_turns() {
    for d in HEAD_DIMS {
        for causal in [false, true] {
            let narrow = FwdConfig {
                block_m: 64,
                ..config(d, HalfType::F16, causal)
            };
            let s = Shape::of(&narrow);
            assert_eq!((s.consumers(), s.threads()), (1, 256));
            assert_eq!(s.q_layout().rows, 64);
            assert!(s.plan().0.bytes() <= MAX_SMEM, "d{d}");
            let t = narrow.tiling();
            assert_eq!((t.block_m, t.threads), (64, 256));
            let ptx = generate(&narrow).unwrap().to_ptx();
            assert!(ptx.contains(".maxntid 256, 1, 1"), "d{d}");
            assert!(!ptx.contains("bar.arrive"), "d{d}: a turn is passed");
            let counts = mbarrier_counts(&ptx);
            // FULL: the producer; EMPTY: 4 warps; the causal queue's EMPTY: 128 threads.
            let want: &[&str] = if causal {
                &["1", "4", "128"]
            } else {
                &["1", "4"]
            };
            assert!(counts.iter().all(|c| want.contains(c)), "d{d}: {counts:?}");
            let wide = generate(&config(d, HalfType::F16, causal))
                .unwrap()
                .to_ptx();
            assert!(wide.contains(".maxntid 384, 1, 1") && wide.contains("bar.arrive"));
        }
    }
}

/// O gets a staging tile of its own where one fits beside Q and the rings, else
/// (d = 256) it is staged in Q's; every plan fits the GPU.
/// The three-consumer kernel (head dim 64 only): 512 threads, 24 and 160 registers,
/// EMPTY barriers counting twelve warps, turns passed round a ring of three named
/// barriers that the last warpgroup opens at barrier 1 (the first of the ring); with
/// a causal mask, items from the counter that all 384 consumer threads wait for.
#[test]
fn three_consumers_pass_turns_round_a_ring() {
    assert!(has_tile(64, 192));
    assert!(!has_tile(128, 192) && !has_tile(256, 192));
    let cfg = FwdConfig {
        block_m: 192,
        ..config(64, HalfType::Bf16, false)
    };
    let s = Shape::of(&cfg);
    assert_eq!(
        (s.consumers(), s.threads(), s.registers()),
        (3, 512, (24, 160))
    );
    let (t, regs) = (cfg.tiling(), s.registers());
    assert_eq!((t.block_m, t.threads), (192, 512));
    assert!(128 * regs.0 + 384 * regs.1 <= 65536);
    let ptx = generate(&cfg).unwrap().to_ptx();
    assert!(ptx.contains(".maxntid 512, 1, 1"));
    assert!(ptx.contains("setmaxnreg.inc.sync.aligned.u32 160;"));
    let counts = mbarrier_counts(&ptx);
    assert!(counts.iter().all(|c| ["1", "12"].contains(c)), "{counts:?}");
    assert_eq!(ptx.matches("bar.arrive 1, 256;").count(), 1);
    assert!(ptx.contains("setp.eq.u32") && ptx.matches("bar.arrive %r").count() >= 2);
    let causal = FwdConfig {
        causal: true,
        ..cfg
    };
    let ptx = generate(&causal).unwrap().to_ptx();
    assert!(ptx.contains(".maxntid 512, 1, 1"));
    assert!(ptx.contains("atom.global.add.u32"), "items from a counter");
    assert!(
        mbarrier_counts(&ptx).contains(&"384"),
        "the consumers wait for their next item together"
    );
}

/// The split-keys kernel (head dim 64, 64-row tiles only): 384 threads on one 64-row
/// Q tile, a 4-stage K/V ring whose EMPTY barriers count one warpgroup's four warps
/// (each stage has one user) while Q's counts both's eight, turns taken round two
/// named barriers, and the partial result handed over through shared memory between
/// two more barriers of both warpgroups.
/// Head dim 64 runs a 4-stage K/V ring on every query tile, in shared memory;
/// the larger head dims keep two stages.
#[test]
fn head_dim_64_rings_have_four_stages() {
    for (d, block_ms, stages) in [
        (64, &[64, 128, 192][..], 4),
        (128, &[64, 128], 2),
        (256, &[64, 128], 2),
    ] {
        for &block_m in block_ms {
            for causal in [false, true] {
                let cfg = FwdConfig {
                    block_m,
                    ..config(d, HalfType::Bf16, causal)
                };
                let s = Shape::of(&cfg);
                let (plan, slots) = s.plan();
                assert_eq!(
                    (s.stages(), slots.k.copies, slots.v.copies),
                    (stages, stages, stages),
                    "{}",
                    cfg.id()
                );
                assert!(plan.bytes() <= MAX_SMEM, "{}", cfg.id());
            }
        }
    }
}

/// The folded kernels compute each score's exponent as one FMA where the unfolded
/// take a subtraction and a multiplication; nothing else in the key loop changes.
#[test]
fn folded_exponent_is_one_fma_per_score() {
    let count = |ptx: &str, op: &str| {
        ptx.lines()
            .filter(|l| l.trim_start().starts_with(op))
            .count()
    };
    for (d, block_m) in [(64, 192), (64, 64), (128, 128), (256, 128)] {
        for causal in [false, true] {
            let folded = FwdConfig {
                block_m,
                ..config(d, HalfType::Bf16, causal)
            };
            let unfolded = FwdConfig {
                fold_scale: false,
                ..folded
            };
            let [f, u] = [folded, unfolded].map(|c| generate(&c).unwrap().to_ptx());
            // The folded softmax sends one exponential in `fma_exp_every` to the FMA
            // pipe: one round-down add, two subtractions, three FMAs and a multiply
            // each, in place of one `ex2.approx`.
            let on_fma = count(&f, "add.rm.f32");
            let every = Shape::of(&folded).fma_exp_every();
            assert_eq!(on_fma > 0, every > 0, "{}", folded.id());
            assert_eq!(count(&f, "ex2.approx") + on_fma, count(&u, "ex2.approx"));
            let fmas = count(&f, "fma.rn.f32") - 3 * on_fma - count(&u, "fma.rn.f32");
            // At least a thread's scores (64 rows of `block_n` over 128 threads) of
            // two tiles: the first, and the loop's.
            let scores = Shape::of(&folded).block_n as usize / 2;
            assert!(fmas >= 2 * scores, "{}: {fmas}", folded.id());
            // The same number fewer subtractions and multiplications, give or take
            // the few per row that raise the maxima and form the LSE. A lagging
            // maximum ([`Shape::max_lag`]) adds a subtraction and a comparison per
            // raise: the step the tile's maximum takes, against the lag.
            let fewer = |op| count(&u, op) as i64 - count(&f, op) as i64;
            let lag_steps = -fewer("setp.le.f32");
            assert_eq!(lag_steps > 0, Shape::of(&folded).max_lag().is_some());
            for (op, per_fma_exp, per_lag_step) in [("sub.f32", 2, 1), ("mul.rn.f32", 1, 0)] {
                let fewer = fewer(op) + per_fma_exp * on_fma as i64 + per_lag_step * lag_steps;
                assert!((fewer - fmas as i64).abs() <= 8, "{op}: {fewer}");
            }
            assert!(folded.id().contains("_fold") && !unfolded.id().contains("_fold"));
        }
    }
}

#[test]
fn split_keys_share_one_query_tile_between_two_consumers() {
    assert!(has_split(64, 64));
    assert!(!has_split(64, 128) && !has_split(128, 64) && !has_split(256, 64));
    for causal in [false, true] {
        let cfg = FwdConfig {
            block_m: 64,
            split_keys: true,
            fold_scale: false,
            ..config(64, HalfType::F16, causal)
        };
        // The hand-over merges raw maxima: no folded split-keys kernel.
        assert!(
            generate(&FwdConfig {
                fold_scale: true,
                ..cfg
            })
            .is_err()
        );
        let s = Shape::of(&cfg);
        assert_eq!((s.consumers(), s.kv_consumers(), s.stages()), (2, 1, 4));
        assert_eq!(s.q_layout().rows, 64);
        let (plan, slots) = s.plan();
        assert!(plan.bytes() <= MAX_SMEM);
        assert_eq!((slots.k.copies, slots.v.copies), (4, 4));
        assert!(slots.exchange.is_some());
        assert_eq!(cfg.tiling().threads, 384);
        assert!(cfg.id().ends_with(if causal {
            "_m64_splitkv_causal"
        } else {
            "_m64_splitkv"
        }));
        let ptx = generate(&cfg).unwrap().to_ptx();
        assert!(ptx.contains(".maxntid 384, 1, 1"));
        let counts = mbarrier_counts(&ptx);
        let want: &[&str] = if causal {
            &["1", "4", "8", "256"]
        } else {
            &["1", "4", "8"]
        };
        assert!(counts.iter().all(|c| want.contains(c)), "{counts:?}");
        assert_eq!(counts.iter().filter(|&&c| c == "8").count(), 1, "Q's EMPTY");
        assert_eq!(
            counts.iter().filter(|&&c| c == "4").count(),
            8,
            "K and V EMPTY"
        );
        // Turns at barriers 1 and 2; the hand-over at 3 and 4.
        assert!(ptx.contains("bar.arrive 1, 256;"));
        assert!(ptx.contains("bar.sync 3, 256;") && ptx.contains("bar.sync 4, 256;"));
        // O's 8 vectors and the statistics, out and back.
        assert_eq!(ptx.matches("st.shared.v4.f32").count(), 9);
        assert_eq!(ptx.matches("ld.shared.v4.f32").count(), 9);
    }
    let missing = FwdConfig {
        block_m: 64,
        split_keys: true,
        fold_scale: false,
        ..config(128, HalfType::F16, false)
    };
    assert!(generate(&missing).is_err());
}

/// Every 16-bit kernel zeroes the V rows past a packed sequence's end before the
/// first `P V` reads them: whole rows of every column block, in passes of the sharing
/// threads' 16-byte chunks, then a proxy fence and a barrier of exactly those threads
/// (all consumers, or one warpgroup with split keys). The warpgroups that read the tile
/// wait there from one site; one passing the tile by (causal 128-row kernels) arrives.
#[test]
fn packed_tails_zero_their_v_rows_before_p_v() {
    let mut configs = Vec::new();
    for d in HEAD_DIMS {
        for block_m in BLOCK_MS.into_iter().filter(|&m| has_tile(d, m)) {
            for causal in [false, true] {
                configs.push(FwdConfig {
                    block_m,
                    ..config(d, HalfType::Bf16, causal)
                });
                if has_split(d, block_m) {
                    configs.push(FwdConfig {
                        block_m,
                        split_keys: true,
                        fold_scale: false,
                        ..config(d, HalfType::F16, causal)
                    });
                }
            }
        }
    }
    assert_eq!(configs.len(), 20);
    for cfg in configs {
        let s = Shape::of(&cfg);
        let ptx = generate(&cfg).unwrap().to_ptx();
        let id = cfg.id();
        let sites: Vec<usize> = ptx
            .match_indices("Zero the V rows past the packed sequence's end.")
            .map(|(at, _)| at)
            .collect();
        let passes_by = cfg.causal && cfg.block_m == 128 && !cfg.split_keys;
        assert_eq!(sites.len(), 1 + passes_by as usize, "{id}: zeroing sites");
        let threads = 128 * s.kv_consumers();
        let mut barriers = Vec::new();
        for &at in &sites {
            let zeroing = &ptx[at..];
            let fence = zeroing.find("fence.proxy.async.shared::cta;").unwrap();
            let barrier = zeroing[fence..].lines().nth(1).unwrap().trim();
            assert!(
                barrier.ends_with(&format!(", {threads};")),
                "{id}: {barrier}"
            );
            barriers.push(barrier.split(' ').next().unwrap());
            let stores = zeroing[..fence].matches("st.shared.v4.b32").count() as u32;
            let passes = s.block_n.div_ceil(threads / 8);
            assert_eq!(stores, passes * s.kv_layout().col_blocks(), "{id}");
        }
        let expected: &[&str] = if passes_by {
            &["bar.arrive", "bar.sync"]
        } else {
            &["bar.sync"]
        };
        assert_eq!(barriers, expected, "{id}");
        let at = *sites.last().unwrap();
        // Before the first P V: the first wgmma whose A operand is registers (`}, {%`
        // after the accumulator; `Q Kᵀ` reads A through a descriptor).
        let first_pv = ptx
            .lines()
            .scan(0, |at, l| {
                let here = *at;
                *at += l.len() + 1;
                Some((here, l))
            })
            .find(|(_, l)| l.contains("wgmma.mma_async") && l.contains("}, {%"))
            .map(|(at, _)| at)
            .unwrap_or_else(|| panic!("{id}: no P V"));
        assert!(at < first_pv, "{id}: V zeroed after the first P V");
    }
}

#[test]
fn output_is_staged_beside_q_where_it_fits() {
    for d in HEAD_DIMS {
        let s = Shape::of(&config(d, HalfType::F16, false));
        // With 64-row tiles O has a tile of its own at every head dim.
        let narrow = Shape { block_m: 64, ..s };
        assert!(!narrow.o_in_q(), "d{d}");
        assert!(narrow.plan().0.bytes() <= MAX_SMEM, "d{d}");
        let (plan, slots) = s.plan();
        assert!(plan.bytes() <= MAX_SMEM, "d{d}: {} bytes", plan.bytes());
        assert_eq!(s.o_in_q(), d >= 192, "d{d}");
        assert_eq!(slots.o == slots.q, s.o_in_q(), "d{d}");
        assert_eq!(slots.o.layout, s.q_layout());
    }
}

/// The epilogue writes O with stmatrix and sends it by TMA (one `{64, 16}` box per
/// warp and 64-column block), and keeps the direct stores for launches without a map
/// of O.
#[test]
fn causal_diagonal_tile_can_take_its_softmax_on_the_left_part_alone() {
    let count = |ptx: &str, op: &str| ptx.lines().filter(|l| l.contains(op)).count();
    for d in HEAD_DIMS {
        for dtype in [HalfType::F16, HalfType::Bf16] {
            let full = generate(&config(d, dtype, false)).unwrap().to_ptx();
            let causal = generate(&config(d, dtype, true)).unwrap().to_ptx();
            // One warp-uniform choice, only under a causal mask.
            assert_eq!(count(&full, "vote.sync.all.pred"), 0, "d{d}");
            assert_eq!(count(&causal, "vote.sync.all.pred"), 1, "d{d}");
            // The left part's softmax is a second copy of the first tile's: its
            // exponentials (4 per 8-column tile) and the two rows' rescales.
            let block_n = Shape::of(&config(d, dtype, true)).block_n as usize;
            let left_tiles = (block_n / 2).div_ceil(16) * 2;
            assert!(
                left_tiles * 8 < block_n && left_tiles.is_multiple_of(2),
                "d{d}"
            );
            assert_eq!(
                count(&causal, "ex2.approx"),
                count(&full, "ex2.approx") + 4 * left_tiles + 2,
                "d{d} {dtype:?}"
            );
        }
    }
}

/// A padded kernel (head dims below its own) moves each tile of Q, K and V as one TMA
/// box per 64-column block, at column 64·b of a map whose innermost dimension is the
/// tensors' head dim, and stores O the same way; its direct stores of O (no map of O)
/// check each 8-column tile against its last parameter, the tensors' head dim;
/// everything else is its unpadded sibling's.
#[test]
fn padded_kernels_move_one_box_per_column_block() {
    let count = |ptx: &str, what: &str| ptx.matches(what).count() as u32;
    let loads = "cp.async.bulk.tensor.5d.shared::cluster.global";
    let stores = "cp.async.bulk.tensor.5d.global.shared::cta";
    let padded: Vec<_> = crate::kernels::attention::all_fwd_configs()
        .into_iter()
        .filter(|c| c.path == super::super::Path::Sm90 && c.padded)
        .collect();
    // f16/bf16 x no mask, causal or a window x folded or not, on 64- and 128-row tiles
    // of head dims 64/128/192/256, and head dim 256's 64-key tiles; and the soft-capping
    // twin of each (folded only).
    let capped = padded.iter().filter(|c| c.softcap).count();
    assert_eq!((padded.len() - capped, capped), (96 + 12, (96 + 12) / 2));
    for cfg in padded {
        let id = cfg.id();
        let ptx = generate(&cfg).unwrap().to_ptx();
        let plain = generate(&FwdConfig {
            padded: false,
            ..cfg
        })
        .unwrap()
        .to_ptx();
        let blocks = cfg.head_dim / 64;
        // A paged cache's chunks move one box per column block in either kernel.
        let paged = count(&plain, super::producer::PAGED_LOAD);
        assert_eq!(count(&ptx, super::producer::PAGED_LOAD), paged, "{id}");
        let tensors = count(&plain, loads) - paged;
        assert_eq!(count(&ptx, loads) - paged, blocks * tensors, "{id}");
        assert_eq!(count(&ptx, stores), count(&plain, stores), "{id}");
        for what in ["wgmma.mma_async", "ex2.approx", "stmatrix", "mbarrier."] {
            assert_eq!(count(&ptx, what), count(&plain, what), "{id}: {what}");
        }
        assert!(ptx.contains(".param .u32 head_dim"), "{id}");
        assert!(!plain.contains("head_dim"), "{id}");
        // One direct store per 8-column tile and row half, each behind its own check.
        let direct = count(&plain, "st.global.b32");
        assert_eq!(count(&ptx, "st.global.b32"), direct, "{id}");
        assert_eq!(direct, cfg.head_dim / 8 * 2, "{id}");
        let checks = count(&ptx, "setp.lt.u32") - count(&plain, "setp.lt.u32");
        assert!(checks >= direct, "{id}");
        // The first coordinate (the column) of each load and store: 0, 64, ... there.
        let mut columns: Vec<u32> = ptx
            .lines()
            .filter(|l| l.contains(loads) || l.contains(stores))
            .map(|l| {
                let reg = l.split('{').nth(1).unwrap().split(',').next().unwrap();
                let def = format!("mov.s32 {reg}, ");
                let line = ptx.lines().find(|l| l.contains(&def)).unwrap();
                line.split(", ")
                    .nth(1)
                    .unwrap()
                    .trim_end_matches(';')
                    .parse()
                    .unwrap()
            })
            .collect();
        columns.sort();
        columns.dedup();
        let want: Vec<u32> = (0..blocks).map(|b| 64 * b).collect();
        assert_eq!(columns, want, "{id}");
    }
    assert!(
        generate(&FwdConfig {
            padded: true,
            ..config(64, HalfType::F16, false)
        })
        .is_ok()
    );
    for (block_m, split_keys) in [(192, false), (64, true)] {
        let cfg = FwdConfig {
            block_m,
            split_keys,
            fold_scale: false,
            padded: true,
            ..config(64, HalfType::F16, false)
        };
        assert!(generate(&cfg).is_err(), "{}", cfg.id());
    }
}

#[test]
fn epilogue_stages_output_for_a_tma_store() {
    for d in HEAD_DIMS {
        for causal in [false, true] {
            let cfg = config(d, HalfType::Bf16, causal);
            let ptx = generate(&cfg).unwrap().to_ptx();
            let stores = ptx
                .matches("cp.async.bulk.tensor.5d.global.shared::cta")
                .count();
            assert_eq!(stores as u32, d / 64, "d{d} causal={causal}");
            assert_eq!(
                ptx.matches("stmatrix.sync.aligned.x4.m8n8").count() as u32,
                d / 16
            );
            assert!(ptx.contains("st.global.b32"), "d{d}: no direct stores");
            let read = ptx.matches("cp.async.bulk.wait_group.read 0;").count();
            // Own tile: waited for before the next write; Q's: right after the store,
            // before Q's tile is released.
            assert_eq!(read, 1, "d{d} causal={causal}");
            let wait_all = ptx.matches("cp.async.bulk.wait_group 0;").count();
            assert_eq!(wait_all, 1, "d{d}: the exit drains the stores");
        }
    }
}

/// Under a causal mask the two-consumer kernels let a warpgroup none of whose rows sees
/// the item's last key tile pass that tile by (an empty turn, its K and V stages released
/// unread, its share of a packed sequence's V rows zeroed); no other kernel has the
/// branch, and it issues no product.
#[test]
fn causal_warpgroups_pass_by_a_last_tile_they_do_not_see() {
    const MARK: &str = "pass it by";
    let ptx = |c: FwdConfig| {
        generate(&c)
            .unwrap_or_else(|e| panic!("{c:?}: {e}"))
            .to_ptx()
    };
    for d in HEAD_DIMS {
        for dtype in [HalfType::F16, HalfType::Bf16] {
            let causal = ptx(config(d, dtype, true));
            assert_eq!(causal.matches(MARK).count(), 1, "d{d} {dtype:?}");
            // Between the mark and the next product: turns, zeroing, waits and releases.
            let after = &causal[causal.find(MARK).unwrap()..];
            let branch = &after[..after.find("wgmma.mma_async").unwrap()];
            let zeroing = branch.find("Zero the V rows").expect("V rows zeroed");
            let (turns, zeroing) = branch.split_at(zeroing);
            // The passed tile's turn, passed on; then the V rows past a packed sequence's
            // end zeroed, and the warpgroup that will read them only told so (a second
            // `bar.sync` site of their barrier is what synccheck calls divergent).
            assert_eq!(turns.matches("bar.sync").count(), 1, "d{d}: its turn");
            assert_eq!(
                turns.matches("bar.arrive").count(),
                1,
                "d{d}: turn passed on"
            );
            let released = zeroing.find("mbarrier.arrive").expect("V released");
            let (zeroing, rest) = zeroing.split_at(released);
            assert!(zeroing.contains("st.shared.v4"), "d{d}");
            assert!(zeroing.contains("fence.proxy.async"), "d{d}");
            assert!(!zeroing.contains("bar.sync"), "d{d}: arrives only");
            assert_eq!(zeroing.matches("bar.arrive").count(), 1, "d{d}");
            // Then the next tile's turn before the first product.
            assert_eq!(rest.matches("bar.sync").count(), 1, "d{d}: the next turn");
            assert_eq!(
                branch.matches("mbarrier.arrive").count(),
                2,
                "d{d}: K and V released"
            );
            assert!(!ptx(config(d, dtype, false)).contains(MARK), "d{d} full");
            for block_m in [64, 192] {
                if has_tile(d, block_m) {
                    let c = FwdConfig {
                        block_m,
                        ..config(d, dtype, true)
                    };
                    assert!(!ptx(c).contains(MARK), "d{d} m{block_m}");
                }
            }
            if has_split(d, 64) {
                let c = FwdConfig {
                    block_m: 64,
                    split_keys: true,
                    fold_scale: false,
                    ..config(d, dtype, true)
                };
                assert!(!ptx(c).contains(MARK), "d{d} split keys");
            }
        }
    }
}

/// A KV cache's used keys and pages: every forward kernel that
/// [`reads_used_keys`](FwdConfig::reads_used_keys) loads `seqused_k` from its argument
/// block (and, on this path, carries the paged loads, behind the block table), and no
/// other does; the excluded ones are windowed only (those whose registers have no room).
#[test]
fn kernels_that_read_used_keys_load_them_and_page_on_sm90() {
    use std::mem::offset_of;
    let used_at = format!("[args+{}]", offset_of!(FwdArgs, seqused_k));
    let table_at = format!("[args+{}]", offset_of!(FwdArgs, block_table));
    let (mut reading, mut not) = (0, 0);
    for cfg in crate::kernels::attention::all_fwd_configs() {
        let id = cfg.id();
        let ptx = cfg.generate().unwrap().to_ptx();
        let reads = cfg.reads_used_keys();
        assert_eq!(ptx.contains(&used_at), reads, "{id}");
        let pages = cfg.path == super::super::Path::Sm90 && reads;
        assert_eq!(ptx.contains(&table_at), pages, "{id}");
        assert_eq!(ptx.contains(super::producer::PAGED_LOAD), pages, "{id}");
        if reads {
            reading += 1;
        } else {
            assert!(cfg.window, "{id}");
            not += 1;
        }
    }
    assert!(
        reading >= 5 * not,
        "{reading} kernels read the used keys, {not} do not"
    );
}

/// The causal 16-bit kernels that skip empty work items ([`ItemLoop::skip_empty`]) raise
/// the tile counter past a sequence without queries, once, in the producer's loop and
/// behind the counter's own check; the others (unmasked, windowed, FP8, sm80) never do.
#[test]
fn causal_producers_pass_sequences_without_queries() {
    let mut raising = 0;
    for cfg in crate::kernels::attention::all_fwd_configs() {
        let id = cfg.id();
        let ptx = cfg.generate().unwrap().to_ptx();
        let raises = ptx.matches("red.global.max.u32").count();
        let expected = cfg.path == super::super::Path::Sm90 && cfg.causal && !cfg.window;
        assert_eq!(raises, usize::from(expected), "{id}");
        if expected {
            raising += 1;
            // Before the ticket that follows it: the raise moves what that ticket draws.
            let raise = ptx.find("red.global.max.u32").unwrap();
            let ticket = ptx[raise..].find("atom.global.add.u32");
            assert!(ticket.is_some(), "{id}: no ticket after the raise");
        }
    }
    assert!(raising >= 50, "{raising} kernels raise the counter");
    // The FP8 kernels' launches are dense: no item there lacks query rows.
    for cfg in crate::kernels::attention::fp8::all_fp8_configs() {
        let ptx = cfg.generate().unwrap().to_ptx();
        assert!(!ptx.contains("red.global.max"), "{}", cfg.id());
    }
}

/// Every sm90a forward (16-bit and FP8) decodes its work items by multiplies and shifts
/// from the argument block's [`FastDivisor`](crate::ptx::FastDivisor)s: no `div` or `rem`
/// on a register divisor, whose reciprocal sequence stood between a producer's first
/// ticket and its first TMA.
#[test]
fn sm90_work_items_decode_without_integer_division() {
    let divides = |ptx: &str| {
        ptx.lines().any(|l| {
            ["div.u32", "div.s32", "rem.u32", "rem.s32"]
                .iter()
                .any(|d| l.contains(d))
        })
    };
    let mut sm90 = 0;
    for cfg in crate::kernels::attention::all_fwd_configs() {
        if cfg.path != super::super::Path::Sm90 {
            continue;
        }
        sm90 += 1;
        let ptx = cfg.generate().unwrap().to_ptx();
        assert!(!divides(&ptx), "{}", cfg.id());
        assert!(ptx.contains("mul.hi.u32"), "{}", cfg.id());
    }
    assert!(sm90 >= 300, "{sm90} sm90 forward kernels");
    for cfg in crate::kernels::attention::fp8::all_fp8_configs() {
        let ptx = cfg.generate().unwrap().to_ptx();
        if ptx.contains(".target sm_90a") {
            assert!(!divides(&ptx), "{}", cfg.id());
        }
    }
}

/// The kernels whose consumer warpgroups take turns (two or three) let a row's maximum
/// trail a tile's by [`Shape::max_lag`] and skip O's rescale in warps whose maxima all
/// stayed (a vote before each rescale); the one-consumer and split-keys kernels, and
/// every unfolded one, rescale on every tile, without a vote.
#[test]
fn turn_taking_kernels_skip_rescales_where_no_maximum_moved() {
    let votes = |cfg: &FwdConfig| {
        let ptx = generate(cfg).unwrap().to_ptx();
        ptx.lines()
            .filter(|l| l.contains("vote.sync.any.pred"))
            .count()
    };
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for causal in [false, true] {
            let turns = [
                config(64, dtype, causal),
                FwdConfig {
                    block_m: 192,
                    ..config(64, dtype, causal)
                },
                config(128, dtype, causal),
                config(192, dtype, causal),
                config(256, dtype, causal),
            ];
            for cfg in turns {
                assert_eq!(Shape::of(&cfg).max_lag(), Some(8.0), "{}", cfg.id());
                // The loop's rescale and the last `P V`'s.
                assert!(votes(&cfg) >= 2, "{}", cfg.id());
                let unfolded = FwdConfig {
                    fold_scale: false,
                    ..cfg
                };
                assert_eq!(votes(&unfolded), 0, "{}", unfolded.id());
            }
            let alone = [
                FwdConfig {
                    block_m: 64,
                    ..config(64, dtype, causal)
                },
                FwdConfig {
                    block_m: 64,
                    split_keys: true,
                    fold_scale: false,
                    ..config(64, dtype, causal)
                },
            ];
            for cfg in alone {
                assert_eq!(Shape::of(&cfg).max_lag(), None, "{}", cfg.id());
                assert_eq!(votes(&cfg), 0, "{}", cfg.id());
            }
        }
    }
}
