#!/usr/bin/env bash
# Builds everything the GPU machine runs (it has no cargo) into gpu-bundle/ (git-ignored):
#
#   gpu-bundle/tests/<name>      integration-test binaries (tests/<name>.rs)
#   gpu-bundle/tests/lib-<name>  the library's unit tests, tests/bin-<name> a binary's
#   gpu-bundle/benches/<name>    criterion benchmark binaries
#   gpu-bundle/bin/flashcore     the command line (target/release/flashcore)
#   gpu-bundle/sdpa_bench.py     the PyTorch SDPA baseline (scripts/sdpa_bench.py)
#   gpu-bundle/harness.py        the side-by-side harness over the C ABI (scripts/harness.py)
#   gpu-bundle/profile.sh        Nsight Compute summary of one configuration (scripts/profile.sh)
#   gpu-bundle/release/libflashcore.so   the C ABI library
#   gpu-bundle/c/forward_{dynamic,static} the C example (examples/c/forward.c)
#   gpu-bundle/wheels/flashcore-*.whl    the Python package (python/), over that library
#   gpu-bundle/llama_bench.py    per-token time of a random Llama, SDPA vs the package's backend
#   gpu-bundle/window_bench.py   sliding-window attention: SDPA with the window as a mask, causal SDPA, the package
#   gpu-bundle/softcap_bench.py  soft-capped attention: eager, flex_attention, the package (imports window_bench.py)
#   gpu-bundle/cache_prefill_sdpa.py  SDPA on the shapes of a prefill chunk against a cache (beside `flashcore decode --seqlen-q`)
#   gpu-bundle/fp8_model_check.py  a random Llama with FP8 attention against 16-bit: logits, greedy tokens
#   gpu-bundle/manifest.txt      commit, build date, file list
#   gpu-bundle/run.sh            what the GPU machine runs
#
# Usage (here):        scripts/gpu-bundle.sh
# Then (GPU machine):  bash gpu-bundle/run.sh [all | system tests sanitize bench criterion ...]
#                      from the repository root; everything is written under $OUT
#                      (default ./out). The bundle is git-ignored: pass it along
#                      explicitly (e.g. as a carried path) when copying the tree.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
bundle="$root/gpu-bundle"

command -v python3 >/dev/null || { echo "gpu-bundle: python3 is needed to read cargo's JSON" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Reads cargo --message-format=json on stdin; prints "dest<TAB>source" for each executable.
# $1 = tests | benches | bin
select_executables() {
    python3 -c '
import json, sys
mode = sys.argv[1]
seen = set()
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t, prof = m["target"], m.get("profile", {})
    kinds, name = t.get("kind", []), t["name"]
    if mode == "tests":
        if not prof.get("test"):
            continue  # examples etc.: built by cargo test, not tests
        if "test" in kinds:
            dest = "tests/" + name
        elif "bin" in kinds:
            dest = "tests/bin-" + name
        elif "bench" in kinds:
            dest = "tests/bench-" + name
        else:
            dest = "tests/lib-" + name
    elif mode == "benches":
        if "bench" not in kinds:
            continue
        dest = "benches/" + name
    else:
        if "bin" not in kinds or prof.get("test"):
            continue
        dest = "bin/" + name
    if dest in seen:
        sys.exit("gpu-bundle: two executables map to " + dest)
    seen.add(dest)
    print(dest + "\t" + m["executable"])
' "$1"
}

timed() {
    local t0=$SECONDS
    echo "==> $*" >&2
    "$@"
    echo "==> done in $((SECONDS - t0))s" >&2
}

timed cargo test --release --no-run --message-format=json >"$tmp/tests.json"
timed cargo bench --no-run --message-format=json >"$tmp/benches.json"
timed cargo build --release --message-format=json >"$tmp/build.json"

{
    select_executables tests <"$tmp/tests.json"
    select_executables benches <"$tmp/benches.json"
    select_executables bin <"$tmp/build.json"
} >"$tmp/list"

grep -q '^bin/flashcore	' "$tmp/list" || { echo "gpu-bundle: no flashcore binary was built" >&2; exit 1; }

rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/benches" "$bundle/bin"
while IFS=$'\t' read -r dest src; do
    cp "$src" "$bundle/$dest"
    chmod +x "$bundle/$dest"
done <"$tmp/list"
cp scripts/sdpa_bench.py "$bundle/sdpa_bench.py"
cp scripts/gemm_bench.py "$bundle/gemm_bench.py"
cp scripts/harness.py "$bundle/harness.py"
cp scripts/profile.sh "$bundle/profile.sh"
cp scripts/llama_bench.py "$bundle/llama_bench.py"
cp scripts/window_bench.py "$bundle/window_bench.py"
cp scripts/softcap_bench.py "$bundle/softcap_bench.py"
cp scripts/cache_prefill_sdpa.py "$bundle/cache_prefill_sdpa.py"
cp scripts/fp8_model_check.py "$bundle/fp8_model_check.py"
cp scripts/decode_sdpa_bench.py "$bundle/decode_sdpa_bench.py"
timed bash scripts/build-c-example.sh --no-run >&2
mkdir -p "$bundle/release" "$bundle/c"
cp target/release/libflashcore.so "$bundle/release/"
cp target/c-example/forward_dynamic target/c-example/forward_static "$bundle/c/"
FLASHCORE_PREBUILT_LIB="$root/target/release/libflashcore.so" \
    timed python3 -m pip wheel ./python --no-deps --quiet -w "$bundle/wheels" >&2

{
    echo "flashcore gpu-bundle"
    echo "built:  $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm)"
    if commit=$(git rev-parse --short HEAD 2>/dev/null); then
        dirty=$(git status --porcelain 2>/dev/null | grep -c . || true)
        echo "commit: $commit ($dirty changed/untracked paths in the work tree)"
    fi
    echo "rustc:  $(rustc --version)"
    echo "files:"
    (cd "$bundle" && find . -type f ! -name manifest.txt | sort | while read -r f; do
        printf '  %-40s %10s bytes\n' "${f#./}" "$(stat -c %s "$f")"
    done)
} >"$bundle/manifest.txt"

# ------------------------------------------------------------------------------------------
cat >"$bundle/run.sh" <<'RUN_SH'
#!/usr/bin/env bash
# Runs on the GPU machine (no cargo) from the repository root:
#
#   bash gpu-bundle/run.sh                 # everything
#   bash gpu-bundle/run.sh tests bench     # some groups: system hopper tests sanitize decode fp8 calibrate c python bench padded criterion profile
#
# Writes under $OUT (default ./out) at most 8 files, no subfolders (the device machine
# returns no more than 8 files of a call):
#   system.log     manifest, nvidia-smi, flashcore info
#   tests.log      every test binary (--include-ignored --test-threads=1); first (group
#                  hopper) the sm_90a proof kernels: TMA round trip + GEMM tests, GEMM vs
#                  cuBLAS, sanitizers
#   python.log     the wheel installed (pip --target, on PYTHONPATH): pytest, the harness
#                  through the package, the Llama per-token benchmark
#   sanitizer.log  compute-sanitizer memcheck / racecheck / synccheck on `flashcore run`
#   fp8.log        FP8: quantizer + both kernel families under the sanitizers, FP8 vs f16 and SDPA,
#                  quantizer bandwidth; the calibration table (group calibrate)
#   decode.log     serving: gpu_decode and gpu_varlen under the sanitizers, decode GB/s against
#                  SDPA; at its end the JSON of both sides (decode_ours*.json, decode_sdpa.json)
#   bench.log      flashcore bench, SDPA bench, comparison, harness, padded head dims, criterion,
#                  ncu profile; at its end the JSON of both sides (ours.json, sdpa.json)
#   (harness.py and the GEMM benches print their tables into the logs; their JSON stays in scratch)
#   summary.txt    one line per step: status, exit code, seconds, log
# Each step runs under a timeout; one failing step never stops the others. Steps that
# would start after the deadline ($RUN_DEADLINE_S seconds after start, default 570) are
# skipped, so the summary table (the LAST lines printed) always gets out.
set -uo pipefail

bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$bundle/.." || exit 1

OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

export PATH=/usr/local/cuda/bin:$PATH
export FLASHCORE_CUDA_BIN=/usr/local/cuda/bin
export RUST_BACKTRACE=1

t_start=$SECONDS
deadline=${RUN_DEADLINE_S:-570}
fc="$bundle/bin/flashcore"

groups=("$@")
[[ ${#groups[@]} -eq 0 ]] && groups=(all)
want() {
    local g
    for g in "${groups[@]}"; do
        [[ $g == "$1" || $g == all ]] && return 0
    done
    return 1
}

names=()
results=()
failed_logs=()
n_ok=0
n_fail=0
n_skip=0

# step LOG NAME TIMEOUT_S CMD...: runs CMD, appends its output to $OUT/LOG, records status.
step() {
    local log=$1 name=$2 limit=$3
    shift 3
    local left=$((deadline - (SECONDS - t_start)))
    local tmp="$scratch/step.$((${#names[@]}))"
    names+=("$name")
    if ((left < 15)); then
        results+=("$(printf '%-7s %4s %6s  %-13s' SKIP - - "$log")")
        n_skip=$((n_skip + 1))
        printf '[skip] %s (deadline)\n' "$name"
        printf '\n===== %s: SKIPPED (deadline)\n' "$name" >>"$OUT/$log"
        return 0
    fi
    if ((limit > left - 10)); then
        limit=$((left - 10))
    fi
    local t0=$SECONDS rc
    {
        printf '\n===== %s\n$ %s\n' "$name" "$*"
    } >>"$OUT/$log"
    timeout --kill-after=10 "$limit" "$@" >"$tmp" 2>&1 </dev/null
    rc=$?
    local dt=$((SECONDS - t0))
    cat "$tmp" >>"$OUT/$log"
    local status=ok
    if ((rc == 124 || rc == 137)); then
        status=TIMEOUT
    elif ((rc != 0)); then
        status=FAIL
    fi
    printf -- '----- %s: %s (exit %s, %ss)\n' "$name" "$status" "$rc" "$dt" >>"$OUT/$log"
    results+=("$(printf '%-7s %4s %5ss  %-13s' "$status" "$rc" "$dt" "$log")")
    if [[ $status == ok ]]; then
        n_ok=$((n_ok + 1))
    else
        n_fail=$((n_fail + 1))
        cp "$tmp" "$scratch/fail.${#failed_logs[@]}"
        failed_logs+=("$name")
    fi
    printf '[%s] %s (%ss)\n' "$status" "$name" "$dt"
    return 0
}

echo "flashcore gpu run: groups: ${groups[*]}; output in $OUT"

# ---- system ------------------------------------------------------------------------------
if want system; then
    step system.log manifest 10 cat "$bundle/manifest.txt"
    step system.log nvidia-smi 30 nvidia-smi
    step system.log tool-versions 60 bash -c 'ptxas --version; cuobjdump --version; compute-sanitizer --version; python3 -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version())"'
    step system.log "flashcore info" 60 "$fc" info
fi

# ---- Hopper building blocks: TMA round trip and GEMM, first and with short limits -------
if want hopper; then
    t="$bundle/tests/gpu_hopper"
    failed_before=$n_fail
    [[ -x $t ]] && step tests.log "test gpu_hopper" 120 "$t" --include-ignored --test-threads=1 --nocapture
    if ((n_fail > failed_before)); then
        echo "gpu_hopper failed: skipping the Hopper benches and sanitizers (a hang would eat their limits)"
    else
        rm -f "$scratch/gemm_ours.json" "$scratch/gemm_cublas.json"
        step tests.log "flashcore gemm (8192^3)" 90 "$fc" gemm --json "$scratch/gemm_ours.json"
        step tests.log "cublas gemm (8192^3)" 90 python3 "$bundle/gemm_bench.py" --json "$scratch/gemm_cublas.json"
        step tests.log "gemm compare" 30 python3 "$bundle/gemm_bench.py" --compare "$scratch/gemm_ours.json" "$scratch/gemm_cublas.json"
        for tool in memcheck racecheck synccheck; do
            step tests.log "$tool gemm 300x520x4112" 120 \
                compute-sanitizer --tool "$tool" --error-exitcode 1 \
                "$fc" gemm --m 300 --n 520 --k 4112 --iters 1
            [[ -x $t ]] && step tests.log "$tool tma round trips" 120 \
                compute-sanitizer --tool "$tool" --error-exitcode 1 \
                "$t" --include-ignored --test-threads=1 tma_round_trips
        done
    fi
fi

# ---- tests -------------------------------------------------------------------------------
if want tests; then
    for t in "$bundle"/tests/*; do
        [[ -x $t ]] || continue
        # gpu_hopper runs in its own group, first.
        [[ $(basename "$t") == gpu_hopper ]] && want hopper && continue
        # gpu_forward takes about 410 s on an H100 and gpu_varlen up to 260 s; the others
        # well under 300.
        case $(basename "$t") in
            gpu_forward | gpu_varlen) limit=540 ;;
            *) limit=300 ;;
        esac
        # Per-case errors are part of the evidence: show every test's output.
        step tests.log "test $(basename "$t")" "$limit" "$t" --include-ignored --test-threads=1 --nocapture
    done
fi

# ---- sanitizers --------------------------------------------------------------------------
if want sanitize; then
    shapes=(
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 113 --seqlen-k 200 --head-dim 64 --dtype f16"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 113 --seqlen-k 200 --head-dim 64 --dtype f16 --causal"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 200 --seqlen-k 113 --head-dim 128 --dtype bf16 --causal"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 77 --seqlen-k 77 --head-dim 128 --dtype bf16"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 300 --seqlen-k 200 --head-dim 128 --dtype f16 --causal --block-m 128 --path sm80"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 113 --seqlen-k 300 --head-dim 64 --dtype bf16 --block-m 64 --path sm80"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 113 --seqlen-k 200 --head-dim 64 --dtype f16 --path sm80"
        "--batch 1 --heads 4 --kv-heads 1 --seqlen-q 300 --seqlen-k 200 --head-dim 128 --dtype bf16 --causal"
        "--batch 2 --heads 2 --kv-heads 2 --seqlen-q 77 --seqlen-k 333 --head-dim 256 --dtype f16"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 200 --seqlen-k 513 --head-dim 64 --dtype f16 --causal"
        # 272 causal work items: the sm90a blocks take them from a counter.
        "--batch 2 --heads 68 --kv-heads 17 --seqlen-q 200 --seqlen-k 300 --head-dim 64 --dtype f16 --causal"
        # On Hopper the small shapes above take the one-consumer sm90a kernel (64-row
        # tiles); these force the two-consumer one on a small grid, and the one-consumer one
        # beyond one wave (544 causal items from the counter).
        "--batch 1 --heads 4 --kv-heads 1 --seqlen-q 300 --seqlen-k 200 --head-dim 128 --dtype bf16 --causal --block-m 128"
        "--batch 2 --heads 2 --kv-heads 2 --seqlen-q 77 --seqlen-k 333 --head-dim 256 --dtype f16 --block-m 128"
        "--batch 2 --heads 68 --kv-heads 17 --seqlen-q 200 --seqlen-k 300 --head-dim 64 --dtype f16 --causal --block-m 64"
        # The three-consumer kernel (head dim 64): alone and beyond one wave, without a
        # mask and with the causal counter (rows that see no key included).
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 300 --seqlen-k 513 --head-dim 64 --dtype bf16 --block-m 192"
        "--batch 2 --heads 68 --kv-heads 17 --seqlen-q 500 --seqlen-k 700 --head-dim 64 --dtype f16 --block-m 192"
        "--batch 2 --heads 68 --kv-heads 17 --seqlen-q 700 --seqlen-k 500 --head-dim 64 --dtype bf16 --causal --block-m 192"
        # The split-keys kernel (head dim 64): the dispatch's pick on a small grid, and
        # forced beyond one wave with odd and even tile counts, without a mask and from
        # the causal counter.
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 300 --seqlen-k 1100 --head-dim 64 --dtype f16"
        "--batch 2 --heads 68 --kv-heads 17 --seqlen-q 300 --seqlen-k 129 --head-dim 64 --dtype f16 --split-keys on"
        "--batch 2 --heads 68 --kv-heads 17 --seqlen-q 200 --seqlen-k 300 --head-dim 64 --dtype bf16 --causal --split-keys on"
        # Head dims without a kernel of their own: padded kernels (on Hopper sm90a ones, 80
        # and 96 on 128, 40 on 64, 160 and 248 on 256, one TMA box per column block; the
        # sm80 ones, 80 on 96, 40 on 64, 248 on 256, whose loads skip and whose stores
        # leave out the columns past d).
        "--batch 1 --heads 4 --kv-heads 2 --seqlen-q 113 --seqlen-k 200 --head-dim 80 --dtype f16 --causal"
        "--batch 2 --heads 2 --kv-heads 1 --seqlen-q 300 --seqlen-k 129 --head-dim 40 --dtype bf16"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 77 --seqlen-k 333 --head-dim 248 --dtype f16 --causal"
        "--batch 2 --heads 68 --kv-heads 17 --seqlen-q 200 --seqlen-k 300 --head-dim 96 --dtype bf16 --causal"
        "--batch 1 --heads 4 --kv-heads 2 --seqlen-q 300 --seqlen-k 200 --head-dim 160 --dtype f16 --block-m 128"
        "--batch 1 --heads 4 --kv-heads 2 --seqlen-q 113 --seqlen-k 200 --head-dim 80 --dtype f16 --causal --path sm80"
        "--batch 2 --heads 2 --kv-heads 1 --seqlen-q 300 --seqlen-k 129 --head-dim 40 --dtype bf16 --path sm80"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 77 --seqlen-k 333 --head-dim 248 --dtype f16 --causal --path sm80"
        # Decode-shaped forwards (up to 16 queries against 1536 keys or more): the split-KV
        # decode kernels with their merge, padded (80 on 96), one split in [B, H, S, D], and a
        # batch of many GQA-packed KV heads against 700 keys.
        "--batch 2 --heads 32 --kv-heads 8 --seqlen-q 16 --seqlen-k 2049 --head-dim 128 --dtype f16 --causal"
        "--batch 1 --heads 12 --kv-heads 4 --seqlen-q 5 --seqlen-k 4097 --head-dim 80 --dtype bf16"
        "--batch 64 --heads 8 --kv-heads 8 --seqlen-q 1 --seqlen-k 1536 --head-dim 64 --dtype f16 --layout bhsd"
        "--batch 16 --heads 32 --kv-heads 8 --seqlen-q 16 --seqlen-k 700 --head-dim 64 --dtype f16 --causal"
        # Key windows: the windowed sm90a kernels (edges only; every tile at head dim 256),
        # the sm80 one, and a decode-shaped call skipping the tiles before its window.
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 300 --seqlen-k 200 --head-dim 128 --dtype bf16 --causal --window 37,0"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 113 --seqlen-k 300 --head-dim 64 --dtype f16 --window 50,20"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen 200 --head-dim 256 --dtype bf16 --causal --window 65,0"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen 300 --head-dim 128 --dtype f16 --causal --window 100,0 --path sm80"
        "--batch 2 --heads 32 --kv-heads 8 --seqlen-q 16 --seqlen-k 2049 --head-dim 128 --dtype f16 --causal --window 500,0"
        # Soft-capped scores: the sm90a capping kernels (64- and 128-row tiles, a window),
        # the sm80 one, and a decode-shaped call on the decode kernels.
        "--batch 1 --heads 4 --kv-heads 2 --seqlen-q 300 --seqlen-k 177 --head-dim 128 --dtype f16 --softcap 5"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen 200 --head-dim 256 --dtype bf16 --causal --window 65,0 --softcap 50"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen 130 --head-dim 64 --dtype f16 --causal --softcap 2 --path sm80"
        "--batch 2 --heads 32 --kv-heads 8 --seqlen-q 4 --seqlen-k 2049 --head-dim 128 --dtype bf16 --causal --softcap 30"
    )
    for tool in memcheck racecheck synccheck; do
        for s in "${shapes[@]}"; do
            read -ra shape_args <<<"$s"
            short=$(sed -e 's/--batch /B/; s/ --heads /H/; s/ --kv-heads /KV/; s/ --seqlen-q /Sq/; s/ --seqlen-k /Sk/; s/ --head-dim /D/; s/ --dtype / /; s/ --causal/ causal/; s/ --window / window /; s/ --softcap / softcap /; s/ --block-m / m/; s/ --split-keys on/ splitkv/; s/ --path / /' <<<"$s")
            step sanitizer.log "$tool $short" 180 \
                compute-sanitizer --tool "$tool" --error-exitcode 1 \
                "$fc" run "${shape_args[@]}" --iters 1
        done
    done
fi

# ---- serving: decode, append, merge ------------------------------------------------------
if want decode; then
    t="$bundle/tests/gpu_decode"
    [[ -x $t ]] && ! want tests && step decode.log "test gpu_decode" 300 "$t" --include-ignored --test-threads=1 --nocapture
    for tool in memcheck racecheck synccheck; do
        [[ -x $t ]] && step decode.log "$tool decode/append/merge" 240 \
            compute-sanitizer --tool "$tool" --error-exitcode 1 \
            "$t" --include-ignored --test-threads=1 \
            decode_small_for_sanitizers device_metadata_never_leaves_the_cache \
            append_writes_the_new_rows_where_they_belong merge_of_shards_matches_one_shot_attention \
            decode_fp8_cache_small_for_sanitizers fp8_append_quantizes_rows_where_they_belong
    done
    t="$bundle/tests/gpu_varlen"
    [[ -x $t ]] && ! want tests && step decode.log "test gpu_varlen" 420 "$t" --include-ignored --test-threads=1 --nocapture
    for tool in memcheck racecheck synccheck; do
        [[ -x $t ]] && step decode.log "$tool varlen prefill" 240 \
            compute-sanitizer --tool "$tool" --error-exitcode 1 \
            "$t" --include-ignored --test-threads=1 varlen_small_for_sanitizers bad_offsets
    done
    step decode.log "flashcore varlen" 120 "$fc" varlen
    step decode.log "flashcore varlen causal" 120 "$fc" varlen --causal
    step decode.log "flashcore decode" 240 "$fc" decode --json "$scratch/decode_ours.json"
    step decode.log "decode_sdpa_bench" 240 python3 "$bundle/decode_sdpa_bench.py" --json "$scratch/decode_sdpa.json"
    step decode.log "decode compare" 30 python3 "$bundle/decode_sdpa_bench.py" --compare "$scratch/decode_ours.json" "$scratch/decode_sdpa.json"
    step decode.log "flashcore decode (e4m3 cache)" 240 "$fc" decode --kv-dtype e4m3 --json "$scratch/decode_ours_e4m3.json"
    step decode.log "decode compare (e4m3 cache)" 30 python3 "$bundle/decode_sdpa_bench.py" --compare "$scratch/decode_ours_e4m3.json" "$scratch/decode_sdpa.json"
    step decode.log "harness --decode (C ABI vs SDPA)" 120 python3 "$bundle/harness.py" --decode \
        --lib "$bundle/release/libflashcore.so" --json "$scratch/harness_decode.json"
    step decode.log "harness --decode --kv-dtype e4m3 (C ABI vs SDPA)" 120 python3 "$bundle/harness.py" \
        --decode --kv-dtype e4m3 --lib "$bundle/release/libflashcore.so" --json "$scratch/harness_decode_e4m3.json"
fi

# ---- the C example ----
if want c; then
    step tests.log "c example (dynamic)" 120 "$bundle/c/forward_dynamic"
    step tests.log "c example (static)" 120 "$bundle/c/forward_static"
fi

# ---- FP8 ---------------------------------------------------------------------------------
if want fp8; then
    # The GPU quantizer and both FP8 kernel families (sm90a on Hopper; sm89 with
    # --path sm80) under the sanitizers, through `flashcore run --dtype e4m3`.
    fp8_shapes=(
        "--batch 1 --heads 4 --kv-heads 1 --seqlen-q 200 --seqlen-k 513 --head-dim 128 --causal"
        "--batch 2 --heads 2 --kv-heads 2 --seqlen-q 77 --seqlen-k 333 --head-dim 64 --in-dtype bf16 --smooth-k"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 113 --seqlen-k 200 --head-dim 256 --hadamard 7"
        # The Hadamard option: on Hopper, the tensor-core rotation (with smoothing too).
        "--batch 2 --heads 4 --kv-heads 2 --seqlen-q 129 --seqlen-k 300 --head-dim 128 --in-dtype bf16 --hadamard 5"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 1 --seqlen-k 17 --head-dim 64 --hadamard 9"
        "--batch 1 --heads 8 --kv-heads 2 --seqlen-q 257 --seqlen-k 130 --head-dim 256 --smooth-k --hadamard 4"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 1 --seqlen-k 17 --head-dim 64 --smooth-k --hadamard 9"
        "--batch 2 --heads 4 --kv-heads 2 --seqlen-q 129 --seqlen-k 300 --head-dim 128 --in-dtype bf16 --smooth-k --hadamard 5"
        "--batch 1 --heads 4 --kv-heads 1 --seqlen-q 200 --seqlen-k 513 --head-dim 256 --causal"
        "--batch 1 --heads 2 --kv-heads 1 --seqlen-q 130 --seqlen-k 300 --head-dim 128 --causal --path sm80"
        "--batch 1 --heads 2 --kv-heads 2 --seqlen-q 77 --seqlen-k 150 --head-dim 256 --path sm80"
        # 272 causal work items: the sm90a blocks take them from a counter.
        "--batch 2 --heads 68 --kv-heads 17 --seqlen-q 200 --seqlen-k 300 --head-dim 128 --causal"
    )
    for tool in memcheck racecheck synccheck; do
        for s in "${fp8_shapes[@]}"; do
            read -ra shape_args <<<"$s"
            step fp8.log "$tool e4m3 $s" 180 \
                compute-sanitizer --tool "$tool" --error-exitcode 1 \
                "$fc" run --dtype e4m3 --iters 0 "${shape_args[@]}"
        done
    done
    step fp8.log "flashcore fp8 (FP8 vs our f16, quantizer time)" 240 "$fc" fp8
    step fp8.log "sdpa_bench f16 (Hopper grid, for the FP8 rows)" 240 python3 "$bundle/sdpa_bench.py" \
        --shapes hopper --dtype f16 --backends cudnn,flash --json "$scratch/sdpa_fp8.json"
    step fp8.log "flashcore quantize-bench" 120 "$fc" quantize-bench
    step fp8.log "flashcore quantize-bench --kv-heads 8" 120 "$fc" quantize-bench --kv-heads 8
fi
# The calibration suite on its own (about 2.5 minutes): a group of its own so that it fits
# one call's time limit next to `fp8`.
if want calibrate; then
    step fp8.log "flashcore calibrate" 420 "$fc" calibrate --json "$scratch/calibrate.json"
fi

# ---- the Python package ------------------------------------------------------------------
if want python; then
    # A private site directory on PYTHONPATH, over the system's torch and transformers (a
    # venv would not see Debian's dist-packages, where they are).
    site="$scratch/site"
    export PYTHONPATH="$site"
    step python.log "install the wheel" 120 bash -c "python3 -m pip install --no-index --no-deps --quiet --target '$site' '$bundle'/wheels/flashcore-*.whl && cd / && python3 -c 'import flashcore; print(flashcore.__file__, flashcore.library_version())'"
    # From / so that `import flashcore` can only find the installed wheel.
    step python.log "pytest python/tests" 420 bash -c "cd / && python3 -m pytest -q -rfEs -p no:cacheprovider '$PWD/python/tests'"
    step python.log "harness through the package" 240 python3 "$bundle/harness.py" --package \
        --lib "$bundle/release/libflashcore.so" --json "$scratch/harness_pkg.json"
    step python.log "llama per-token time" 240 python3 "$bundle/llama_bench.py" --json "$scratch/llama.json"
    step python.log "harness FP8 (attention_fp8 vs SDPA)" 240 python3 "$bundle/harness.py" --fp8 \
        --lib "$bundle/release/libflashcore.so" --json "$scratch/harness_fp8.json"
    step python.log "llama with FP8 attention" 300 python3 "$bundle/fp8_model_check.py" --json "$scratch/fp8_model.json"
    unset PYTHONPATH
fi

# ---- benchmarks --------------------------------------------------------------------------
if want bench; then
    # The Hopper grid (D 64/128/256, S 512..16384, GQA, the reference shape; it contains
    # the default shapes) on the best path, then the sm80 path on the default shapes.
    step bench.log "flashcore bench" 300 "$fc" bench --shapes hopper --dtype f16,bf16 --json "$scratch/ours.json"
    step bench.log "sdpa_bench" 300 python3 "$bundle/sdpa_bench.py" --shapes hopper --dtype f16,bf16 --json "$scratch/sdpa.json"
    step bench.log "compare" 60 python3 "$bundle/sdpa_bench.py" --compare "$scratch/ours.json" "$scratch/sdpa.json"
    step bench.log "flashcore bench --path sm80" 120 "$fc" bench --path sm80 --json "$scratch/sm80.json"
    step bench.log "compare sm80 path" 60 python3 "$bundle/sdpa_bench.py" --compare "$scratch/sm80.json" "$scratch/sdpa.json"
    step bench.log "harness (C ABI vs SDPA)" 240 python3 "$bundle/harness.py" \
        --lib "$bundle/release/libflashcore.so" --json "$scratch/harness.json"
fi

# The head dims without an sm90 kernel of their own (on Hopper: padded sm90a kernels),
# on the best path and the sm80 one, beside SDPA.
if want padded; then
    step bench.log "flashcore bench --shapes padded" 240 "$fc" bench --shapes padded --dtype f16 --json "$scratch/padded_ours.json"
    step bench.log "flashcore bench --shapes padded --path sm80" 240 "$fc" bench --shapes padded --dtype f16 --path sm80 --json "$scratch/padded_sm80.json"
    step bench.log "sdpa_bench --shapes padded" 240 python3 "$bundle/sdpa_bench.py" --shapes padded --dtype f16 --json "$scratch/padded_sdpa.json"
    step bench.log "compare padded" 60 python3 "$bundle/sdpa_bench.py" --compare "$scratch/padded_ours.json" "$scratch/padded_sdpa.json"
    step bench.log "compare padded sm80" 60 python3 "$bundle/sdpa_bench.py" --compare "$scratch/padded_sm80.json" "$scratch/padded_sdpa.json"
fi

if want profile; then
    export PROFILE_CSV="$scratch/ncu.csv"
    for mask in "" --causal; do
        step bench.log "ncu profile B4 H16 S4096 D128 ${mask:-full}" 120 \
            bash "$bundle/profile.sh" --bin "$fc" --batch 4 --heads 16 --seqlen 4096 --head-dim 128 $mask
    done
fi

if want criterion; then
    for b in "$bundle"/benches/*; do
        [[ -x $b ]] || continue
        step bench.log "criterion $(basename "$b")" 300 "$b" --bench
    done
fi

# ---- report (the tail is what comes back: summary last) ----------------------------------
for i in "${!failed_logs[@]}"; do
    echo
    echo "---- ${failed_logs[$i]}: last lines ----"
    tail -n 12 "$scratch/fail.$i" | cut -c1-200
done
if want bench && [[ -s $scratch/ours.json || -s $scratch/sdpa.json ]]; then
    echo
    python3 "$bundle/sdpa_bench.py" --compare "$scratch/ours.json" "$scratch/sdpa.json" 2>&1 | tail -n 40
fi
# The benchmarks' JSON rides at the end of their logs (the machine returns 8 files).
for pair in bench.log:ours bench.log:sdpa decode.log:decode_ours decode.log:decode_ours_e4m3 \
    decode.log:decode_sdpa; do
    json="$scratch/${pair#*:}.json"
    if [[ -s $json ]]; then
        printf '\n===== %s.json\n' "${pair#*:}" >>"$OUT/${pair%%:*}"
        cat "$json" >>"$OUT/${pair%%:*}"
    fi
done
{
    echo
    echo "==== flashcore gpu run summary ($((SECONDS - t_start))s; logs in $OUT) ===="
    printf '%-7s %4s %6s  %-13s %s\n' status exit time log step
    for i in "${!names[@]}"; do
        printf '%s  %s\n' "${results[$i]}" "${names[$i]}"
    done
    echo "ok: $n_ok  failed: $n_fail  skipped: $n_skip"
} | tee "$OUT/summary.txt"
((n_fail == 0 && n_skip == 0))
RUN_SH
chmod +x "$bundle/run.sh"

echo >&2
cat "$bundle/manifest.txt" >&2
size=$(du -sb "$bundle" | cut -f1)
echo "gpu-bundle: $((size / 1024 / 1024)) MiB in $bundle" >&2
if ((size > 60 * 1024 * 1024)); then
    echo "gpu-bundle: warning: over 60 MiB (a carried path is limited to 64 MiB in all)" >&2
fi
echo "gpu-bundle: on the GPU machine, from the repository root: bash gpu-bundle/run.sh" >&2
