#!/usr/bin/env bash
# The H200 run of the CUDA restore path (issue 27), after shared/gpu's install:
#   bench/cuda_restore_run.sh stagingtests hosttier probe procprobe throughput8k   # one call
#   bench/cuda_restore_run.sh throughput32k recompute                   # the next
#   bench/cuda_restore_run.sh restore32k      # 32k: restore rows and limits only
#   bench/cuda_restore_run.sh tests
#   bench/cuda_restore_run.sh servehost   # the host tier serving an evicted conversation
#   bench/cuda_restore_run.sh servetests e2e   # persist serve end to end against mlx_lm.server
#   bench/cuda_restore_run.sh e2efull          # the same with 6 sessions x 3 turns
#   bench/cuda_restore_run.sh serveprobe       # where a serve hit's time goes, in one process
#   bench/cuda_restore_run.sh pagetests contention e2efull   # round 5: the copy engine's host tier
#   bench/cuda_restore_run.sh copyprobe missvariants   # round 5, session 15: the direct path's copies
# Everything it writes goes to $OUT (probe report, logs, bench results).
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/persist-out}
mkdir -p "$OUT"
TESTS="tests/engine/test_staging.py tests/engine/test_no_kernel_path.py tests/engine/test_roundtrip_models.py tests/engine/test_host_tier_cuda.py
  tests/engine/test_partial_reads.py tests/engine/test_backend.py tests/engine/test_costs.py
  tests/codecs/test_trim_exact.py tests/engine/test_store.py"
for phase in "$@"; do
  case $phase in
  probe)
    timeout 200 python3 -m bench.cuda_stage_probe "$OUT" 8192 2>&1 | tail -20 ;;
  copyprobe)
    # the direct restore's copies: strided, per row, batched; and inside a restore
    PERSIST_DIRECT_COPIES=batched timeout 240 python3 -m bench.cuda_copy_probe "$OUT" 2>&1 | tail -24
    PERSIST_DIRECT_COPIES=batched timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/engine/test_no_kernel_path.py \
      tests/engine/test_batched_copies.py 2>&1 | tee "$OUT/cuda-direct-tests.log" | tail -4 ;;
  procprobe)
    timeout 200 python3 -m bench.cuda_proc_probe "$OUT" 8192 2>&1 | tail -8 ;;
  hosttier)
    timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/engine/test_host_tier_cuda.py \
      tests/engine/test_host_tier_pages.py 2>&1 | tee "$OUT/cuda-host-tier-tests.log" | tail -5 ;;
  throughput8k)
    timeout 300 python3 -m bench.bench_throughput --reps 3 \
      --cases llama3-8b:8192 2>&1 | tee "$OUT/throughput8k.log"
    cp bench/results/throughput-cuda-llama3-8b8192.* "$OUT/" ;;
  throughput)
    timeout 380 python3 -m bench.bench_throughput --reps 3 \
      --cases llama3-8b:1024 llama3-8b:8192 qwen3-next:8192 2>&1 | tee "$OUT/throughput.log"
    cp bench/results/throughput-cuda-llama3-8b1024-llama3-8b8192-qwen3-next8192.* "$OUT/" ;;
  throughput32k)
    timeout 230 python3 -m bench.bench_throughput --reps 2 \
      --cases llama3-8b:32768 2>&1 | tee "$OUT/throughput32k.log"
    cp bench/results/throughput-cuda-llama3-8b32768.* "$OUT/" ;;
  restore32k)
    # the restore rows and their limits only: the whole 32k case runs past 230 s
    timeout 200 python3 -m bench.bench_throughput --reps 2 --restore-only \
      --cases llama3-8b:32768 2>&1 | tee "$OUT/restore32k.log"
    cp bench/results/throughput-cuda-llama3-8b32768-restore.* "$OUT/" ;;
  directcheck)
    # the direct restore's tests (bit for bit against the host path), then first calls
    timeout 140 python3 -m pytest -q -rfEs -p no:cacheprovider tests/engine/test_no_kernel_path.py \
      tests/engine/test_staging.py -k "direct or staged or kernel or address or zeroed or strided" \
      2>&1 | tee "$OUT/cuda-direct-tests.log" | tail -5
    timeout 170 python3 -m bench.cuda_first_call --out "$OUT" 2>&1 | tail -5 ;;
  pagetests)
    # the copy engine's host tier and row-by-row save reads (bit for bit), round trips
    timeout 170 python3 -m pytest -q -rfEs -p no:cacheprovider tests/engine/test_host_tier_cuda.py \
      tests/format/test_readback.py tests/engine/test_page_copies.py tests/engine/test_no_kernel_path.py \
      tests/engine/test_roundtrip_models.py 2>&1 | tee "$OUT/cuda-page-tests.log" | tail -5 ;;
  contention)
    # a miss right after another request against one after persist went idle
    timeout 170 python3 -m bench.cuda_serve_contention --n 3 --out "$OUT" 2>&1 | tail -4 ;;
  contention2)
    # the same, Python's default switch interval against 0.5 ms, py-spy on the GIL holder
    python3 -c "from persist.apps.demo import make_model; from bench.bench_e2e import SHAPES; make_model('/tmp/cmodel', 'llama', overrides=SHAPES['llama3-8b'])" >/dev/null 2>&1 || true
    # CONTENTION_SI: the switch intervals to run ("default" for Python's own)
    for si in ${CONTENTION_SI:-default 0.0005}; do
      [ "$si" = default ] && si=""
      timeout 200 python3 -m bench.cuda_serve_contention --n 3 --model /tmp/cmodel --out "$OUT" \
        --pyspy /tmp/site/bin/py-spy ${si:+--switch-interval $si} 2>&1 | tail -4
    done ;;
  directtests)
    timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider tests/engine/test_staging.py \
      tests/engine/test_no_kernel_path.py tests/engine/test_host_tier_cuda.py 2>&1 | tee "$OUT/cuda-direct-tests.log" | tail -5 ;;
  stagingtests)
    timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/engine/test_staging.py 2>&1 | tee "$OUT/cuda-staging-tests.log" ;;
  tests)
    # shellcheck disable=SC2086
    timeout 560 python3 -m pytest -q -rfEs -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/cuda-tests.log" ;;
  servehost)
    timeout 300 python3 -m bench.bench_serve_host --reps 3 --name serve-host-cuda 2>&1 | tail -12
    cp bench/results/serve-host-cuda.* "$OUT/" ;;
  e2e)
    # persist serve against plain mlx_lm.server, Llama-3-8B shape, ~8k-token system prompt
    rm -rf /tmp/e2e-logs && mkdir -p /tmp/e2e-logs
    E2E_PYSPY=/tmp/site/bin/py-spy timeout 500 python3 -m bench.bench_e2e --quick --shape llama3-8b --system-words 1700 \
      --misses 12 --out cuda --logs /tmp/e2e-logs 2>&1 | tee "$OUT/e2e.log" | tail -30
    tar czf "$OUT/e2e-logs.tgz" -C /tmp e2e-logs
    cp bench/results/e2e-cuda.* "$OUT/" ;;
  servetest)
    # the host tier's serve test, its servers' logs kept (round 5: a partial hit on the H100)
    rm -rf /tmp/pytest-of-* /tmp/bt
    timeout 240 python3 -m pytest -q -rfEs -p no:cacheprovider --basetemp=/tmp/bt \
      tests/engine/test_host_tier_cuda.py tests/engine/test_no_kernel_path.py 2>&1 | tee "$OUT/cuda-servetest.log" | tail -8
    (cd /tmp && find bt -name '*.log' | tar czf "$OUT/servetest-logs.tgz" -T -) ;;
  e2efull)
    # the same, 6 sessions x 3 turns: more requests per phase
    # a model contention2 made is reused (its making is not part of the run); the logs
    # folder is emptied first (requests.jsonl is appended to)
    rm -rf /tmp/e2e-logs && mkdir -p /tmp/e2e-logs
    E2E_PYSPY=/tmp/site/bin/py-spy timeout 470 python3 -m bench.bench_e2e --shape llama3-8b --system-words 1700 \
      $( [ -f /tmp/cmodel/config.json ] && echo --model /tmp/cmodel ) \
      --misses 12 --out cuda --logs /tmp/e2e-logs 2>&1 | tee "$OUT/e2e.log" | tail -30
    tar czf "$OUT/e2e-logs.tgz" -C /tmp e2e-logs  # one file: a call brings back 8 at most
    cp bench/results/e2e-cuda.* "$OUT/" ;;
  missvariants)
    # what a miss pays beside plain with persist's host tier off, then on (issue 39;
    # MISS_VARIANTS=host: the default only):
    # quick workloads on one model made once (its making is not part of either run)
    [ -f /tmp/cmodel/config.json ] || python3 -c "from persist.apps.demo import make_model; from bench.bench_e2e import SHAPES; make_model('/tmp/cmodel', 'llama', overrides=SHAPES['llama3-8b'])" >/dev/null 2>&1
    for v in ${MISS_VARIANTS:-nohost host}; do
      rm -rf "/tmp/e2e-$v" && mkdir -p "/tmp/e2e-$v"
      E2E_PERSIST_ARGS=$( [ "$v" = nohost ] && echo "--host-cache 0" ) timeout 200 python3 -m bench.bench_e2e \
        --quick --shape llama3-8b --system-words 1700 --model /tmp/cmodel --misses 8 \
        --out "cuda-$v" --logs "/tmp/e2e-$v" 2>&1 | tail -14
      cp bench/results/e2e-cuda-$v.* "$OUT/"
    done
    (cd /tmp && tar czf "$OUT/miss-logs.tgz" e2e-nohost e2e-host 2>/dev/null) ;;
  servetests)
    timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/serve/test_quiet_requests.py \
      2>&1 | tee "$OUT/cuda-serve-tests.log" | tail -5 ;;
  serveprobe)
    timeout 200 python3 -m bench.cuda_serve_probe --out "$OUT" 2>&1 | tail -40 ;;
  firstcall)
    timeout 300 python3 -m bench.cuda_first_call --out "$OUT" 2>&1 | tail -20 ;;
  recompute)
    timeout 170 python3 -m bench.bench_recompute --lengths 1024 2048 8192 2>&1 | tee "$OUT/recompute.log"
    cp bench/results/recompute-cuda.md bench/results/recompute-cuda.json "$OUT/" ;;
  esac
done
