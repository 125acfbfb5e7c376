"""Where and how a stage runs: device choice and binding, precision and autocast, the XLA runtime and its
compile cache, host allocator tuning, collectives (one interface over single, torch.distributed, XLA replicas
and SPMD), FSDP sharding over the SPMD mesh, starting N local ranks, the generic config checks and mixins, and
files written safely (atomic writes, checksums, ownership stamps, folder locks, run-folder names).

The bottom stage: it may import nothing else from qat_lora. torch_xla is imported only inside functions, when
an XLA device is asked for; every private torch_xla call lives in runtime/xla.py.
"""
