#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, one command that measures what only a GPU can,
# within 8 minutes (each step has its own timeout; they add up to 480 s), and writes one JSON
# summary:
#
#   1. install      what is missing of the project's requirements (pyproject.toml: its
#                   dependencies and the test and model extras, torch aside), and a CUDA build of
#                   torch 2.13.0 when the installed one has no CUDA (never on a machine without a
#                   GPU; WHEELS=DIR: from carried wheels only, for a machine that reaches no
#                   package registry; `--requirements` prints the list to fetch them by);
#   2. gpu_tests    the tests marked `gpu` (pytest -m gpu);
#   3. transfer     benchmarks/bench_transfer.py at 256 MiB, pages 16 and 64: the copy through the
#                   transfer actor vs one contiguous copy (vs_contig) and vs index_select/index_copy_;
#   4. e2e          the end-to-end differential test of every tier on CUDA (HICACHE_TEST_DEVICE=cuda);
#   5. serving      benchmarks/bench_serving.py --quick with the tiny model and the device pool on
#                   CUDA (the CUDA copy engine moves the KV);
#   6. load_latency benchmarks/bench_load_latency.py: admit of a host-cached prefix -> each layer
#                   ready vs one contiguous pinned copy, Llama-3-8B KV geometry, idle and busy;
#   7. serving_8b   bench_serving.py --quick with the Llama-3-8B-size random model (bf16).
#
#   scripts/gpu_check.sh [--cpu-dry-run] [SUMMARY.json]     (default: $OUT/gpu_check.json)
#   scripts/gpu_check.sh --requirements                     (print what `install` would need)
#
# --cpu-dry-run runs every step but the install and the 8B-size model on CPU with tiny sizes
# (what CI's slow set does, tests/e2e/test_gpu_check.py, so that the script cannot rot). PYTHON
# picks the interpreter (default: .venv/bin/python, else python3). Each step's log is kept beside
# the summary, which also records the project's commit ("unknown" unless the project directory
# is itself a git checkout: never the commit of a repository that happens to enclose it).
set -u
cd "$(dirname "$0")/.."

MODE=gpu
SUMMARY=""
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

# requirements: every requirement of pyproject.toml (dependencies, test and model extras) but
# torch, one a line; with --missing only those not installed at a version they accept
requirements() {
  "$PY" - "$@" <<'PYEOF'
import sys, tomllib
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it wherever pip is
    from pip._vendor.packaging.requirements import Requirement
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
specs = list(project["dependencies"])
for extra in ("test", "model"):
    specs += project.get("optional-dependencies", {}).get(extra, [])
for spec in specs:
    req = Requirement(spec)
    if req.name == "torch" or (req.marker is not None and not req.marker.evaluate()):
        continue
    if "--missing" in sys.argv:
        try:
            if req.specifier.contains(metadata.version(req.name), prereleases=True):
                continue
        except metadata.PackageNotFoundError:
            pass
    print(str(req).split(";")[0].strip())
PYEOF
}

for arg in "$@"; do
  case "$arg" in
    --cpu-dry-run) MODE=cpu ;;
    --requirements) requirements; exit $? ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
    *) SUMMARY=$arg ;;
  esac
done
if [ -z "$SUMMARY" ]; then
  if [ -z "${OUT:-}" ]; then echo "gpu_check: give the summary's path or set OUT" >&2; exit 2; fi
  SUMMARY="$OUT/gpu_check.json"
fi
mkdir -p "$(dirname "$SUMMARY")"
LOGS="${SUMMARY%.json}.logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
STEPS="$LOGS/steps.tsv"
: > "$STEPS"
# the project's own commit: only where the project directory is a git top level itself
COMMIT=unknown
if [ "$(git -C "$PWD" rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
  COMMIT=$(git -C "$PWD" rev-parse HEAD 2>/dev/null || echo unknown)
  if [ "$COMMIT" != unknown ] && [ -n "$(git -C "$PWD" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    COMMIT="$COMMIT-dirty"
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
WHEELS=${WHEELS:-}

# step NAME TIMEOUT_S COMMAND...: run it under its timeout, log its output, note rc and seconds
step() {
  local name=$1 limit=$2 t0 t1 rc
  shift 2
  t0=$(date +%s%N)
  timeout --kill-after=5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( (t1 - t0) / 1000000 ))e-3" "$limit" >> "$STEPS"
  echo "gpu_check: $name rc=$rc ($(tail -n 1 "$LOGS/$name.log" | cut -c1-120))" >&2
}
skip() { printf '%s\tskipped\t0\t0\t%s\n' "$1" "$2" >> "$STEPS"; }

install() {
  # offline machines (a lent GPU reaches no registry): WHEELS names a folder of carried wheels
  local pip=("$PY" -m pip install -q)
  if [ -n "${WHEELS:-}" ]; then pip+=(--no-index --find-links "$WHEELS"); fi
  local missing rc=0
  missing=$(requirements --missing) || return 1
  if [ -n "$missing" ]; then
    echo "installing:" $missing
    # (one requirement a line: a version range stays one argument)
    mapfile -t reqs <<< "$missing"
    if ! "${pip[@]}" "${reqs[@]}"; then
      # one that cannot be had (no carried wheel) must not keep the others out
      local req failed=""
      for req in "${reqs[@]}"; do "${pip[@]}" "$req" || failed="$failed $req"; done
      if [ -n "$failed" ]; then echo "could not install:$failed"; rc=1; fi
    fi
  fi
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    # a torch without CUDA on a GPU machine: the CUDA build of the torch this project pins
    # (PyPI's Linux wheel bundles its CUDA runtime); a CUDA torch already there is kept
    echo "installing the CUDA build of torch 2.13.0"
    "${pip[@]}" --force-reinstall --no-deps "torch==2.13.0" || return 1
  fi
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch has no usable CUDA device'; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" || return 1
  return $rc
}

if [ "$MODE" = gpu ]; then
  if ! command -v nvidia-smi > /dev/null || ! nvidia-smi > "$LOGS/nvidia-smi.log" 2>&1; then
    echo "gpu_check: no CUDA GPU here (nvidia-smi); use --cpu-dry-run on CPU" >&2
    exit 3
  fi
  export PY WHEELS; export -f install requirements
  # (limits: measured on an H200 install 8 s, gpu_tests 34 s, e2e 28 s, serving 41 s; the rest
  # estimated from their sizes, docs/BENCHMARKS.md "The GPU check")
  step install 60 bash -c install
  step gpu_tests 60 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests
  step transfer 75 "$PY" benchmarks/bench_transfer.py --mib 256 --page-sizes 16,64 --shapes args --repeats 5
  step e2e 60 env HICACHE_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/e2e/test_differential_tiers.py
  step serving 60 "$PY" benchmarks/bench_serving.py --quick --device cuda
  step load_latency 90 "$PY" benchmarks/bench_load_latency.py --device cuda --repeats 6
  step serving_8b 75 "$PY" benchmarks/bench_serving.py --quick --device cuda --model 8b
else  # the same steps on CPU, tiny: the script and every command it runs still work
  skip install "cpu dry run: nothing is installed"
  step gpu_tests 60 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/unit/transfer
  step transfer 60 "$PY" benchmarks/bench_transfer.py --quick --mib 1 --page-sizes 16 --layouts page_first --shapes args
  step e2e 120 env HICACHE_TEST_DEVICE=cpu "$PY" -m pytest -q -p no:cacheprovider tests/e2e/test_differential_tiers.py
  step serving 120 "$PY" benchmarks/bench_serving.py --device cpu --convs 16 --turns 2 --active 2 --system 16 --user 16 \
    --reply 8 --configs no_reuse device_host
  step load_latency 60 "$PY" benchmarks/bench_load_latency.py --device cpu --layers 2 --tokens 64 --device-slots 512 \
    --repeats 2
  skip serving_8b "cpu dry run: the 8B-size model needs a GPU"
fi

"$PY" - "$MODE" "$STEPS" "$LOGS" "$SUMMARY" "$COMMIT" <<'PYEOF'
import json, platform, sys
from pathlib import Path

mode, steps_path, logs, summary, commit = sys.argv[1:]
steps = []
for line in Path(steps_path).read_text().splitlines():
    name, rc, seconds, limit, *why = line.split("\t")
    log = Path(logs) / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    row = {"step": name, "log": str(log) if log.exists() else None}
    if rc == "skipped":
        row.update(status="skipped", why=why[0] if why else "")
    else:
        row.update(status="ok" if rc == "0" else "timeout" if rc in ("124", "137") else "failed",
                   rc=int(rc), seconds=round(float(seconds), 1), timeout_s=int(limit))
    results = [l for l in text.splitlines() if l.startswith("{")]
    if results:  # a benchmark's last line: its JSON record
        try:
            row["result"] = json.loads(results[-1])
        except json.JSONDecodeError:
            pass
    tail = [l for l in text.splitlines() if l.strip()]
    if tail and "result" not in row:
        row["tail"] = tail[-1][:300]
    steps.append(row)
try:
    import torch
    torch_info = {"version": torch.__version__, "cuda": torch.version.cuda,
                  "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
except Exception as exc:  # noqa: BLE001 - the summary says why
    torch_info = {"error": repr(exc)}
out = {"check": "gpu_check", "mode": mode, "commit": commit, "machine": platform.node() and platform.machine(),
       "torch": torch_info,
       "ok": all(s["status"] in ("ok", "skipped") for s in steps),
       "seconds": round(sum(s.get("seconds", 0) for s in steps), 1), "steps": steps}
Path(summary).write_text(json.dumps(out, indent=1, sort_keys=True))
print(json.dumps({"ok": out["ok"], "seconds": out["seconds"], "summary": summary,
                  "steps": {s["step"]: s["status"] for s in steps}}))
PYEOF
