"""The KD loss against float64 references (DESIGN §3)."""
from __future__ import annotations

import math

import pytest
import torch

from qat_lora.train.loss import KDLossConfig, kd_loss, topk_soft_ce

V, B, L = 11, 2, 5


def _batch(teacher_logits: torch.Tensor, k: int, mask: torch.Tensor | None = None) -> dict:
    logprobs = torch.log_softmax(teacher_logits, -1)
    values, ids = logprobs.topk(k, -1)
    ids_in = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids_in, "attention_mask": torch.ones(B, L, dtype=torch.uint8) if mask is None else mask,
            "topk_ids": ids, "topk_logprobs": values}


def _logits(seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(B, L, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def test_topk_with_k_equal_v_is_exact_full_cross_entropy():
    student, teacher = _logits(0), _logits(1)
    batch = _batch(teacher, V)
    soft_ce, kl = topk_soft_ce(student, batch["topk_ids"], batch["topk_logprobs"])
    q = torch.softmax(teacher, -1)
    reference = -(q * torch.log_softmax(student, -1)).sum(-1)
    reference_kl = (q * (torch.log_softmax(teacher, -1) - torch.log_softmax(student, -1))).sum(-1)
    torch.testing.assert_close(soft_ce, reference, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(kl, reference_kl, atol=1e-10, rtol=1e-10)


def test_topk_with_tail_matches_bucketed_reference():
    # K < V: the loss is the CE over K+1 buckets, the tail bucket holding everything outside the top-K.
    student, teacher, k = _logits(2), _logits(3), 4
    batch = _batch(teacher, k)
    soft_ce, kl = topk_soft_ce(student, batch["topk_ids"], batch["topk_logprobs"])
    p_s, p_t = torch.softmax(student, -1), torch.softmax(teacher, -1)
    in_topk = torch.zeros_like(p_t).scatter(-1, batch["topk_ids"], 1.0)
    q_k = torch.gather(p_t, -1, batch["topk_ids"])
    s_k = torch.gather(p_s, -1, batch["topk_ids"]).log()
    q_tail, s_tail = (p_t * (1 - in_topk)).sum(-1), (p_s * (1 - in_topk)).sum(-1).log()
    reference = -((q_k * s_k).sum(-1) + q_tail * s_tail)
    entropy = -((q_k * q_k.log()).sum(-1) + q_tail * q_tail.log())
    torch.testing.assert_close(soft_ce.double(), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl.double(), reference - entropy, atol=1e-5, rtol=1e-5)
    assert (kl > -1e-6).all()


def test_kl_is_zero_when_student_equals_teacher():
    teacher = _logits(4)
    batch = _batch(teacher, 3)
    _, kl = topk_soft_ce(teacher, batch["topk_ids"], batch["topk_logprobs"])
    assert kl.abs().max() < 1e-6


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_tempers_both_sides_over_the_same_buckets(temperature):
    student, teacher, k = _logits(5), _logits(6), V - 1  # K+1 buckets = every token on its own
    batch = _batch(teacher, k)
    soft_ce, _ = topk_soft_ce(student, batch["topk_ids"], batch["topk_logprobs"], temperature)
    q = torch.softmax(teacher / temperature, -1)
    reference = -(q * torch.log_softmax(student / temperature, -1)).sum(-1) * temperature**2
    torch.testing.assert_close(soft_ce, reference, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_k_equal_v_tempered_equals_the_full_vocabulary_tempered_cross_entropy(temperature, dtype):
    # K = V leaves no tail; the K log-probs sum to 1 only up to rounding, which once gave the empty tail ~1e-7 of
    # the teacher's mass, inflated by tempering to a visible gap against the student's finite tail fill.
    student, teacher = _logits(7).to(dtype), _logits(8).to(dtype)
    batch = _batch(teacher, V)
    soft_ce, kl = topk_soft_ce(student, batch["topk_ids"], batch["topk_logprobs"], temperature)
    q = torch.softmax(teacher.double() / temperature, -1)
    s = torch.log_softmax(student.double() / temperature, -1)
    reference = -(q * s).sum(-1) * temperature**2
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(soft_ce.double(), reference, atol=tol, rtol=tol)
    torch.testing.assert_close(kl.double(), reference + (q * q.log()).sum(-1) * temperature**2, atol=tol, rtol=tol)


def test_masked_positions_contribute_nothing():
    student, teacher = _logits(7).requires_grad_(), _logits(8)
    mask = torch.ones(B, L, dtype=torch.uint8)
    mask[1, 3:] = 0
    batch = _batch(teacher, 4, mask)
    out = kd_loss(student, batch, KDLossConfig(alpha=0.5))
    out["loss"].backward()
    assert torch.count_nonzero(student.grad[1, 3:]) == 0
    # Garbage in the masked positions changes nothing.
    poisoned = student.detach().clone()
    poisoned[1, 3:] = 1e4
    batch2 = dict(batch, input_ids=batch["input_ids"].clone())
    batch2["input_ids"][1, 4] = 0
    out2 = kd_loss(poisoned, batch2, KDLossConfig(alpha=0.5))
    # Position (1, 2) predicts token 3, which is masked, so its hard label is invalid too.
    for key in ("loss", "soft_ce", "ce", "kl"):
        assert torch.equal(out[key].detach(), out2[key]), key
    assert out["kd_tokens"] == B * L - 2 and out["ce_tokens"] == (L - 1) + 2


def test_all_masked_batch_gives_zero_loss_not_nan():
    batch = _batch(_logits(9), 4, torch.zeros(B, L, dtype=torch.uint8))
    out = kd_loss(_logits(10), batch, KDLossConfig(alpha=0.5))
    assert out["loss"] == 0 and not math.isnan(float(out["loss"]))


def test_alpha_mixes_soft_and_hard_terms():
    student, batch = _logits(11), _batch(_logits(12), 4)
    out = kd_loss(student, batch, KDLossConfig(alpha=0.3))
    torch.testing.assert_close(out["loss"], 0.3 * out["soft_ce"] + 0.7 * out["ce"])
    labels = batch["input_ids"][:, 1:]
    reference_ce = -torch.log_softmax(student[:, :-1], -1).gather(-1, labels.unsqueeze(-1)).mean()
    torch.testing.assert_close(out["ce"].double(), reference_ce, atol=1e-6, rtol=1e-6)


def test_k_equal_v_gradient_matches_full_cross_entropy():
    student, teacher = _logits(13).requires_grad_(), _logits(14)
    batch = _batch(teacher, V)
    kd_loss(student, batch, KDLossConfig())["loss"].backward()
    reference = student.detach().clone().requires_grad_()
    (-(torch.softmax(teacher, -1) * torch.log_softmax(reference, -1)).sum(-1).mean()).backward()
    torch.testing.assert_close(student.grad, reference.grad, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(student.grad).all()


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="--temperature"):
        KDLossConfig(temperature=0)
    with pytest.raises(ValueError, match="--alpha"):
        KDLossConfig(alpha=1.5)


@pytest.mark.parametrize("chunk_size,temperature,alpha,renormalize", [
    (3, 1.0, 1.0, False), (4, 2.0, 0.6, False), (100, 1.0, 0.0, False), (5, 1.0, 0.8, True)])
def test_chunked_loss_equals_plain_in_value_and_gradient(chunk_size, temperature, alpha, renormalize):
    from qat_lora.train.loss import kd_loss_chunked

    gen = torch.Generator().manual_seed(20)
    hidden = torch.randn(B, L, 6, dtype=torch.float64, generator=gen)
    weight = torch.randn(V, 6, dtype=torch.float64, generator=gen)
    bias = torch.randn(V, dtype=torch.float64, generator=gen)
    mask = torch.ones(B, L, dtype=torch.uint8)
    mask[0, -2:] = 0
    batch = _batch(_logits(21), 4, mask)
    cfg = KDLossConfig(temperature=temperature, alpha=alpha, renormalize_topk=renormalize)
    h1, w1, b1 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    plain = kd_loss(torch.nn.functional.linear(h1, w1, b1), batch, cfg)
    (2.5 * plain["loss"]).backward()  # an upstream gradient other than 1 (loss scaling, accumulation)
    h2, w2, b2 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    chunked = kd_loss_chunked(h2, w2, batch, cfg, chunk_size, b2)
    (2.5 * chunked["loss"]).backward()
    for key in ("loss", "soft_ce", "kl", "ce", "kd_tokens", "ce_tokens"):
        torch.testing.assert_close(chunked[key], plain[key], atol=1e-12, rtol=1e-12)
    assert "top1" not in chunked  # a training step computes no [N, V] argmax for a metric it never reads
    for got, want in ((h2, h1), (w2, w1), (b2, b1)):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-12, rtol=1e-12)
    with torch.no_grad():  # evaluation takes the path without gradients: same values
        evaluated = kd_loss_chunked(h2, w2, batch, cfg, chunk_size, b2)
    for key in ("loss", "soft_ce", "kl", "ce", "top1"):
        torch.testing.assert_close(evaluated[key], plain[key], atol=1e-12, rtol=1e-12)


def test_chunked_loss_gradient_flows_only_through_the_loss_and_only_to_what_needs_it():
    from qat_lora.train.loss import kd_loss_chunked

    gen = torch.Generator().manual_seed(22)
    hidden = torch.randn(B, L, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(V, 6, dtype=torch.float64, generator=gen)  # frozen head (the LoRA case)
    parts = kd_loss_chunked(hidden, weight, _batch(_logits(23), 4), KDLossConfig(), 3)
    assert parts["loss"].requires_grad and not parts["soft_ce"].requires_grad and not parts["kl"].requires_grad
    parts["loss"].backward()
    assert weight.grad is None and hidden.grad.abs().sum() > 0


@pytest.mark.slow
def test_sampled_targets_are_unbiased_for_the_full_soft_cross_entropy():
    """Mean of the RS-KD loss over many independent draws -> the exact full-vocabulary soft CE."""
    from qat_lora.cache.encodings import SampledEncoding, encode_rows

    gen = torch.Generator().manual_seed(30)
    teacher = torch.randn(1, 3, V, generator=gen, dtype=torch.float64) * 2
    student = torch.randn(1, 3, V, generator=gen, dtype=torch.float64) * 2
    exact = -(torch.softmax(teacher, -1) * torch.log_softmax(student, -1)).sum(-1)  # [1, 3]
    encoding, trials = SampledEncoding(num_samples=8), 2000
    losses = []
    for seed in range(trials):
        row = encoding.decode(encode_rows(encoding, teacher, V, [seed])[0], 3, V)
        batch = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "attention_mask": torch.ones(1, 3),
                 "sample_ids": row["sample_ids"][None], "sample_weights": row["sample_weights"][None]}
        losses.append(kd_loss(student, batch, KDLossConfig())["soft_ce"])
    losses = torch.stack(losses).double()
    standard_error = losses.std() / trials**0.5
    # |mean - exact| within 4 standard errors (a false alarm about once in 16,000 runs).
    assert abs(losses.mean() - exact.mean()) < 4 * standard_error, (losses.mean(), exact.mean(), standard_error)
    # A biased estimator (the top-K renormalised over the K, the tail dropped) misses it by far more.
    q = torch.softmax(teacher, -1)
    top = q.topk(3, -1)
    renormalised = -(top.values / top.values.sum(-1, keepdim=True)
                     * torch.log_softmax(student, -1).gather(-1, top.indices)).sum(-1)
    assert abs(renormalised.mean() - exact.mean()) > 10 * standard_error


def test_chunked_loss_equals_plain_for_sampled_targets():
    from qat_lora.cache.encodings import SampledEncoding, encode_rows
    from qat_lora.train.loss import kd_loss_chunked

    gen = torch.Generator().manual_seed(40)
    hidden = torch.randn(B, L, 6, dtype=torch.float64, generator=gen)
    weight = torch.randn(V, 6, dtype=torch.float64, generator=gen)
    encoding = SampledEncoding(num_samples=10)
    rows = [encoding.decode(r, L, V) for r in encode_rows(encoding, _logits(41), V, [0, 1])]
    batch = {"input_ids": torch.randint(0, V, (B, L), generator=gen), "attention_mask": torch.ones(B, L),
             "sample_ids": torch.stack([r["sample_ids"] for r in rows]),
             "sample_weights": torch.stack([r["sample_weights"] for r in rows])}
    cfg = KDLossConfig(alpha=0.7)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    plain = kd_loss(h1 @ weight.T, batch, cfg)
    plain["loss"].backward()
    chunked = kd_loss_chunked(h2, weight, batch, cfg, 3)
    chunked["loss"].backward()
    for key in ("loss", "soft_ce", "ce"):
        torch.testing.assert_close(chunked[key], plain[key], atol=1e-12, rtol=1e-12)
    with torch.no_grad():  # top-1 is evaluation's (a training step computes none)
        torch.testing.assert_close(kd_loss_chunked(hidden, weight, batch, cfg, 3)["top1"], plain["top1"])
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-12, rtol=1e-12)
    reference = -(batch["sample_weights"] * torch.log_softmax(h1.detach() @ weight.T, -1).gather(
        -1, batch["sample_ids"])).sum(-1).mean()
    torch.testing.assert_close(plain["soft_ce"], reference)


def test_renormalised_topk_baseline_matches_its_reference_and_differs_from_tail_form():
    student, teacher, k = _logits(50), _logits(51), 4
    batch = _batch(teacher, k)
    renorm, _ = topk_soft_ce(student, batch["topk_ids"], batch["topk_logprobs"], renormalize=True)
    q = torch.softmax(batch["topk_logprobs"], -1)
    s = torch.log_softmax(student.gather(-1, batch["topk_ids"]), -1)
    torch.testing.assert_close(renorm, -(q * s).sum(-1), atol=1e-12, rtol=1e-12)
    with_tail, _ = topk_soft_ce(student, batch["topk_ids"], batch["topk_logprobs"])
    assert not torch.allclose(renorm, with_tail)
