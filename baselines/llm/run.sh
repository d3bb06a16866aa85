#!/usr/bin/env bash
# Run upstream's test/llm/test_llm_objectives.py offline and compare its passes with a stock list.
#
# Usage: run.sh PYTHON OUTDIR     (MIRROR=<pytorch/rl git dir> required)
#   PYTHON  interpreter whose site-packages holds the torchrl under test, with
#           transformers, 'pytest<10' and pytest-timeout installed
#   OUTDIR  where log.txt, outcomes.tsv, pass.txt, fail.txt, skip.txt, regressions.txt go
# Env: MIRROR (or TORCHRL_FORK_RL_GIT); BASELINE, the stock pass list to compare with
# (default: torchrl-0.14.1.txt beside this script; empty: no comparison); TESTROOT, where the
# test tree is extracted (default ${TMPDIR:-/tmp}/upstream_tests_llm, outside this repository).
# Exits non-zero when a test of BASELINE does not pass, or when pytest collected nothing.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:?python interpreter}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # pytest runs from TESTROOT
OUT=${2:?output dir}
MIRROR=${MIRROR:-${TORCHRL_FORK_RL_GIT:-}}
[ -d "$MIRROR" ] || { echo "set MIRROR to a pytorch/rl git directory" >&2; exit 2; }
BASELINE=${BASELINE-$HERE/torchrl-0.14.1.txt}
if [ -n "$BASELINE" ]; then  # absolute: the run happens in TESTROOT
  [ -f "$BASELINE" ] || { echo "no baseline file $BASELINE" >&2; exit 2; }
  BASELINE=$(cd "$(dirname "$BASELINE")" && pwd)/$(basename "$BASELINE")
fi
TESTROOT=${TESTROOT:-${TMPDIR:-/tmp}/upstream_tests_llm}
# The pytorch/rl commit this project pins (torchrl_fork/bases.json, repo_files).
COMMIT=ae9719f17b1517af5c2523a36c4616f003ee55cf
TEST=test/llm/test_llm_objectives.py

if [ ! -f "$TESTROOT/$TEST" ]; then
  mkdir -p "$TESTROOT"
  git --git-dir="$MIRROR" archive "$COMMIT" test pytest.ini | tar -x -C "$TESTROOT" || exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# From TESTROOT: a torchrl.egg-info in the caller's directory would misreport the version.
cd "$TESTROOT" || exit 2
"$PY" -c "import torch, torchrl, transformers; print('torch', torch.__version__, 'torchrl', torchrl.__version__, torchrl.__file__, 'transformers', transformers.__version__)" \
  | tee "$OUT/versions.txt" || exit 2

start=$SECONDS
# Offline: the two tokenizers come from offline_tokenizers.py; anything else that reaches for
# the hub fails instead of downloading. Only our plugins go on PYTHONPATH: torchrl comes from
# PYTHON's site-packages. One process: the 72 tests take about two minutes on 2 cores.
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 \
  PYTHONPATH="$HERE" LLM_OUTCOMES="$OUT/outcomes.tsv" \
  "$PY" -m pytest "$TEST" -p offline_tokenizers -p record_outcomes -p no:cacheprovider \
  -q --timeout 300 > "$OUT/log.txt" 2>&1
rc=$?
wall=$((SECONDS - start))

[ -s "$OUT/outcomes.tsv" ] || { echo "no test ran (pytest exit $rc), see $OUT/log.txt" >&2; exit 1; }
awk -F'\t' '$1 == "passed" {print $2}' "$OUT/outcomes.tsv" | LC_ALL=C sort > "$OUT/pass.txt"
awk -F'\t' '$1 == "failed" || $1 == "error" {print $2}' "$OUT/outcomes.tsv" | LC_ALL=C sort > "$OUT/fail.txt"
awk -F'\t' '$1 == "skipped" || $1 == "xfailed" {print $2}' "$OUT/outcomes.tsv" | LC_ALL=C sort > "$OUT/skip.txt"
printf 'passed %s, skipped %s, failed %s, wall %ss (pytest exit %s)\n' \
  "$(wc -l < "$OUT/pass.txt")" "$(wc -l < "$OUT/skip.txt")" "$(wc -l < "$OUT/fail.txt")" "$wall" "$rc" \
  | tee "$OUT/summary.txt"

[ -n "$BASELINE" ] || exit 0
LC_ALL=C comm -23 "$BASELINE" "$OUT/pass.txt" > "$OUT/regressions.txt"
echo "$(wc -l < "$OUT/regressions.txt") of $(wc -l < "$BASELINE") tests passing in $(basename "$BASELINE") do not pass here" \
  | tee -a "$OUT/summary.txt"
sed 's/^/  regression: /' "$OUT/regressions.txt"
[ ! -s "$OUT/regressions.txt" ]
