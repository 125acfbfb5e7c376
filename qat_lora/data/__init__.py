"""Text in, tokens out: reading corpora (text files, .jsonl records, chat transcripts) into documents, the
held-out split by document hash, packing into fixed-length sequences; loading models and tokenizers
(transformers folders, .gguf files, the fetch-assets teachers) with their fingerprints; the pip-only teacher
and text downloads; and teacher-written training text (`generate-data`).

May import: runtime.
"""
