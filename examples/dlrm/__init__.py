"""The DLRM training script's modules (run ``examples/dlrm/train.py``).

``flags`` (command line), ``data`` (synthetic, Criteo TSV/npy, MLPerf
multi-hot), ``model`` (TorchRec's DLRM variants on tpu), ``metrics`` (AUC,
normalized entropy), ``checkpoint`` (atomic save/resume), ``loop`` (training).
"""
