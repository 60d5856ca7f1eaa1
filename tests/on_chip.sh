#!/usr/bin/env bash
# The checks that only mean something on a TPU, in named groups, each bounded in time, each writing its
# results into OUT as it goes (a group killed at its limit keeps what it wrote). Run on the TPU host from
# the checkout's root, with tpurec importable and the chip free (one process at a time holds it):
#
#   bash tests/on_chip.sh OUT [group ...]        # default: dlrm kernels train
#
# Groups (seconds are the limits; the first run on a host compiles everything: TPUREC_CACHE_DIR keeps it):
#   dlrm        bench dlrm, graphed/fused/compiled at batch 2048 (the plain-JAX step and TorchRec on the host
#               timed in the same run), then graphed at batch 16384                               330 + 260
#   kernels     the TensorCore kernel's lane-dense tests against the reference kernel, on the chip      240
#   train       examples/dlrm/train.py with the Makefile's flags, then with --interaction_type dcn  250 + 200
#               (compare the held-out AUC with the same command on CPU)
#   embeddings  bench embeddings at DLRM's shapes (dim 64, 4 ids a bag, 26 tables x 100k rows)         300
#   special     tests/dense/special_accuracy_on_device.py: float32 special functions against float64    300
#   compile     tests/models/compile_latency_on_device.py: cold and warm time to a first step          450
#   parity      tpurec.sparse's modules and DLRM on the chip against TorchRec/FBGEMM on the host         300
#   breadth     the rest of tpurec.sparse's tests that put modules on the tpu device (TorchRec semantics,
#               EC, FP16/BF16 tables, VBE and input forms, captured steps, pipeline, export, quantized
#               inference, managed collisions, checkpoints, update rules), in one process            560
# OUT/summary.txt gets one line per group: its name, exit status (124: killed at its limit) and seconds.
set -u
out=${1:?usage: bash tests/on_chip.sh OUT [group ...]}
shift
mkdir -p "$out"
groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(dlrm kernels train)
known=" dlrm kernels train embeddings special compile parity breadth "
for group in "${groups[@]}"; do
  if [[ $known != *" $group "* ]]; then
    echo "unknown group $group (${known# })" >&2
    exit 2
  fi
done
train_flags=(--batch_size 512 --num_embeddings 10000 --embedding_dim 16 --dense_arch_layer_sizes 64,16
  --over_arch_layer_sizes 64,32,1 --adagrad --learning_rate 0.05 --limit_train_batches 300
  --limit_val_batches 8 --limit_test_batches 8 --validation_freq_within_epoch 100)

# step NAME LIMIT OUTFILE COMMAND...: runs COMMAND with stdout into OUT/OUTFILE, stderr into OUT/NAME.err.
step() {
  local name=$1 limit=$2 file=$3
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$file" 2>"$out/$name.err"
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}

for group in "${groups[@]}"; do
  case $group in
    dlrm)
      step dlrm_2048 330 dlrm_2048.json python -m tpurec.bench dlrm --modes graphed fused compiled --steps 10 --warmup 3
      step dlrm_16384 260 dlrm_16384.json python -m tpurec.bench dlrm --batch-size 16384 --modes graphed \
        --steps 6 --warmup 3 --round-steps 3
      ;;
    kernels)
      JAX_PLATFORMS=tpu,cpu XLA_FLAGS= step kernels 240 kernels.txt python -m pytest -q -p no:cacheprovider \
        tests/sparse/test_tensorcore_kernel.py -k "lane_dense_one_pass_step or lane_dense_forward or row_math_once_a_row or block_number"
      ;;
    train)
      step train 250 train.txt python examples/dlrm/train.py "${train_flags[@]}"
      step train_dcn 200 train_dcn.txt python examples/dlrm/train.py "${train_flags[@]}" --interaction_type dcn
      ;;
    embeddings)
      step embeddings 300 embeddings.json python -m tpurec.bench embeddings --dims 64 --ids-per-bag 4 --tables 26 \
        --rows 100000 --skip-reference
      ;;
    special)
      step special 300 special.txt python tests/dense/special_accuracy_on_device.py
      ;;
    compile)
      OUT="$out" step compile 450 compile.txt python tests/models/compile_latency_on_device.py
      ;;
    parity)
      JAX_PLATFORMS=tpu,cpu XLA_FLAGS= step parity 300 parity.txt python -m pytest -q -p no:cacheprovider \
        tests/sparse/test_tpu_device.py tests/sparse/test_dlrm.py
      ;;
    breadth)
      JAX_PLATFORMS=tpu,cpu XLA_FLAGS= step breadth 560 breadth.txt python -m pytest -q -p no:cacheprovider \
        tests/sparse/test_torchrec_semantics.py tests/sparse/test_sequence.py tests/sparse/test_table_dtypes.py \
        tests/sparse/test_torchrec_half_tables.py tests/sparse/test_input_forms.py \
        tests/sparse/test_captured_sparse_steps.py tests/sparse/test_pipeline_steps.py tests/sparse/test_export.py \
        tests/sparse/test_quant.py tests/sparse/test_managed_collisions.py tests/sparse/test_checkpoint_integrity.py \
        tests/sparse/test_update_rules.py tests/sparse/test_modules.py
      ;;
  esac
done
