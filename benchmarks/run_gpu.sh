#!/usr/bin/env bash
# GPU stages in one process tree, each writing under DIR (default: all but ddp and grpo, in this order):
#   build   python -m segki_lightning.ops.build                  (the extension, JIT cache)
#   tests   pytest tests/gpu                                     (gpu_tests.log)
#   kernels benchmarks/kernels.py                                (kernels.json/md)
#   ab      benchmarks/kernels.py once per kernel switch, each alone (ab/<name>/kernels.json/md):
#           SEGKI_PDL=0 (plain launch order), SEGKI_GEMV_PREFETCH=0 / -1 (GEMV L2 warm-up none / the whole
#           K slice; default 2 KB per row), SEGKI_ATTN=batched (decode attention with batched softmax, twice
#           the splits)
#   pipe    benchmarks/kernels.py, the GEMV family at 1, 8 and 16 rows, plain and under SEGKI_GEMV_PIPE=0 (the
#           tensor-core GEMV with one stage of loads in flight instead of two; the GDN input projection runs one
#           stage at 9-16 rows either way; pipe/{two,one}_stage/kernels.json/md)
#   decode  benchmarks/decode.py, ours + HF eager at batch 1      (decode.json/md/png; HF compile: own call)
#   profile benchmarks/profile_step.py, 4B and 0.8B at batch 1, plain and under SEGKI_PDL=0 (the kernels one after
#           another: their times add up; profile_step*.json/md, profile_nopdl/)
#   barrier benchmarks/launch_vs_barrier.py: a phase boundary as a launch or a grid barrier (launch_vs_barrier/)
#   stream  benchmarks/bulk_stream.py: a block's copy-engine stream, bare and with GEMV products (bulk_stream/)
#   skinny  benchmarks/skinny.py: the skinny product (1-16 rows) vs cuBLAS and the GEMVs, 4B and 0.8B (skinny/)
#   timeline the stamping tests (skinny product, GDN recurrence), then benchmarks/step_timeline.py: each block's phases
#           of those kernels in one replayed decode step, 0.8B and 4B at 1 and 4 rows (timeline/b1/, timeline/b4/)
#   attn    benchmarks/kernels.py, decode attention over valid lengths in a 32k cache, plain and under
#           SEGKI_ATTN=batched (attn/{online,batched}/kernels.json/md)
#   joint   benchmarks/decode.py at 8, 16 and 32 rows, one cuBLAS product per packed projection group past the
#           native rows (default) and one per weight (SEGKI_JOINT=0) (joint/{packed,separate}/decode.json/md);
#           benchmarks/kernels.py's projections at those rows, with the packed rows (joint/kernels/)
#   gdn     the GDN step: its GPU tests, ncu_shapes.py's GDN step under Nsight Compute with warp stall reasons
#           (gdn/ncu.csv/md) and decode at 8, 16 and 32 rows (gdn/decode.json/md)
#   prefill benchmarks/decode.py, ours at 1 and 32 rows of one 128-token prompt: its prefill_s is the bucketed
#           prefill replayed as a CUDA graph (prefill/decode.json/md)
#   gdntrain the Gated-DeltaNet training path: its GPU tests, then benchmarks/gdn_train.py (one layer's forward +
#           backward per implementation at the 0.8B and 4B shapes; gdn_train/)
#   lora    the LoRA GPU tests (the lora_add kernel; fused LoRA rollouts under peft's composition and lora_add), then
#           benchmarks/lora_decode.py (4B: full weights and both LoRA paths at 1, 16 and 64 rows, transformers' eager
#           LoRA generate at 1; lora/)
#   loraprof benchmarks/profile_step.py --lora 16: the 4B decode step kernel by kernel, full weights beside a LoRA
#           policy (r=16 on every projection, lora_add), at 1, 16 and 64 rows, under SEGKI_PDL=0 (the kernels one
#           after another: their times add up; loraprof/b1/, b16/, b64/): where a LoRA step's extra time goes
#   loragrpo benchmarks/grpo_gpu.py with LoRA r=16 on every projection, 10 steps: 4B 64 rows x 512 and the 9B shape
#           32 x 512, or the cases LORA_CASES names (lora_grpo/4b/, lora_grpo/9b/; ~6 and ~5 minutes on a fresh
#           machine: one call each, LORA_CASES=4b:8x512:mb32:ckpt then LORA_CASES=9b:4x512:mb32:ckpt)
#   mixedprof benchmarks/profile_train.py, one 0.8B micro-batch (32 rows, checkpointing) at fixed length 1024 and at
#           10-100 % of it, packed (mixedprof/fixed/, mixedprof/mixed/): where packed mixed lengths lose per token
#   mixedab benchmarks/grpo_gpu.py, 0.8B 128 rows x 10-100 % of 1024: packed by token budget (34816, a padded
#           32-row micro-batch's tokens) against padded 32-row micro-batches, 8 steps of which 3 warm (fla's first
#           tuning), each autotuning printed into the runs' logs: none should follow the warm steps now that the q/k
#           L2 norm compiles once for every token count; per step the update, optimizer, collection pauses and
#           allocator counts in each row's *_by_step (mixed_ab/; ~6 minutes on a fresh machine)
#   grpo    benchmarks/grpo_gpu.py, segki vs off on one GPU, 0.8B 4 prompts x 8 x 256 tokens (grpo_gpu/)
#   scale   benchmarks/grpo_gpu.py, RL sizes: 0.8B 128 rows x 1024 tokens, 4B 64 rows x 512 (grpo_scale/)
#   reuse   benchmarks/grpo_gpu.py, num_iterations=2: clipping and the fused path's sampler/trainer mismatch (grpo_reuse/)
#   canonical  canon_decode then canon_train: the README's performance tables for the current tree (run it with
#           --out benchmarks/results/current, then python benchmarks/readme_tables.py)
#   canon_decode benchmarks/decode.py, ours and graph only at 1, 16, 32 and 64 rows, transformers' eager generate
#           at 1 and static cache + compile at 1 and 16 ($out/decode.json; ~9 minutes on a fresh H100, ~3 of them
#           transformers' compiles per model)
#   canon_train  benchmarks/grpo_gpu.py, segki, each case of readme_tables.CANONICAL_CASES, or those CANON_CASES
#           names (space-separated: the four take ~10 minutes on a fresh machine, more than one call's limit)
#           ($out/train/<case>/: grpo_gpu.py's output and log; each case's row merged into $out/train.json, which
#           the README's table reads and the repository keeps)
#   ddp     benchmarks/grpo_gpu.py, segki on 1 and 2 GPUs         (grpo_ddp/)
#   ddp4b   benchmarks/grpo_gpu.py, 4B shape on 2 GPUs under DDP, 10 steps, a dense reward and a KL term
#           (beta 0.04: the loss then follows the policy's drift from its start; grpo_ddp4b/)
#   fsdp4b  the same under FSDP (grpo_fsdp4b/), then compare_curves.py against grpo_ddp4b/ when it is there
#           (curves4b/: loss, KL, reward, gradient norm and entropy, step by step)
#   fsdp9b  benchmarks/grpo_gpu.py, 9B shape on 2 GPUs under FSDP (grpo_fsdp9b/)
#   ddp9b   the same under DDP: expected out of memory (grpo_ddp9b/)
# usage: bash benchmarks/run_gpu.sh --out DIR [stage ...]
set -uo pipefail
[[ ${1:-} == --out ]] || { echo "usage: $0 --out DIR [stage ...]"; exit 2; }
out=$2; shift 2
stages=("$@"); [[ ${#stages[@]} -gt 0 ]] || stages=(build tests kernels decode profile)
[[ " ${stages[*]} " == *" canonical "* ]] && stages=(build canon_decode canon_train)
mkdir -p "$out"
# TRITON_CACHE_AUTOTUNING: a later process on the same machine reuses flash-linear-attention's prefill autotuning
# (~60 s per model on a fresh machine) instead of repeating it; decode steps run no Triton kernel
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TRITON_CACHE_AUTOTUNING=1
for stage in "${stages[@]}"; do
  start=$(date +%s)
  case $stage in
    build)   python3 -m segki_lightning.ops.build > "$out/build.log" 2>&1 || { grep -m 20 error "$out/build.log"; exit 1; } ;;
    tests)   python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -8 ;;
    kernels) python3 benchmarks/kernels.py --out "$out" > "$out/kernels.log" 2>&1; tail -45 "$out/kernels.log" | cut -c1-110 ;;
    ab)      mkdir -p "$out/ab"
             for run in "no_pdl SEGKI_PDL=0 proj small attention" "prefetch_0 SEGKI_GEMV_PREFETCH=0 proj" \
                        "prefetch_all SEGKI_GEMV_PREFETCH=-1 proj" "attn_batched SEGKI_ATTN=batched attention"; do
               set -- $run; name=$1; setting=$2; shift 2
               env "$setting" python3 benchmarks/kernels.py --out "$out/ab/$name" --batches 1 16 32 --only "$@" \
                 > "$out/ab/$name.log" 2>&1
               echo "-- $setting"; grep -E "^\| (4b|0.8b)" "$out/ab/$name/kernels.md" | cut -c1-100
             done ;;
    pipe)    mkdir -p "$out/pipe"
             for run in "two_stage SEGKI_GEMV_PIPE=1" "one_stage SEGKI_GEMV_PIPE=0"; do
               set -- $run
               env "$2" python3 benchmarks/kernels.py --out "$out/pipe/$1" --batches 1 8 16 --only proj \
                 > "$out/pipe/$1.log" 2>&1 || tail -5 "$out/pipe/$1.log"
             done
             paste -d'|' <(grep -E "^\| (4b|0.8b)" "$out/pipe/two_stage/kernels.md" | cut -d'|' -f2-8) \
               <(grep -E "^\| (4b|0.8b)" "$out/pipe/one_stage/kernels.md" | cut -d'|' -f6-8) ;;
    decode)  python3 benchmarks/decode.py --out "$out" --hf-eager-batches 1 --hf-compile-batches > "$out/decode.log" 2>&1
             tail -32 "$out/decode.log" | cut -c1-160 ;;
    profile) python3 benchmarks/profile_step.py --out "$out" > "$out/profile.log" 2>&1
             SEGKI_PDL=0 python3 benchmarks/profile_step.py --out "$out/profile_nopdl" > "$out/profile_nopdl.log" 2>&1
             grep -E "^\| (4b|0.8b)" "$out/profile_nopdl/profile_step.md" | head -40 ;;
    barrier) python3 benchmarks/launch_vs_barrier.py --out "$out/launch_vs_barrier" > "$out/barrier.log" 2>&1
             tail -20 "$out/barrier.log" | cut -c1-160 ;;
    stream)  python3 benchmarks/bulk_stream.py --out "$out/bulk_stream" > "$out/stream.log" 2>&1
             grep -E "^\| " "$out/bulk_stream/bulk_stream.md" | cut -c1-110 ;;
    skinny)  python3 benchmarks/skinny.py --out "$out/skinny" > "$out/skinny.log" 2>&1 || tail -5 "$out/skinny.log"
             grep -E "^\| " "$out/skinny/skinny.md" | cut -d'|' -f2-13 ;;
    timeline) python3 -m pytest -q tests/gpu/test_skinny.py tests/gpu/test_kernels.py -k stamping -p no:cacheprovider \
               2>&1 | tail -1
             for b in 1 4; do
               python3 benchmarks/step_timeline.py --out "$out/timeline/b$b" --batch "$b" \
                 > "$out/timeline_b$b.log" 2>&1 || tail -5 "$out/timeline_b$b.log"
               grep -E "^\| (4b|0.8b)" "$out/timeline/b$b/step_timeline.md" | cut -c1-230
             done ;;
    attn)    for variant in online batched; do
               SEGKI_ATTN=$variant python3 benchmarks/kernels.py --out "$out/attn/$variant" --models 0.8b 4b \
                 --batches 1 --only attention --attn-valid 512 2048 8192 16384 32768 > "$out/attn_$variant.log" 2>&1
             done
             paste -d'|' <(grep -E "^\| (4b|0.8b)" "$out/attn/online/kernels.md" | cut -d'|' -f2-6) \
               <(grep -E "^\| (4b|0.8b)" "$out/attn/batched/kernels.md" | cut -d'|' -f6) ;;
    joint)   for run in "packed SEGKI_JOINT=1" "separate SEGKI_JOINT=0"; do
               set -- $run
               env "$2" python3 benchmarks/decode.py --out "$out/joint/$1" --batches 8 16 32 --hf-eager-batches \
                 --hf-compile-batches --no-graph-only > "$out/joint_$1.log" 2>&1 || tail -5 "$out/joint_$1.log"
               echo "-- $2"; grep -E "ours" "$out/joint/$1/decode.md" | cut -d'|' -f2,4,5,6,7
             done
             python3 benchmarks/kernels.py --out "$out/joint/kernels" --batches 8 16 32 --only proj \
               > "$out/joint_kernels.log" 2>&1 || tail -5 "$out/joint_kernels.log"
             grep -E "packed" "$out/joint/kernels/kernels.md" | cut -d'|' -f2-10 ;;
    gdn)     mkdir -p "$out/gdn"
             python3 -m pytest -q tests/gpu -k gdn -p no:cacheprovider > "$out/gdn/tests.log" 2>&1
             tail -1 "$out/gdn/tests.log"
             stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard \
               membar short_scoreboard wait lg_throttle mio_throttle drain math_pipe_throttle not_selected selected \
               no_instruction dispatch_stall)
             ncu --clock-control none --kernel-name regex:'spin|gdn_recurrent' --section SpeedOfLight \
               --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
               --metrics "${stalls%,}" --csv --page details \
               python3 benchmarks/ncu_shapes.py --cases 4b:16 0.8b:32 > "$out/gdn/ncu.csv" 2>/dev/null
             python3 benchmarks/ncu_shapes.py --table "$out/gdn/ncu.csv" --cases 4b:16 0.8b:32 > "$out/gdn/ncu.md"
             grep gdn_recurrent "$out/gdn/ncu.md" | cut -d'|' -f2-6
             python3 benchmarks/decode.py --out "$out/gdn" --batches 8 16 32 --hf-eager-batches --hf-compile-batches \
               --no-graph-only > "$out/gdn/decode.log" 2>&1
             grep -E "ours" "$out/gdn/decode.md" | cut -d'|' -f2,4,5,6,7 ;;
    prefill) python3 benchmarks/decode.py --out "$out/prefill" --batches 1 32 --hf-eager-batches --hf-compile-batches \
               --no-graph-only > "$out/prefill.log" 2>&1 || tail -5 "$out/prefill.log"
             python3 -c "import json, sys; [print(r['model'], r['batch'], r['mode'], 'prefill_s', r['prefill_s'])
                         for r in json.load(open(sys.argv[1])) if 'prefill_s' in r]" "$out/prefill/decode.json" ;;
    gdntrain) python3 -m pytest -q tests/gpu/test_gdn_training_gpu.py -p no:cacheprovider 2>&1 \
               | tee "$out/gdn_train_tests.log" | tail -3
             python3 benchmarks/gdn_train.py --out "$out/gdn_train" > "$out/gdn_train.log" 2>&1; tail -12 "$out/gdn_train.log" ;;
    lora)    python3 -m pytest -q tests/gpu/test_kernels.py tests/gpu/test_rollout_gpu.py -k lora -p no:cacheprovider \
               2>&1 | tee "$out/lora_tests.log" | tail -4
             python3 benchmarks/lora_decode.py --out "$out/lora" > "$out/lora_decode.log" 2>&1 \
               || tail -5 "$out/lora_decode.log"
             grep "^|" "$out/lora/lora_decode.md" ;;
    loraprof) for b in 1 16 64; do
               SEGKI_PDL=0 python3 benchmarks/profile_step.py --out "$out/loraprof/b$b" --models 4b --batch "$b" \
                 --lora 16 > "$out/loraprof_b$b.log" 2>&1 || tail -5 "$out/loraprof_b$b.log"
               grep -E "^\| 4b .*\((step|gaps)" "$out/loraprof/b$b/profile_step.md"
             done ;;
    loragrpo) for c in ${LORA_CASES:-4b:8x512:mb32:ckpt 9b:4x512:mb32:ckpt}; do
               python3 benchmarks/grpo_gpu.py --out "$out/lora_grpo/${c%%:*}" --cases "$c" --runs segki --segki-steps 10 \
                 --warm 2 --overrides lora.r=16 > "$out/lora_grpo_${c%%:*}.log" 2>&1
               tail -1 "$out/lora_grpo_${c%%:*}.log" | cut -c1-200
             done ;;
    mixedprof) for m in fixed mixed; do
               python3 benchmarks/profile_train.py --out "$out/mixedprof/$m" --shape 0.8b --rows 32 --tokens 1024 --ckpt \
                 $([[ $m == mixed ]] && echo --mixed) > "$out/mixedprof_$m.log" 2>&1
               tail -3 "$out/mixedprof_$m.log"
             done ;;
    mixedab) TRITON_PRINT_AUTOTUNING=1 python3 benchmarks/grpo_gpu.py --out "$out/mixed_ab" --runs segki --segki-steps 8 \
               --warm 3 --cases 0.8b:16x1024:mb128:tok34816:ckpt:mixed 0.8b:16x1024:mb32:ckpt:mixed:pad \
               > "$out/mixedab.log" 2>&1; tail -3 "$out/mixedab.log" | cut -c1-200 ;;
    grpo)    python3 benchmarks/grpo_gpu.py --out "$out/grpo_gpu" --cases 0.8b:4x256 > "$out/grpo.log" 2>&1; tail -8 "$out/grpo.log" ;;
    scale)   python3 benchmarks/grpo_gpu.py --out "$out/grpo_scale" --cases 0.8b:16x1024:mb32 4b:8x512:mb16 --off-steps 3 \
               --warm 1 > "$out/scale.log" 2>&1; tail -10 "$out/scale.log" ;;
    reuse)   python3 benchmarks/grpo_gpu.py --out "$out/grpo_reuse" --cases 0.8b:4x256 --runs segki --segki-steps 20 \
               --overrides algo.num_iterations=2 > "$out/reuse.log" 2>&1; tail -6 "$out/reuse.log" ;;
    ddp)     python3 benchmarks/grpo_gpu.py --out "$out/grpo_ddp" --cases 0.8b:4x256 --runs segki --devices 1 2 \
               > "$out/ddp.log" 2>&1; tail -6 "$out/ddp.log" ;;
    ddp4b|fsdp4b)
             st=${stage%4b}
             python3 benchmarks/grpo_gpu.py --out "$out/grpo_$stage" --cases 4b:4x512:mb32:ckpt --runs segki \
               --devices 2 --strategy "$st" --warm 1 --overrides algo.lr_scheduler_type=constant \
               "rewards=[bench_rewards.even_token_fraction]" algo.reward_weights=null algo.learning_rate=1e-5 \
               algo.beta=0.04 > "$out/$stage.log" 2>&1; tail -3 "$out/$stage.log" | cut -c1-300
             if [[ $stage == fsdp4b && -d $out/grpo_ddp4b/runs ]]; then
               python3 benchmarks/compare_curves.py --out "$out/curves4b" --runs "$out"/grpo_ddp4b/runs/* \
                 "$out"/grpo_fsdp4b/runs/* --metrics train/loss train/kl train/reward train/grad_norm train/entropy
             fi ;;
    fsdp9b|ddp9b)
             python3 benchmarks/grpo_gpu.py --out "$out/grpo_$stage" --cases 9b:4x512:mb16:ckpt --runs segki \
               --devices 2 --strategy "${stage%9b}" --warm 1 > "$out/$stage.log" 2>&1
             tail -3 "$out/$stage.log" | cut -c1-300 ;;
    canon_decode)
             python3 benchmarks/decode.py --out "$out" --batches 1 16 32 64 --hf-eager-batches 1 \
               --hf-compile-batches 1 16 > "$out/decode.log" 2>&1 || tail -5 "$out/decode.log"
             grep -E "^\| (4b|0.8b)" "$out/decode.md" | cut -d'|' -f2-6 ;;
    canon_train)
             mkdir -p "$out/train"
             cases=${CANON_CASES:-$(cd benchmarks && python3 -c "import readme_tables; print(*readme_tables.CANONICAL_CASES)")}
             for case in $cases; do
               python3 benchmarks/grpo_gpu.py --out "$out/train/${case//:/_}" --cases "$case" --runs segki \
                 --segki-steps 6 --warm 2 > "$out/train/${case//:/_}.log" 2>&1
               tail -1 "$out/train/${case//:/_}.log" | cut -c1-200
               python3 benchmarks/readme_tables.py --collect "$out" > /dev/null   # its row into $out/train.json
             done ;;
    *)       echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "== $stage: $(( $(date +%s) - start )) s"
done
