"""The GGUF metadata `--format gguf` writes for a transformers folder, against a GGUF llama.cpp's converter wrote
for the same model (issue 28): every key only one side has, every shared key whose value differs, and for the
vocabulary arrays how many pieces / types differ and how often the scores order neighbouring pieces alike.

    python benchmarks/gguf_metadata_diff.py --model GEMMA3_FP32_DIR --reference gemma-3-270m-q4_k_m.gguf \
        --json docs/results/llama_cpp/gemma3-270m-metadata.json

Only the metadata are written (no tensors), so a 270M model takes seconds. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def _fields(path: str) -> dict:
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


def main() -> None:
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from qat_lora.export.gguf.arch import add_metadata, gguf_architecture
    from qat_lora.export.gguf.vocab import add_tokenizer
    from llama_cpp_check import write_record  # this script's folder is on sys.path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="transformers model folder")
    parser.add_argument("--reference", required=True, help="a GGUF of the same model written by llama.cpp's tools")
    parser.add_argument("--json", default="", help="also write the record here")
    args = parser.parse_args()
    config, tokenizer = AutoConfig.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/meta.gguf"
        writer = gguf.GGUFWriter(path, gguf_architecture(config).arch)
        add_metadata(writer, config, "student")
        add_tokenizer(writer, tokenizer, config.vocab_size)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        ours = _fields(path)
    theirs = _fields(args.reference)
    shared = sorted(set(ours) & set(theirs) - set(VOCAB))
    record = {"model": Path(args.model).name, "reference": Path(args.reference).name,
              "only_reference": sorted(set(theirs) - set(ours)), "only_ours": sorted(set(ours) - set(theirs)),
              "shared_keys": len(shared),
              "differing": {k: [theirs[k], ours[k]] for k in shared if ours[k] != theirs[k]}}
    if all(k in ours and k in theirs for k in VOCAB):
        (t1, s1, y1), (t2, s2, y2) = ([f[k] for k in VOCAB] for f in (theirs, ours))
        both_normal = [i for i in range(min(len(y1), len(y2))) if y1[i] == y2[i] == gguf.TokenType.NORMAL]
        a, b = np.asarray(s1)[both_normal], np.asarray(s2)[both_normal]
        record["vocabulary"] = {
            "size": [len(t1), len(t2)], "pieces_differing": sum(x != y for x, y in zip(t1, t2)),
            "types_differing": sum(int(x) != int(y) for x, y in zip(y1, y2)),
            "normal_pieces": len(both_normal),
            # llama.cpp merges by score: what matters is the order, not the values
            "score_order_agreement": float(np.mean(np.sign(np.diff(a)) == np.sign(np.diff(b))))}
    record["date"] = time.strftime("%Y-%m-%d")
    write_record(record, args.json)


if __name__ == "__main__":
    main()
