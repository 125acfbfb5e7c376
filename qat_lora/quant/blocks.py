"""Decoder-block plumbing: capture what enters the first decoder layer, then run layers one at a time.

Used by sequential GPTQ (`gptq.gptq_`) and meant for block-wise reconstruction (EfficientQAT Block-AP,
BRECQ; DESIGN §8): both process one decoder block at a time on the hidden states coming out of the
previous one, so only one block's activations are live.

    inputs = capture_block_inputs(model, batches)       # embeddings entering layer 0, + the layer kwargs
    for layer in decoder_layers(model):
        inputs = inputs.with_hidden(run_block(layer, inputs))

Memory: the hidden states are kept on the CPU in float32, len(batches) x B x L x hidden x 4 bytes (32
sequences of 512 tokens at hidden 576: 38 MB; at hidden 2048: 134 MB); `run_block` returns as many again, where
the inputs are: `BlockInputs.kept_on(cuda)` keeps them on a GPU with room for them.
The per-batch layer kwargs (rotary cos/sin, attention mask) stay on the model's device.
Works for every family of models.FAMILIES in transformers 5.x (decoder layers that take the hidden states first
and everything else as keyword arguments), bare or wrapped by PEFT. Layers may differ in their kwargs: Gemma 3's
sliding-window layers get a banded mask and local rotary frequencies, its global ones the causal mask and global
frequencies; Qwen2/Qwen3/Mistral with a sliding window likewise. Each layer's own kwargs are recorded.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from qat_lora.runtime import device as dev


class _StopForward(Exception):
    """Raised by the capture hook on layer 0: nothing after the embeddings needs to run."""


@dataclass(frozen=True)
class BlockInputs:
    """What each recorded batch feeds a decoder layer.

    Attributes:
        hidden: per batch, the hidden states [B, L, hidden], float32 on the CPU.
        kwargs: per batch, the keyword arguments the decoder passes the layer these hidden states enter
            (position_embeddings, attention_mask, position_ids, ...), as captured.
        later_kwargs: for each following layer, its kwargs per batch (empty: every layer takes `kwargs`).
    """

    hidden: list[torch.Tensor]
    kwargs: list[dict]
    later_kwargs: tuple[list[dict], ...] = ()

    def with_hidden(self, hidden: list[torch.Tensor]) -> "BlockInputs":
        """The inputs of the next layer: new hidden states (the outputs of this one) with the next layer's kwargs."""
        if len(hidden) != len(self.hidden):
            raise ValueError(f"with_hidden: got {len(hidden)} batches of hidden states for {len(self.hidden)} "
                             "batches of layer kwargs; pass one tensor per recorded batch")
        if not self.later_kwargs:
            return replace(self, hidden=list(hidden))
        return replace(self, hidden=list(hidden), kwargs=self.later_kwargs[0], later_kwargs=self.later_kwargs[1:])

    def layer_kwargs(self) -> list[list[dict]]:
        """Per layer from this one on, the kwargs per batch."""
        return [self.kwargs, *self.later_kwargs]

    def num_tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)

    def kept_on(self, device: torch.device | str | None) -> "BlockInputs":
        """These inputs with the hidden states on `device` when it is a CUDA device with room for them twice
        (a layer's inputs and outputs) in a quarter of its free memory: then `run_block` reads and writes them
        there, with no host round trip per batch and layer (fp32 [B, L, hidden] each way: 1.6 GB per layer
        for 128 x 512 tokens of a 1B model). Elsewhere, or without the room, unchanged (on the host)."""
        if device is None:
            return self
        device = torch.device(device)
        free = dev.free_bytes(device)
        need = 2 * sum(h.numel() * h.element_size() for h in self.hidden)
        if free is None or need > free // 4:
            return self
        return replace(self, hidden=[h.to(device) for h in self.hidden])


def _base_model(model: nn.Module) -> nn.Module:
    # PEFT's PeftModel wraps the transformers model; its layers are reachable through get_base_model().
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM (model.model.layers, or get_decoder().layers), in order.

    Raises:
        ValueError: the model has no recognisable list of decoder layers.
    """
    base = _base_model(model)
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None and hasattr(base, "get_decoder"):
        layers = getattr(base.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(base).__name__}: no decoder layers found (expected model.model.layers or "
                         "get_decoder().layers, as in Llama / Qwen2 / Qwen3)")
    return list(layers)


@contextmanager
def layer_progress(model: nn.Module, desc: str,
                   disable: bool = False) -> Iterator[Callable[[Callable[[str], None]], Callable[[str], None]]]:
    """A bar with an ETA over `model`'s decoder layers while a pass inside the block runs them one at a time
    (GPTQ, the calibrated LoRA start): a layer counts as done when the next one starts computing, so the pass
    itself needs no hook. Each layer's first sub-module is watched, not the layer: capture_block_inputs runs
    the layers as recorders that skip their sub-modules, which must not count.

    Yields:
        `above(log)`: `log` with its lines printed above the bar instead of into it (the pass's own log).
    """
    layers = decoder_layers(model)
    bar = tqdm(total=len(layers), desc=desc, unit="layer", disable=disable)

    def starts(index: int):
        def hook(module, args) -> None:
            if index > bar.n:
                bar.update(index - bar.n)
        return hook

    handles = [] if disable else [next(layer.children(), layer).register_forward_pre_hook(starts(index))
                                  for index, layer in enumerate(layers)]
    def above(log: Callable[[str], None]) -> Callable[[str], None]:
        def write(line: str) -> None:
            with tqdm.external_write_mode():
                log(line)
        return log if disable else write

    try:
        yield above
        bar.update(bar.total - bar.n)
    finally:
        for handle in handles:
            handle.remove()
        bar.close()


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _dtype(module: nn.Module) -> torch.dtype:
    return next(p for p in module.parameters() if p.is_floating_point()).dtype


@torch.no_grad()
def capture_block_inputs(model: nn.Module, input_ids_batches: Iterable[torch.Tensor]) -> BlockInputs:
    """Run `model` on each batch with its decoder layers replaced by recorders, and record what each layer receives.

    Each layer's forward is swapped, for the capture only, for one that records its kwargs and passes the hidden
    states through untouched; the last one stops the forward. So only the embeddings, masks and rotary tables are
    computed, and a family whose layers take different masks or rotary tables (sliding vs global) gets each
    layer's own.

    Args:
        model: a transformers causal LM of models.FAMILIES, possibly a PEFT model.
        input_ids_batches: input_ids tensors [B, L] (moved to the model's device here).
    Returns:
        BlockInputs for layer 0, one entry per batch: hidden [B, L, hidden] float32 CPU, and every layer's kwargs.
    """
    layers = decoder_layers(model)
    base = _base_model(model)
    hidden: list[torch.Tensor] = []
    per_layer: list[list[dict]] = [[] for _ in layers]

    def recorder(index: int):
        def forward(*args, **kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            if index == 0:
                hidden.append(h.detach().float().cpu())
            per_layer[index].append({k: v for k, v in kwargs.items() if k != "hidden_states"})
            if index == len(layers) - 1:
                raise _StopForward
            return h
        return forward

    for index, layer in enumerate(layers):
        layer.forward = recorder(index)  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        for input_ids in input_ids_batches:
            try:
                # use_cache=False: no KV cache is built, so the recorded kwargs carry past_key_values=None
                base(input_ids=input_ids.to(_device(base)), use_cache=False)
            except _StopForward:
                pass
    finally:
        for layer in layers:
            del layer.forward
    return BlockInputs(hidden, per_layer[0], tuple(per_layer[1:]))


def on_device(value, device: torch.device):
    """`value` (a tensor, or tuples / lists / dicts of them, as a layer's captured kwargs) with every tensor on
    `device`: a layer moved alone to an accelerator gets its masks and rotary tables there too."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    return value


@torch.no_grad()
def run_block(layer: nn.Module, inputs: BlockInputs) -> list[torch.Tensor]:
    """Run one decoder layer over every recorded batch.

    Args:
        layer: a decoder layer (returning a tensor, or a tuple whose first element is the hidden states).
        inputs: its inputs; hidden states are moved to the layer's device and dtype per batch.
    Returns:
        per batch, the layer's output hidden states [B, L, hidden], float32 where the inputs' are (the CPU,
        or the device `BlockInputs.kept_on` put them on).
    """
    device, dtype = _device(layer), _dtype(layer)
    outputs = []
    for h, kwargs in zip(inputs.hidden, inputs.kwargs):
        out = layer(h.to(device=device, dtype=dtype), **on_device(kwargs, device))
        out = out[0] if isinstance(out, tuple) else out
        outputs.append(out.float().to(h.device))  # where the inputs are kept (BlockInputs.kept_on)
    return outputs
