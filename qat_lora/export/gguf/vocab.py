"""The tokenizer inside a GGUF, as llama.cpp's converter writes it (issue 28), read from the HF fast tokenizer:

- byte-level BPE (GPT-2, SmolLM, Qwen2/2.5/3): `tokenizer.ggml.model` "gpt2", its pre-tokenizer's name, tokens by
  id ([PADi] UNUSED for gaps), merges;
- SentencePiece (Llama 2, Mistral, Phi-3, Gemma: in tokenizer.json a BPE with byte fallback over "▁"-spelled
  pieces): "llama" with pre "default", pieces, scores and types (NORMAL, CONTROL for special added tokens,
  USER_DEFINED for other added tokens, their "▁" written as spaces, BYTE for <0xXX>, UNKNOWN), and
  add_space_prefix from the tokenizer's own prefix rule (Gemma: none).

llama.cpp's SentencePiece tokenizer merges, among adjacent pieces, the pair whose joined piece has the highest
score first; HF's BPE merges the pair of lowest merge rank. With score = -(rank of the first merge producing the
piece) the two pick the same pair at every step (SentencePiece-derived merges list every pair of pieces that
join to a piece, best first), so llama.cpp splits text as the HF tokenizer does. The converter reads the same
scores from tokenizer.model; a folder transformers wrote (from a GGUF, say) has only tokenizer.json.
Special ids, add_bos/add_eos and the chat template come through gguf.SpecialVocab over the saved files.
"""
from __future__ import annotations

import json
import re
import tempfile

from qat_lora.export.gguf.arch import _gguf
from qat_lora.runtime.writes import writing

UNUSED_SCORE, ADDED_SCORE = -10000.0, -1000.0  # the converter's scores for padding and added tokens
_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPACE = "\u2581"  # SentencePiece's visible space


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (tokenizer.ggml.pre), read from its definition:
    byte-level with GPT-2's regex is `gpt-2`; single digits split first, then that, is `smollm`; Qwen2's split
    regex, then byte-level without its own regex, is `qwen2` (Qwen2, Qwen2.5, Qwen3).

    Raises:
        ValueError: any other pre-tokenizer (llama.cpp would split the text differently).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()).get("pre_tokenizer") if backend is not None else None
    steps = (spec or {}).get("pretokenizers", [spec]) if (spec or {}).get("type") == "Sequence" else [spec]
    kinds = [(s or {}).get("type") for s in steps]
    byte_level = bool(steps) and kinds[-1] == "ByteLevel" and steps[-1].get("use_regex", True)
    if byte_level and len(steps) == 1:
        return "gpt-2"
    if byte_level and kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) and \
            steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT
        if (steps[0].get("pattern") or {}).get("Regex") == QWEN2_SPLIT:
            return "qwen2"
    raise ValueError(f"--format gguf: pre-tokenizer {kinds} has no llama.cpp equivalent written yet (byte-level BPE "
                     "as GPT-2, SmolLM or Qwen2, or SentencePiece); use --format packed or dense")


def _looks_special(token: str) -> bool:
    """Added tokens the converter marks CONTROL although the tokenizer does not call them special."""
    return token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>")) \
        or (token.startswith("<unused") and token.endswith(">"))


def _spec(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("--format gguf: the tokenizer is not a fast tokenizer (no tokenizer.json); save it with "
                         "transformers first")
    return json.loads(backend.to_str())


def is_sentencepiece(spec: dict) -> bool:
    """A SentencePiece vocabulary in tokenizer.json: BPE with byte fallback over "▁"-spelled pieces."""
    model = spec.get("model") or {}
    rules = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer"), spec.get("decoder")], ensure_ascii=False)
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and _SPACE in rules


def _adds_space_prefix(spec: dict) -> bool:
    """Whether the tokenizer puts "▁" before the text: a Prepend normalizer (Llama 2, Phi-3) or a Metaspace
    pre-tokenizer that prepends (newer Llama / Mistral files); Gemma does neither."""
    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "Prepend" and node.get("prepend") == _SPACE:
                return True
            if node.get("type") == "Metaspace":
                return node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never") \
                    != "never"
            return any(walk(v) for v in node.values())
        return any(walk(v) for v in node) if isinstance(node, list) else False
    return walk(spec.get("normalizer")) or walk(spec.get("pre_tokenizer"))


def _merge_ranks(spec: dict) -> dict[str, int]:
    """Piece -> rank of the first merge that produces it."""
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(spec["model"].get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        ranks.setdefault(left + right, rank)
    return ranks


def sentencepiece_vocab(tokenizer, vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, token types) by id, for `tokenizer.ggml.model` "llama"."""
    gguf = _gguf()
    spec = _spec(tokenizer)
    ranks = _merge_ranks(spec)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder  # {id: AddedToken}
    unk = tokenizer.unk_token_id
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]"), scores.append(UNUSED_SCORE), types.append(gguf.TokenType.UNUSED)
        elif i in added and (added[i].special or _looks_special(token)):
            tokens.append(token), scores.append(ADDED_SCORE), types.append(gguf.TokenType.CONTROL)
        elif i in added:  # llama.cpp matches these in the raw text, before spaces become "▁"
            tokens.append(token.replace(_SPACE, " ")), scores.append(ADDED_SCORE)
            types.append(gguf.TokenType.USER_DEFINED)
        elif _BYTE.fullmatch(token):
            tokens.append(token), scores.append(0.0), types.append(gguf.TokenType.BYTE)
        else:
            tokens.append(token)
            scores.append(0.0 if i == unk else -float(ranks.get(token, len(ranks) + i)))
            types.append(gguf.TokenType.UNKNOWN if i == unk else gguf.TokenType.NORMAL)
    return tokens, scores, types


def _bpe_vocab(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, types) by id for a byte-level BPE: added special tokens CONTROL, other added USER_DEFINED."""
    gguf = _gguf()
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]"), types.append(gguf.TokenType.UNUSED)
            continue
        special = i in added and (added[i].special or (token.startswith("<|") and token.endswith("|>")))
        types.append(gguf.TokenType.CONTROL if special else
                     gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """Write the tokenizer's keys (see the module docstring).

    Raises:
        ValueError: no tokenizer.json, or a vocabulary llama.cpp would split differently.
    """
    gguf = _gguf()
    spec = _spec(tokenizer)
    if is_sentencepiece(spec):
        tokens, scores, types = sentencepiece_vocab(tokenizer, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        merges = False
    elif (spec.get("model") or {}).get("type") == "BPE":
        pre = pre_tokenizer_name(tokenizer)
        tokens, types = _bpe_vocab(tokenizer, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        merges = True
    else:
        raise ValueError(f"--format gguf: a {(spec.get('model') or {}).get('type')} tokenizer is not written yet "
                         "(byte-level BPE or SentencePiece only); use --format packed or dense")
    with tempfile.TemporaryDirectory() as tmp:
        with writing(tmp):  # a full temp folder: one line naming it (tokenizers raise a bare Exception)
            tokenizer.save_pretrained(tmp)
        special = gguf.SpecialVocab(tmp, load_merges=merges, n_vocab=vocab_size)
    ids = tokenizer("a")["input_ids"]  # say what the HF tokenizer does, not llama.cpp's per-vocabulary default
    for kind, token, where in (("bos", tokenizer.bos_token_id, ids[:1]), ("eos", tokenizer.eos_token_id, ids[-1:])):
        special.add_special_token.setdefault(kind, token is not None and where == [token])
    special.add_to_gguf(writer, quiet=True)
    if not merges:
        writer.add_add_space_prefix(_adds_space_prefix(spec))
