"""The knowledge-distillation loss: top-K + tail soft cross-entropy mixed with the hard-label CE (DESIGN §3).

XLA-safe by construction: fixed shapes, no boolean indexing, no `nonzero`, no `F.kl_div`, no Python branch
on tensor values. Masked positions are multiplied by zero, so they contribute exactly nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from qat_lora.data import models

# Fill for the K teacher ids when taking the student's tail logsumexp. Finite (not -inf) so that with
# K = V (an empty tail) the softmax stays defined and 0 * s_tail is 0, not NaN. Real log-probs never get near it.
_TAIL_FILL = -1.0e4


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 logits are promoted; float64 stays float64 (the reference tests rely on it).
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass(frozen=True)
class KDLossConfig:
    """Attributes:
        temperature: T > 0; T != 1 tempers teacher and student over the same K+1 buckets and scales by T^2.
        alpha: weight of the soft (teacher) cross-entropy; 1 - alpha weighs the hard-label CE on the text.
    """

    temperature: float = 1.0
    alpha: float = 1.0
    # The student's final-logit soft-cap c (Gemma 2: logits = c * tanh(logits / c)), which the chunked lm_head must
    # apply itself; forward_loss sets it from the model's config (models.logit_softcap). None: plain logits.
    logit_softcap: float | None = None
    # Baseline only (the Anemll form): both sides renormalised over the K ids, the tail dropped. Biased: the
    # student learns an over-confident head (Anshumann et al., 2025); kept to measure what the tail is worth.
    renormalize_topk: bool = False
    # Feature distillation (an online teacher only): weight of `hidden_state_loss` in the loss; 0 = off.
    hidden_weight: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.hidden_weight < float("inf")):
            raise ValueError(f"--hidden-weight {self.hidden_weight}: must be >= 0 and finite (0 = off)")
        if not self.temperature > 0:
            raise ValueError(f"--temperature {self.temperature}: must be > 0")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"--alpha {self.alpha}: must be in [0, 1] (1 = pure KD, 0 = plain cross-entropy)")


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """c * tanh(logits / c), as transformers' Gemma 2 applies after lm_head; the logits unchanged for None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def student_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax over the full vocabulary in fp32 (at least): one fused pass forward and backward, computed
    once per chunk and shared by the soft CE, the tail and the hard CE."""
    return torch.log_softmax(_at_least_fp32(logits), dim=-1)


def student_bucket_logprobs(logprobs: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Student log-probabilities s_k [..., K] of the K teacher ids (int64 [..., K]) and s_tail [...], the
    logsumexp of the rest (DESIGN §3), from its full-vocabulary log-softmax [..., V] (`student_logprobs`)."""
    s_k = torch.gather(logprobs, -1, topk_ids)
    s_tail = torch.logsumexp(logprobs.scatter(-1, topk_ids, _TAIL_FILL), dim=-1)
    return s_k, s_tail


def teacher_buckets(topk_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher probabilities of the K stored ids and the implied tail mass q_tail = 1 - sum(q_k), clamped >= 0."""
    q_k = _at_least_fp32(topk_logprobs).exp()
    q_tail = (1.0 - q_k.sum(-1)).clamp(min=0.0)
    return q_k, q_tail


def _temper(logp: torch.Tensor, temperature: float) -> torch.Tensor:
    # Re-normalise log-probabilities over the last dim after dividing by T (same buckets for both sides).
    return torch.log_softmax(logp / temperature, dim=-1)


def topk_soft_ce(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                 temperature: float = 1.0, renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position soft cross-entropy -(sum_k q_k s_k + q_tail s_tail) and KL = soft_ce - H(q) >= 0 over the
    K+1 buckets (over the K alone when `renormalize`); both times T^2 when tempered."""
    return _topk_soft_ce(student_logprobs(logits), topk_ids, topk_logprobs, temperature, renormalize)


def _topk_soft_ce(s_full: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                  temperature: float, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s_k, s_tail = student_bucket_logprobs(s_full, topk_ids)
    q_k, q_tail = teacher_buckets(topk_logprobs)
    if renormalize:
        s = torch.log_softmax(s_k / temperature, dim=-1)
        q = torch.softmax(_at_least_fp32(topk_logprobs) / temperature, dim=-1)
        soft_ce = -(q * s).sum(-1) * temperature**2
        return soft_ce, soft_ce + (q * q.clamp(min=1e-30).log()).sum(-1) * temperature**2
    if topk_ids.shape[-1] >= s_full.shape[-1]:
        # K = V (a static shape, no branch on values): the tail is empty on both sides, so the buckets are the K
        # tokens. Rounding leaves the K probabilities summing to 1 +- 1e-7, and tempering inflates that fake tail
        # mass (1e-7 ** (1 / T)) against the student's finite tail fill: a visible loss gap at T > 1.
        return _bucket_soft_ce(_at_least_fp32(topk_logprobs), q_k, s_k, temperature)
    log_q = torch.cat([_at_least_fp32(topk_logprobs), q_tail.clamp(min=1e-30).log().unsqueeze(-1)], dim=-1)
    q = torch.cat([q_k, q_tail.unsqueeze(-1)], dim=-1)  # q_tail exact (not exp(log))
    return _bucket_soft_ce(log_q, q, torch.cat([s_k, s_tail.unsqueeze(-1)], dim=-1), temperature)


def _bucket_soft_ce(log_q: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft CE and KL of teacher buckets (log_q, q [..., n]; q used as is at T = 1) against the student's
    log-probabilities s [..., n] over the same buckets; T tempers both sides and scales by T^2."""
    scale = 1.0
    if temperature != 1.0:
        q, s = _temper(log_q, temperature).exp(), _temper(s, temperature)
        scale = temperature**2
    soft_ce = -(q * s).sum(-1) * scale
    entropy = -(q * q.clamp(min=1e-30).log()).sum(-1) * scale
    return soft_ce, soft_ce - entropy


def full_soft_ce(logits: torch.Tensor, teacher_logits: torch.Tensor,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft CE and KL [...] of student logits [..., V] against the teacher's raw logits [..., V] (its whole
    distribution: the K = V top-K loss without the gather), for targets computed on the fly (`--online-teacher`);
    times T^2 when tempered, as the cached path."""
    return _full_soft_ce(student_logprobs(logits), teacher_logits, temperature)


def _full_soft_ce(s_full: torch.Tensor, teacher_logits: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_q = torch.log_softmax(_at_least_fp32(teacher_logits), dim=-1)
    return _bucket_soft_ce(log_q, log_q.exp(), s_full, temperature)


def _sampled_soft_ce(s_full: torch.Tensor, sample_ids: torch.Tensor,
                     sample_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RS-KD soft cross-entropy -sum_i (c_i / N) s_i and the same minus the entropy of c / N, from the student's
    log-probs s_full [..., V], sample_ids [..., S] and sample_weights [..., S] (c_i / N, 0 in unused slots); the
    expectation of soft_ce over the draws is the full soft cross-entropy."""
    s = torch.gather(s_full, -1, sample_ids)
    w = sample_weights.to(s.dtype)
    soft_ce = -(w * s).sum(-1)
    return soft_ce, soft_ce + (w * w.clamp(min=1e-30).log()).sum(-1)


def next_token_labels(input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard labels [B, L] for position t (token t+1; 0 where invalid) and their validity [B, L] float (both tokens
    real; the last position has none)."""
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    label_mask = torch.zeros_like(mask, dtype=torch.float32)
    label_mask[:, :-1] = mask[:, :-1].float() * mask[:, 1:].float()
    return labels, label_mask


def _nll(s_full: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return -torch.gather(s_full, -1, labels.unsqueeze(-1)).squeeze(-1)


def _position_sums(logits: torch.Tensor, targets: dict[str, torch.Tensor], cfg: KDLossConfig,
                   teacher_head: tuple | None = None, top1: bool = True) -> torch.Tensor:
    """Masked sums over N positions: [soft_ce, kl, top1, ce] (`top1` False: its sum is 0, and the [N, V] argmax
    a training step never reads is not computed). logits [N, V]; targets hold per-position
    `labels` [N], `kd_mask` [N], `label_mask` [N] and one kind of teacher target (or none): `topk_ids` +
    `topk_logprobs` [N, K], `sample_ids` + `sample_weights` [N, S], `teacher_logits` [N, V], or
    `teacher_hidden` [N, H] whose logits `teacher_head` (weight [V, H], bias [V] or None, soft-cap or None)
    computes here, for these N positions only."""
    s_full = student_logprobs(logits)  # once per chunk: the one full-vocabulary normalisation
    ce = _nll(s_full, targets["labels"]) * targets["label_mask"]
    if "teacher_hidden" in targets:  # an online teacher, chunked: only this chunk's teacher logits ever exist
        weight, bias, cap = teacher_head
        teacher_logits = softcap_logits(torch.nn.functional.linear(targets["teacher_hidden"], weight, bias), cap)
        targets = {**targets, "teacher_logits": teacher_logits}
    if "teacher_logits" in targets:
        soft_ce, kl = _full_soft_ce(s_full, targets["teacher_logits"], cfg.temperature)
        teacher_top1 = lambda: targets["teacher_logits"].argmax(-1)  # noqa: E731  (only if top1 is asked for)
    elif "topk_ids" in targets:
        soft_ce, kl = _topk_soft_ce(s_full, targets["topk_ids"], targets["topk_logprobs"], cfg.temperature,
                                    cfg.renormalize_topk)
        teacher_top1 = lambda: targets["topk_ids"][:, 0]  # noqa: E731
    elif "sample_ids" in targets:
        if cfg.temperature != 1.0:
            raise ValueError("--temperature: sampled targets were drawn at T = 1; use --temperature 1")
        soft_ce, kl = _sampled_soft_ce(s_full, targets["sample_ids"], targets["sample_weights"])
        teacher_top1 = lambda: torch.gather(targets["sample_ids"], -1,  # noqa: E731
                                            targets["sample_weights"].argmax(-1, keepdim=True)).squeeze(-1)
    else:  # perplexity only: no teacher targets
        zero = ce.sum() * 0.0
        return torch.stack([zero, zero, zero, ce.sum()])
    kd_mask = targets["kd_mask"].to(soft_ce.dtype)
    agree = ((logits.argmax(-1) == teacher_top1()).to(soft_ce.dtype) * kd_mask).sum() if top1 else soft_ce.sum() * 0.0
    return torch.stack([(soft_ce * kd_mask).sum(), (kl * kd_mask).sum(), agree,
                        ce.sum().to(soft_ce.dtype)])


# Teacher targets a batch may hold: a cache's (top-K or sampled) or an online teacher's (`teacher_targets`).
TARGET_KEYS = ("topk_ids", "topk_logprobs", "sample_ids", "sample_weights", "teacher_logits", "teacher_hidden")


def _flat_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-position targets of a [B, L] batch, flattened to [B*L, ...]."""
    labels, label_mask = next_token_labels(batch["input_ids"], batch["attention_mask"])
    # Ids may arrive as int32 (device.device_batches); gather and scatter index with int64.
    targets = {"labels": labels.reshape(-1).long(), "label_mask": label_mask.reshape(-1),
               "kd_mask": batch["attention_mask"].reshape(-1).float()}
    for key in TARGET_KEYS:
        if key in batch:
            flat = batch[key].reshape(-1, batch[key].shape[-1])
            targets[key] = flat.long() if key.endswith("_ids") else flat
    return targets


def _finish(sums: torch.Tensor, targets: dict[str, torch.Tensor], cfg: KDLossConfig) -> dict[str, torch.Tensor]:
    kd_tokens, ce_tokens = targets["kd_mask"].sum(), targets["label_mask"].sum()
    out = {"soft_ce_sum": sums[0], "kl_sum": sums[1], "top1_sum": sums[2], "ce_sum": sums[3],
           "kd_tokens": kd_tokens, "ce_tokens": ce_tokens}
    for name, count in (("soft_ce", kd_tokens), ("kl", kd_tokens), ("top1", kd_tokens), ("ce", ce_tokens)):
        out[name] = out[f"{name}_sum"] / count.clamp(min=1.0)
    out["loss"] = cfg.alpha * out["soft_ce"] + (1.0 - cfg.alpha) * out["ce"]
    return out


def kd_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], cfg: KDLossConfig) -> dict[str, torch.Tensor]:
    """The training objective and its parts for one batch, from full logits [B, L, V] (the reference form).

    batch: `input_ids`, `attention_mask` [B, L] (1 = real token) and one kind of teacher target (TARGET_KEYS:
    top-K ids + log-probs over the full vocabulary, RS-KD draws + counts / N, or an online teacher's logits
    [B, L, V]), or none for perplexity only. Returns 0-d tensors: `loss` = alpha * soft_ce + (1 - alpha) * ce
    (each a mean over its valid positions), `soft_ce`, `kl`, `ce`, `top1` (argmax agreement), and the sums and
    counts (`*_sum`, `kd_tokens`, `ce_tokens`) that let evaluation average over many batches exactly.
    """
    targets = _flat_targets(batch)
    return _finish(_position_sums(logits.reshape(-1, logits.shape[-1]), targets, cfg), targets, cfg)


def _loss_weights(targets: dict[str, torch.Tensor], cfg: KDLossConfig, dtype: torch.dtype) -> torch.Tensor:
    """[4] weights w with loss = w . [soft_ce_sum, kl_sum, top1_sum, ce_sum] (the means `_finish` takes)."""
    kd_tokens = targets["kd_mask"].sum().to(dtype).clamp(min=1.0)
    ce_tokens = targets["label_mask"].sum().to(dtype).clamp(min=1.0)
    zero = torch.zeros_like(kd_tokens)
    return torch.stack([cfg.alpha / kd_tokens, zero, zero, (1.0 - cfg.alpha) / ce_tokens])


class _ChunkedHeadLoss(torch.autograd.Function):
    """lm_head + loss over chunks of positions, with each chunk's gradient taken while its logits exist.

    Forward runs, per chunk: logits = h W^T + b, the position sums, and (when an input needs a gradient) the
    gradient of the chunk's share of the loss w . sums with respect to h, W and b; the logits are then freed.
    Backward only scales the stored gradients by the incoming one. Peak memory is one chunk's logits, as with
    recomputation, but the lm_head runs twice per chunk instead of three times (forward, input gradient), the
    same trick as fused linear-cross-entropy kernels. Only the loss carries a gradient; the sums (for logging)
    are returned detached, their top-1 sum 0 (evaluation, which reads it, takes kd_loss_chunked's other path).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, loss_weights, cfg, chunk_size, names, teacher_head, *targets):
        needs = ctx.needs_input_grad[:3]
        grads: list = [[] if needs[0] else None, torch.zeros_like(weight) if needs[1] else None,
                       torch.zeros_like(bias) if needs[2] else None]
        sums = None
        for start in range(0, hidden.shape[0], chunk_size):
            inputs = [t.detach().requires_grad_(need) if t is not None else None
                      for t, need in zip((hidden[start:start + chunk_size], weight, bias), needs)]
            with torch.enable_grad():
                # No top-1 here: training reads only the loss and its parts (evaluation takes the other path).
                chunk = _position_sums(softcap_logits(torch.nn.functional.linear(*inputs), cfg.logit_softcap),
                                       {n: t[start:start + chunk_size] for n, t in zip(names, targets)}, cfg,
                                       teacher_head, top1=False)
                wanted = [t for t, need in zip(inputs, needs) if need]
                got = iter(torch.autograd.grad((chunk * loss_weights).sum(), wanted) if wanted else ())
            if needs[0]:
                grads[0].append(next(got))  # rows of the input gradient, concatenated below
            for i in (1, 2):
                if needs[i]:
                    grads[i].add_(next(got))  # W and b are shared by every chunk: accumulate
            sums = chunk.detach() if sums is None else sums + chunk.detach()
        if needs[0]:
            grads[0] = torch.cat(grads[0])
        ctx.save_for_backward(*[g if g is not None else torch.empty(0) for g in grads])
        ctx.needs, ctx.num_targets = needs, len(targets)
        loss = (sums * loss_weights).sum()
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        grads = [g * grad_loss.to(g.dtype) if need else None for g, need in zip(ctx.saved_tensors, ctx.needs)]
        return (*grads, None, None, None, None, None, *([None] * ctx.num_targets))


def kd_loss_chunked(hidden: torch.Tensor, weight: torch.Tensor, batch: dict[str, torch.Tensor], cfg: KDLossConfig,
                    chunk_size: int = 1024, bias: torch.Tensor | None = None,
                    teacher_head: tuple | None = None) -> dict[str, torch.Tensor]:
    """kd_loss computed from the final hidden states and the lm_head weight, `chunk_size` positions at a time.

    Peak memory is set by chunk_size x V, not B x L x V: each chunk's gradient is taken as soon as its logits
    exist (`_ChunkedHeadLoss`). Equal in value to kd_loss(hidden @ weight.T + bias, ...) (soft-capped first when
    cfg.logit_softcap is set) and, for `loss`, in gradient; the other parts carry no gradient (logging, eval).
    hidden: [B, L, H] final (normed) states; weight [V, H]; bias [V] or None; chunk_size: positions per chunk
    (fixed shapes per run); teacher_head: (weight [V, Ht], bias or None, soft-cap or None) of an online teacher
    whose final states the batch holds as `teacher_hidden` [B, L, Ht], its logits computed chunk by chunk too.
    """
    targets = _flat_targets(batch)
    flat = hidden.reshape(-1, hidden.shape[-1])
    names = list(targets)
    device_type = flat.device.type
    if torch.is_autocast_enabled(device_type) and not weight.requires_grad:
        # The frozen head in the autocast dtype once per step: autocast would cast it again in every chunk.
        dtype = torch.get_autocast_dtype(device_type)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    loss_weights = _loss_weights(targets, cfg, torch.promote_types(flat.dtype, torch.float32))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (flat, weight, bias)):
        loss, sums = _ChunkedHeadLoss.apply(flat, weight, bias, loss_weights, cfg, chunk_size, names, teacher_head,
                                            *targets.values())
    else:  # evaluation: no gradient to take
        sums = sum(_position_sums(softcap_logits(torch.nn.functional.linear(flat[i:i + chunk_size], weight, bias),
                                                 cfg.logit_softcap),
                                  {n: t[i:i + chunk_size] for n, t in targets.items()}, cfg, teacher_head)
                   for i in range(0, flat.shape[0], chunk_size))
        loss = (sums * loss_weights).sum()
    out = _finish(sums, targets, cfg)
    out["loss"] = loss
    if loss.requires_grad:  # a training step: top-1 was not computed (_ChunkedHeadLoss), so none is reported
        del out["top1"], out["top1_sum"]
    return out


def hidden_state_loss(student: tuple, teacher: tuple, mask: torch.Tensor) -> torch.Tensor:
    """Feature distillation: the mean over decoder layers and real positions of ||h_s - h_t||^2 / ||h_t||^2.

    student, teacher: transformers' `hidden_states` ([B, L, H] each, embeddings first: skipped, nothing quantised
    has acted on them); mask [B, L]. Relative per position, so neither the residual stream's growth with depth
    nor the few positions of very large activations decide it. A 0-d fp32 tensor; no gradient into `teacher`.
    """
    if len(student) != len(teacher):
        raise ValueError(f"--hidden-weight: the student has {len(student) - 1} layers, the teacher "
                         f"{len(teacher) - 1}; feature distillation needs a teacher of the student's depth")
    weights, total = mask.float(), 0.0
    for h_s, h_t in zip(student[1:], teacher[1:]):
        h_s, h_t = h_s.float(), h_t.detach().float()
        total = total + ((h_s - h_t).pow(2).sum(-1) / (h_t.pow(2).sum(-1) + 1e-6) * weights).sum()
    return total / (weights.sum().clamp(min=1.0) * (len(student) - 1))


@torch.no_grad()
def teacher_targets(teacher: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int,
                    hidden_states: bool = False) -> tuple[dict[str, torch.Tensor], tuple | None, tuple | None]:
    """An online teacher's targets for a batch's tokens, without a gradient (it is frozen).

    Returns:
        ({"teacher_logits": [B, L, V]}, None, states) for chunk_size <= 0, else ({"teacher_hidden": [B, L, Ht]},
        (lm_head weight [V, Ht], bias or None, its final-logit soft-cap or None), states): the decoder runs once,
        its lm_head (and soft-cap) inside the loss's chunk loop. states: every layer's hidden states if asked.
    """
    if chunk_size <= 0:
        out = teacher(input_ids=batch["input_ids"], output_hidden_states=hidden_states)
        return {"teacher_logits": out.logits}, None, out.hidden_states
    decoder, head = models.decoder_and_head(teacher, apply_softcap=True)  # applied in `_position_sums`
    out = decoder(input_ids=batch["input_ids"], output_hidden_states=hidden_states)
    return ({"teacher_hidden": out.last_hidden_state},
            (*models.head_weight_and_bias(head), models.logit_softcap(teacher.config)), out.hidden_states)


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: KDLossConfig,
                 chunk_size: int, teacher: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Student forward + KD loss: the one path from a batch to the loss, for training and evaluation.

    With chunk_size > 0 the decoder runs alone and lm_head + loss run in chunks of positions
    (`kd_loss_chunked`), never holding B x L x V logits; 0 computes the full logits (`kd_loss`). With a
    `teacher` (frozen, same vocabulary), its whole distribution on the batch's tokens is the target (the K = V
    loss) and any cached targets in the batch are ignored; cfg.hidden_weight > 0 adds `hidden_state_loss`
    against its hidden states (reported as `hidden`).
    """
    teacher_head, features = None, teacher is not None and cfg.hidden_weight > 0
    if teacher is not None:
        extra, teacher_head, teacher_states = teacher_targets(teacher, batch, chunk_size, features)
        batch = {**{k: v for k, v in batch.items() if k not in TARGET_KEYS}, **extra}
    if chunk_size <= 0:
        student = model(input_ids=batch["input_ids"], output_hidden_states=features)
        out = kd_loss(student.logits, batch, cfg)
    else:
        decoder, head = models.decoder_and_head(model, apply_softcap=True)
        student = decoder(input_ids=batch["input_ids"], output_hidden_states=features)
        weight, bias = models.head_weight_and_bias(head)
        out = kd_loss_chunked(student.last_hidden_state, weight, batch, replace(
            cfg, logit_softcap=models.logit_softcap(model.config)), chunk_size, bias, teacher_head)
    if features:
        out["hidden"] = hidden_state_loss(student.hidden_states, teacher_states, batch["attention_mask"])
        out["loss"] = out["loss"] + cfg.hidden_weight * out["hidden"]
    return out
