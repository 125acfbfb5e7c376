"""`qat-lora generate` / `qat-lora chat`: talk to the recovered student, tokens streamed as they come (issue 18).

    qat-lora generate --model M --quant w3g64 --quantizer runs/x/quantizer.safetensors --adapter runs/x/adapter \\
        --prompt "Why is the sky blue?"
    qat-lora generate --model exports/w3g64/packed --prompt "..."     # any export: packed/, dense/, merged-fp/,
    qat-lora chat --model exports/w4g32/compressed-tensors            # compressed-tensors/, a .gguf file

The prompt goes through the tokenizer's chat template (`--raw` sends it as plain text); greedy decoding by
default (`--temperature` > 0 samples). On XLA the KV cache is static (transformers' `cache_implementation=
"static"`): every decode step has the same shapes, so the step compiles once instead of once per length.
"""
from __future__ import annotations

import codecs
import contextlib
import sys
from typing import Callable

import torch

from qat_lora.runtime import device as dev

from qat_lora.data import models
from qat_lora.commands.config import GenerateConfig
from qat_lora.commands.evaluate import load_model


def load_generator(cfg: GenerateConfig):
    """(model, tokenizer) for `cfg` (evaluate.load_model). The tokenizer loads first: a missing chat template is
    reported before the model's minutes of loading, not after."""
    tokenizer = models.load_tokenizer(cfg.model)
    if not cfg.raw:
        _require_chat_template(tokenizer)
    return load_model(cfg).eval(), tokenizer


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass --raw to send the prompt as plain text")


def encode_prompt(tokenizer, messages: list[dict], raw: bool) -> torch.Tensor:
    """[1, L] prompt ids: the conversation in the chat template (generation prompt appended), or the last
    message's text as it is.

    Raises:
        ValueError: no chat template and not --raw.
    """
    if raw:
        return tokenizer(messages[-1]["content"], return_tensors="pt").input_ids
    _require_chat_template(tokenizer)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return ids["input_ids"]


class _Streamer:
    """transformers' streamer protocol: decodes the new tokens as they arrive and hands each new piece of text
    to `on_text` (pieces are cut where the text so far is stable, so multi-byte characters are not split)."""

    def __init__(self, tokenizer, prompt_length: int, on_text: Callable[[str], None]):
        self.tokenizer, self.skip, self.on_text = tokenizer, prompt_length, on_text
        self.ids: list[int] = []
        self.printed = 0

    def put(self, value: torch.Tensor) -> None:
        flat = value.reshape(-1).tolist()
        if self.skip:  # the first call carries the prompt
            self.skip, flat = max(0, self.skip - len(flat)), flat[self.skip:]
        self.ids += flat
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half a character: wait for the next token
            return
        self.on_text(text[self.printed:])
        self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(text) > self.printed:
            self.on_text(text[self.printed:])


@torch.no_grad()
def generate_reply(model, tokenizer, messages: list[dict], cfg: GenerateConfig, device: torch.device,
                   on_text: Callable[[str], None]) -> list[int]:
    """Generate one reply to `messages`, streaming its text to `on_text`; returns the new token ids."""
    ids = encode_prompt(tokenizer, messages, cfg.raw).to(device)
    sampling = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p} if cfg.temperature > 0 \
        else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if dev.is_xla(device):  # fixed shapes per decode step: one compilation, not one per length
        # (CUDA keeps the dynamic cache here: each chat turn's length would be a new static cache to compile)
        sampling["cache_implementation"] = "static"
    pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id  # Gemma's pad id is 0
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                         pad_token_id=pad,
                         streamer=_Streamer(tokenizer, ids.shape[1], on_text), **sampling)
    return out[0, ids.shape[1]:].tolist()


def _print_piece(text: str) -> None:
    print(text, end="", flush=True)


def generate(cfg: GenerateConfig, on_text: Callable[[str], None] = _print_piece) -> list[int]:
    """`qat-lora generate`: one reply to --prompt, streamed; returns its token ids."""
    device = dev.resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_generator(cfg)
    new = generate_reply(dev.move_model_(model, device), tokenizer, [{"role": "user", "content": cfg.prompt}], cfg, device, on_text)
    on_text("\n")
    return new


class _ReplacedInput:
    """A codec error handler for stdin: undecodable bytes become U+FFFD and are reported once on stderr, so a
    pasted line in another encoding does not end the chat in a UnicodeDecodeError."""

    NAME = "qat-lora-chat-replace"

    def __init__(self) -> None:
        self.seen = self.told = False
        codecs.register_error(self.NAME, self)

    def __call__(self, error: UnicodeDecodeError) -> tuple[str, int]:
        self.seen = True
        return "\ufffd", error.end

    def tell_once(self) -> None:
        if self.seen and not self.told:
            self.told = True
            encoding = getattr(sys.stdin, "encoding", None) or "utf-8"
            print(f"qat-lora chat: warning: the input is not {encoding}; its undecodable bytes were replaced by "
                  "U+FFFD (set PYTHONIOENCODING to the terminal's encoding)", file=sys.stderr)


_REPLACED = _ReplacedInput()


@contextlib.contextmanager
def _tolerant_stdin():
    """sys.stdin decoding with `_REPLACED` for the chat's duration (input() keeps its line editing)."""
    stdin = sys.stdin
    errors = getattr(stdin, "errors", None)
    _REPLACED.seen = _REPLACED.told = False  # said once per conversation
    # reconfigure() refuses while decoded input is buffered (a caller read stdin before; lines left after /exit):
    # then stdin stays as it was, or keeps replacing once the chat is over.
    with contextlib.suppress(AttributeError, ValueError):
        stdin.reconfigure(errors=_REPLACED.NAME)
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError, ValueError):
            stdin.reconfigure(errors=errors)


def chat(cfg: GenerateConfig, read: Callable[[str], str] = input,
         on_text: Callable[[str], None] = _print_piece) -> None:
    """`qat-lora chat`: a conversation on stdin; an empty line, /exit or end of input stops."""
    if read is input and (sys.stdin is None or sys.stdin.closed):  # started with `<&-`: no model load for nothing
        print("qat-lora chat: no input (stdin is closed); nothing to reply to", file=sys.stderr)
        return
    device = dev.resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_generator(cfg)
    model = dev.move_model_(model, device)
    with _tolerant_stdin():
        _converse(model, tokenizer, cfg, device, read, on_text)


def _converse(model, tokenizer, cfg: GenerateConfig, device: torch.device, read: Callable[[str], str],
              on_text: Callable[[str], None]) -> None:
    messages: list[dict] = [{"role": "system", "content": cfg.system}] if cfg.system else []
    while True:
        try:
            line = read("> ").strip()
        except EOFError:  # Ctrl-D, the end of a piped file, `< /dev/null`: the conversation ends, exit 0
            on_text("\n")  # the prompt's line
            print("qat-lora chat: end of input; conversation ended", file=sys.stderr)
            break
        _REPLACED.tell_once()
        if line in ("", "/exit"):
            break
        messages.append({"role": "user", "content": line})
        new = generate_reply(model, tokenizer, messages, cfg, device, on_text)
        on_text("\n")
        messages.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})
