"""The KD cache: the teacher's targets written once and replayed by every training step. Target encodings
(sampled draws, top-K + tail mass; bit packing), the builder (teacher over packed sequences -> rank-sharded
safetensors shards + manifest, resumable, on N chips), the folder it writes (a lock per rank; --overwrite
removing only what each rank's own records prove its own), the merge of the ranks' manifests, and the one reader
(KDCache: memory-mapped, rank-sharded batches; verify, inspect).

May import: runtime, data.
"""
