#!/usr/bin/env bash
# Issue 31's check of `make demo`: N fresh calibrations, each followed by M runs of the plan priced on it.
#
# For each calibration: `parsat calibrate --machine this-box --nproc 2` (afresh), `parsat optimize mlp
# --devices 2` on it, then M x `parsat run PLAN --nproc 2 --steps STEPS --check --json`. One line per run:
# the prediction, the measured step (median over the steps after the first, each step the slowest rank's),
# its middle half, measured / predicted, each rank's median CPU seconds a step and the CPU over the
# prediction, and the 1-minute load before the run. The ratio is a verdict only on a quiet box (load
# near the demo's own 2); the CPU column is what the step cost the ranks whatever else ran. Then a summary:
# the predictions' spread over the calibrations, the measured steps' spread, and how many runs were within
# 25% of their prediction. Before each calibration's runs, a line with its small collectives as it timed them
# (all-reduce and all-gather of 2 KB and 32 KB on the 2 ranks: the demo's step has one all-reduce of 10 KB)
# and the plan's exposed communication as priced on it.
#
#   N=3 M=3 benchmarks/demo_check.sh          # from the repository root, after `make setup`
#
# Run it lowered on a shared box: setsid bash -c 'echo 19 > /proc/self/autogroup; nice -n 19 benchmarks/demo_check.sh'
set -euo pipefail
N=${N:-3}
M=${M:-3}
STEPS=${STEPS:-20}
BIN=${BIN:-.venv/bin}
PARSAT=${PARSAT:-$BIN/parsat}   # e.g. PARSAT="env PYTHONPATH=/path/to/other/tree .venv/bin/python -m parsat"
DIR=${DIR:-out/demo_check}
mkdir -p "$DIR"
load() { cut -d' ' -f1 /proc/loadavg; }
rows="$DIR/rows.tsv"
: > "$rows"
printf '%-4s %-4s %6s %10s %10s %21s %7s %17s %8s\n' cal run load predicted measured "middle half" ratio "CPU r0/r1" CPU/pred
for i in $(seq 1 "$N"); do
  machine="$DIR/machine-$i.json"
  plan="$DIR/plan-$i.json"
  cal_load=$(load)
  $PARSAT calibrate --machine this-box --nproc 2 -o "$machine" > "$DIR/calibrate-$i.log"
  $PARSAT optimize mlp --devices 2 --machine "$machine" -o "$plan" > "$DIR/optimize-$i.log"
  "$BIN/python" - "$DIR/calibrate-$i.log" "$DIR/optimize-$i.log" "$i" "$cal_load" <<'EOF'
import re, sys
timed = {}
for line in open(sys.argv[1]):
    m = re.match(r"\s+(all_reduce|all_gather)\s+2 ranks, ([\d,]+) B\s+([\d.]+) ms", line)
    if m:
        timed[m.group(1), int(m.group(2).replace(",", ""))] = m.group(3)
exposed = next((line.split()[5:7] for line in open(sys.argv[2]) if line.split()[:1] == ["parsat"]), ["?", ""])
print(f"calibration {sys.argv[3]} (load {sys.argv[4]}): all-reduce 2 KB {timed.get(('all_reduce', 2048), '?')} ms, "
      f"32 KB {timed.get(('all_reduce', 32768), '?')} ms; all-gather 2 KB {timed.get(('all_gather', 2048), '?')} ms, "
      f"32 KB {timed.get(('all_gather', 32768), '?')} ms; the plan's exposed communication {' '.join(exposed)}")
EOF
  for j in $(seq 1 "$M"); do
    run_load=$(load)
    $PARSAT run "$plan" --nproc 2 --steps "$STEPS" --check --json > "$DIR/run-$i-$j.log"
    tail -n 1 "$DIR/run-$i-$j.log" | "$BIN/python" -c '
import json, sys
d = json.loads(sys.stdin.read())
i, j, load, cal_load = sys.argv[1:5]
pred, meas = d["step_time_predicted_s"], d["step_time_s"]
low, high = d.get("step_time_quartiles_s", (float("nan"),) * 2)   # older trees: the median alone
cpu = d.get("step_cpu_s_by_rank", (float("nan"),) * 2)
assert d["check"] == "passed", d["check"]
print(f"{i:<4s} {j:<4s} {load:>6s} {pred*1e3:7.3f} ms {meas*1e3:7.3f} ms {low*1e3:7.3f}-{high*1e3:7.3f} ms "
      f"{meas/pred:7.2f} {cpu[0]*1e3:6.3f}/{cpu[1]*1e3:6.3f} ms {max(cpu)/pred:8.2f}")
with open(sys.argv[5], "a") as out:
    out.write(f"{i}\t{j}\t{load}\t{cal_load}\t{pred}\t{meas}\t{max(cpu)}\n")
' "$i" "$j" "$run_load" "$cal_load" "$rows"
  done
done
"$BIN/python" - "$rows" <<'EOF'
import sys
rows = [line.split("\t") for line in open(sys.argv[1]) if line.strip()]
pred = sorted({float(r[4]) for r in rows})
meas = [float(r[5]) for r in rows]
ratios = [float(r[5]) / float(r[4]) for r in rows]
cpu = [float(r[6]) / float(r[4]) for r in rows if float(r[6]) == float(r[6])] or [float("nan")]
within = sum(abs(x - 1) <= 0.25 for x in ratios)
print(f"predictions {min(pred)*1e3:.3f}-{max(pred)*1e3:.3f} ms ({max(pred)/min(pred):.2f}x apart over {len(pred)} "
      f"calibrations); measured {min(meas)*1e3:.3f}-{max(meas)*1e3:.3f} ms ({max(meas)/min(meas):.2f}x); "
      f"measured / predicted {min(ratios):.2f}-{max(ratios):.2f}, {within} of {len(rows)} within 25%; "
      f"slowest rank's CPU / predicted {min(cpu):.2f}-{max(cpu):.2f}; load {min(float(r[2]) for r in rows):.2f}-"
      f"{max(float(r[2]) for r in rows):.2f}")
EOF
