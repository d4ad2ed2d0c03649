#!/usr/bin/env bash
# Nsight Compute on one forward-kernel configuration, summarised.
#
#   scripts/profile.sh [--bin PATH] [flashcore run options...]
#   e.g. scripts/profile.sh --batch 4 --heads 16 --seqlen 4096 --head-dim 128 --causal
#
# Runs `flashcore run` once under ncu (clock control off: the card's clocks are left as
# they are), profiles the first flashcore kernel launch, and prints tensor-pipe
# utilisation, achieved DRAM bandwidth, occupancy and the top stall reasons.
# Needs ncu on PATH (or /usr/local/cuda/bin) and a GPU; writes the raw CSV next to it.
set -euo pipefail

bin=""
if [[ "${1:-}" == "--bin" ]]; then bin="$2"; shift 2; fi
if [[ -z "$bin" ]]; then
    for c in ./flashcore ./gpu-bundle/bin/flashcore ./target/release/flashcore; do
        [[ -x "$c" ]] && { bin="$c"; break; }
    done
fi
[[ -x "$bin" ]] || { echo "profile.sh: no flashcore binary (build with cargo build --release or pass --bin)" >&2; exit 2; }
export PATH="$PATH:/usr/local/cuda/bin"
command -v ncu >/dev/null || { echo "profile.sh: ncu not found" >&2; exit 2; }

csv="${PROFILE_CSV:-${OUT:-.}/ncu.csv}"
metrics=(
    gpu__time_duration.sum
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
    sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active
    dram__bytes.sum.per_second
    dram__throughput.avg.pct_of_peak_sustained_elapsed
    sm__warps_active.avg.pct_of_peak_sustained_active
    sm__maximum_warps_per_active_cycle_pct
    launch__registers_per_thread
    launch__occupancy_limit_registers
    launch__occupancy_limit_shared_mem
    l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
)
# The stall breakdown: average warps stalled per issued instruction, by reason.
stall='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'

ncu --clock-control none --kernel-name regex:attn_ --launch-count 1 --csv --page raw \
    --metrics "$(IFS=,; echo "${metrics[*]}"),$stall" \
    "$bin" run --iters 0 "$@" > "$csv"

python3 - "$csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
head, units, data = rows[start], rows[start + 1], rows[start + 2]
m = {h: (v, u) for h, u, v in zip(head, units, data)}
def get(name):
    v, u = m.get(name, ("n/a", ""))
    return f"{v} {u}".strip()
print(f"kernel: {m['Kernel Name'][0]}")
print(f"  duration:               {get('gpu__time_duration.sum')}")
print(f"  tensor pipe active:     {get('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active')}")
print(f"  tensor inst issued:     {get('sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active')}")
print(f"  DRAM bandwidth:         {get('dram__bytes.sum.per_second')} ({get('dram__throughput.avg.pct_of_peak_sustained_elapsed')} of peak)")
print(f"  achieved occupancy:     {get('sm__warps_active.avg.pct_of_peak_sustained_active')} (theoretical {get('sm__maximum_warps_per_active_cycle_pct')})")
print(f"  registers/thread:       {get('launch__registers_per_thread')} (block limit by registers {get('launch__occupancy_limit_registers')}, by smem {get('launch__occupancy_limit_shared_mem')})")
print(f"  smem bank conflicts:    {get('l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum')}")
stalls = []
for name, (v, _) in m.items():
    if name.startswith("smsp__average_warps_issue_stalled_"):
        try:
            stalls.append((float(v.replace(",", "")), name[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")]))
        except ValueError:
            pass
print("  top stall reasons (warps stalled per issued instruction):")
for v, name in sorted(stalls, reverse=True)[:6]:
    print(f"    {name:<24} {v:.3f}")
PY
