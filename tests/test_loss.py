"""lorabench.loss: the memory-lean token_logprobs against the plain full-logits path (values,
LoRA gradients, no_grad, plain and PEFT models, bytes saved for backward), token-budget
micro-batches and the GRPO advantage/loss functions."""
import math

import pytest
import torch
from meters import saved_activation_bytes  # benchmarks/

from lorabench.loss import (
    body_and_head,
    group_advantages,
    grpo_loss,
    plain_token_logprobs,
    token_budget_batches,
    token_logprobs,
    token_logprobs_and_entropy,
)

# lean vs plain differ only in float32 rounding: a chunked matmul may block the sum differently, and
# logit - logsumexp rounds differently from log_softmax; at |logp| ~ 6 one float32 ulp is 4.8e-7.
ATOL, RTOL = 1e-6, 1e-6


def padded_batch(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [N, L] ids and attention mask, as the trainer builds them."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
    return ids, attn


@pytest.fixture(scope="module")
def batch(sample_sequences, tokenizer):
    """Three sequences of three different lengths (two chat problems and a cut-down copy)."""
    seqs, _ = sample_sequences
    three = [seqs[0], seqs[1], seqs[0][: len(seqs[0]) // 3]]
    assert len({len(s) for s in three}) == 3
    return padded_batch(three, tokenizer.pad_token_id)


def tiny_plain_qwen3(vocab_size: int, hidden_size: int = 64, seed: int = 0):
    """A one-layer random Qwen3 (no PEFT), small enough to build inside a test."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


# --- token_logprobs: values ------------------------------------------------------------------------
def test_loss_kl_off_is_bit_identical_and_on_pulls_towards_the_reference():
    """kl_beta = 0 with the reference given: the loss and its gradient are exactly those without a
    reference; kl_beta > 0 adds β·(ref/p - 1) to d loss / d logp per token (mean over tokens): the
    gradient moves each token's log-prob towards the reference's."""
    ref, adv, mask = torch.tensor([[-1.5, -1.0]]), torch.tensor([1.0]), torch.ones(1, 2)

    def grad(**kl):
        logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        loss, _ = grpo_loss(logp, logp.detach(), adv, mask, 0.2, **kl)
        loss.backward()
        return loss.detach(), logp.grad

    (plain, g0), (off, g_off), (on, g_on) = grad(), grad(ref_logp=ref, kl_beta=0.0), grad(ref_logp=ref, kl_beta=0.5)
    assert torch.equal(plain, off) and torch.equal(g0, g_off)
    logp = torch.tensor([[-1.0, -2.0]])
    assert torch.allclose(g_on - g0, 0.5 * (1 - torch.exp(ref - logp)) / 2)   # d k3 / d logp = 1 - e^(ref-logp)
    assert on > plain


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_lean_logprobs_equal_plain_on_peft_model(make_peft_model, batch, temperature):
    model = make_peft_model()
    ids, attn = batch
    rows = ids.shape[0] * (ids.shape[1] - 1)
    with torch.no_grad():
        expected = plain_token_logprobs(model, ids, attn, temperature)             # [N, L-1]
        for chunk_size in (1, 7, 64, rows + 5):
            got = token_logprobs(model, ids, attn, temperature, chunk_size=chunk_size)
            assert got.shape == expected.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # with gradients enabled the chunks go through the checkpoint: same values
    torch.testing.assert_close(token_logprobs(model, ids, attn, temperature, chunk_size=7).detach(), expected,
                               atol=ATOL, rtol=RTOL)


def test_temperature_matters(make_peft_model, batch):
    """Guards the test above against a path that ignores temperature (both would still agree)."""
    model = make_peft_model()
    ids, attn = batch
    with torch.no_grad():
        assert (token_logprobs(model, ids, attn, 1.0) - token_logprobs(model, ids, attn, 0.7)).abs().max() > 1e-2


def test_lean_logprobs_follow_disabled_adapter(make_peft_model, batch):
    """The KL reference runs under disable_adapter(): the lean path must see the base model then."""
    model = make_peft_model()
    ids, attn = batch
    with torch.no_grad():
        with_adapter = token_logprobs(model, ids, attn, 1.0, chunk_size=32)
        with model.disable_adapter():
            base = token_logprobs(model, ids, attn, 1.0, chunk_size=32)
            torch.testing.assert_close(base, plain_token_logprobs(model, ids, attn, 1.0), atol=ATOL, rtol=RTOL)
    assert (with_adapter - base).abs().max() > 1e-3  # the perturbed adapter does change log-probs


def test_lean_logprobs_on_plain_model(tiny_model_dir, batch):
    from lorabench.models import load_model
    model = load_model(str(tiny_model_dir), "float32", "cpu")
    ids, attn = batch
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, ids, attn, 0.7, chunk_size=13),
                                   plain_token_logprobs(model, ids, attn, 0.7), atol=ATOL, rtol=RTOL)


def test_no_graph_under_no_grad(make_peft_model, batch):
    model = make_peft_model()
    ids, attn = batch
    with torch.no_grad():
        saved, logp = saved_activation_bytes(model, lambda: token_logprobs(model, ids, attn, 1.0, chunk_size=7))
    assert not logp.requires_grad and logp.grad_fn is None
    assert saved == 0
    assert token_logprobs(model, ids, attn, 1.0, chunk_size=7).requires_grad  # ... and one with grad


def test_refuses_models_that_change_logits_after_the_head():
    model = tiny_plain_qwen3(vocab_size=64)
    ids = torch.randint(0, 64, (1, 5))
    model.config.final_logit_softcapping = 30.0  # what Gemma 2 does; the plain forward of Qwen3 ignores it
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        token_logprobs(model, ids, torch.ones_like(ids), 1.0)


def test_bad_arguments_are_refused(make_peft_model, batch):
    model = make_peft_model()
    ids, attn = batch
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, attn, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(model, ids, attn, 1.0, chunk_size=0)


# --- token_logprobs: gradients and memory ----------------------------------------------------------
def lora_gradients(model, logprob_fn, mask) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (logprob_fn() * mask).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def test_lora_gradients_equal_plain(make_peft_model, batch):
    model = make_peft_model()
    ids, attn = batch
    mask = attn[:, 1:].float()                                                     # [N, L-1] real targets
    expected = lora_gradients(model, lambda: plain_token_logprobs(model, ids, attn, 0.7), mask)
    got = lora_gradients(model, lambda: token_logprobs(model, ids, attn, 0.7, chunk_size=7), mask)
    assert expected.keys() == got.keys() and len(got) > 0
    assert all("lora_" in name for name in got)
    for name, grad in expected.items():
        assert grad.norm() > 0, name
        # float32 sums taken in a different order: ~1e-6 relative (measured ~1.3e-6 at most)
        relative_error = ((got[name] - grad).norm() / grad.norm()).item()
        assert relative_error < 1e-5, (name, relative_error)


def completion_positions(attn: torch.Tensor, prompt_len: int = 5) -> torch.Tensor:
    """[N, L-1] bool: the targets after the first `prompt_len` tokens that are not padding, as a
    rollout's completion mask marks them (the prompts here are the first tokens of each sequence)."""
    positions = attn[:, 1:].bool().clone()
    positions[:, :prompt_len - 1] = False
    return positions


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_positions_give_the_same_values_there_and_zero_elsewhere(make_peft_model, batch, temperature):
    model = make_peft_model()
    ids, attn = batch
    positions = completion_positions(attn)
    assert 0 < positions.sum() < positions.numel()
    with torch.no_grad():
        expected = plain_token_logprobs(model, ids, attn, temperature)
        for chunk_size in (1, 7, 512):
            got = token_logprobs(model, ids, attn, temperature, chunk_size=chunk_size, positions=positions)
            assert got.shape == expected.shape and got.dtype == torch.float32
            torch.testing.assert_close(got[positions], expected[positions], atol=ATOL, rtol=RTOL)
            assert torch.all(got[~positions] == 0)
        nothing = token_logprobs(model, ids, attn, temperature, positions=torch.zeros_like(positions))
    assert nothing.shape == expected.shape and torch.all(nothing == 0)


def test_positions_give_the_same_lora_gradients(make_peft_model, batch):
    """What training uses: the head only at completion positions, the same gradients as the plain
    path's under the completion mask."""
    model = make_peft_model()
    ids, attn = batch
    positions = completion_positions(attn)
    mask = positions.float()
    expected = lora_gradients(model, lambda: plain_token_logprobs(model, ids, attn, 0.7), mask)
    got = lora_gradients(model, lambda: token_logprobs(model, ids, attn, 0.7, chunk_size=7, positions=positions),
                         mask)
    assert expected.keys() == got.keys() and len(got) > 0
    for name, grad in expected.items():
        assert grad.norm() > 0, name
        relative_error = ((got[name] - grad).norm() / grad.norm()).item()
        assert relative_error < 1e-5, (name, relative_error)


def test_positions_of_the_wrong_shape_are_refused(make_peft_model, batch):
    model = make_peft_model()
    ids, attn = batch
    with pytest.raises(ValueError, match=r"positions has shape .* must be \[N, L-1\]"):
        token_logprobs(model, ids, attn, 1.0, positions=attn.bool())


def head_saved_bytes(model, ids, attn) -> tuple[int, int]:
    """Bytes saved for backward beyond what the transformer body saves: (lean path, plain path)."""
    decoder, _ = body_and_head(model)
    body, _ = saved_activation_bytes(model, lambda: decoder(input_ids=ids, attention_mask=attn,
                                                            use_cache=False).last_hidden_state)
    lean, _ = saved_activation_bytes(model, lambda: token_logprobs(model, ids, attn, 1.0, chunk_size=16))
    plain, _ = saved_activation_bytes(model, lambda: plain_token_logprobs(model, ids, attn, 1.0))
    return lean - body, plain - body


def test_lean_path_saves_nothing_vocabulary_sized(make_peft_model, batch):
    """The plain path keeps the fp32 log-softmax [N, L-1, V] for backward; the lean path keeps only
    the hidden rows [N*(L-1), H] and the int64 targets its checkpoints recompute from. On the tiny
    model H/V = 256/512, so the lean extra is only about half the plain one; on Qwen3-0.6B
    (H/V = 1024/151936, and bf16 hidden rows) it is ~300x smaller: see the next test for a wide V."""
    model = make_peft_model()
    ids, attn = batch
    n, length = ids.shape
    lean, plain = head_saved_bytes(model, ids, attn)
    assert plain >= n * (length - 1) * model.config.vocab_size * 4                 # one fp32 [N, L-1, V]
    assert lean <= n * length * (model.config.hidden_size * 4 + 8)                 # hidden rows + targets
    assert lean < plain


def test_lean_saved_bytes_do_not_grow_with_vocabulary():
    """Same body (H=64), vocabulary 16x larger: the lean path saves exactly as much as before, the
    plain one grows by at least N*(L-1)*dV*4 bytes; at V=8192 the lean extra is <1% of [N, L-1, V]."""
    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    attn[1, 25:] = 0
    rows = ids.shape[0] * (ids.shape[1] - 1)
    small_lean, small_plain = head_saved_bytes(tiny_plain_qwen3(512), ids, attn)
    large_lean, large_plain = head_saved_bytes(tiny_plain_qwen3(8192), ids, attn)
    assert large_lean == small_lean
    assert large_plain - small_plain >= rows * (8192 - 512) * 4
    assert large_plain >= rows * 8192 * 4
    assert large_lean < 0.01 * rows * 8192 * 4


# --- token_budget_batches --------------------------------------------------------------------------
def check_batches(lengths: list[int], budget: int) -> list[list[int]]:
    batches = token_budget_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))   # each index exactly once
    for b in batches:
        assert b, "no empty batch"
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= budget or len(b) == 1, (b, padded)                         # oversize only alone
    return batches


def test_budget_batches_docstring_example():
    assert check_batches([3, 10, 4, 10, 2], 20) == [[1, 3], [2, 0, 4]]


def test_budget_batches_random_lengths_respect_budget_and_are_deterministic():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 400, (257,), generator=gen).tolist()
    for budget in (350, 1000, 4096, 10**6):
        batches = check_batches(lengths, budget)
        assert batches == token_budget_batches(list(lengths), budget)
        longest = [max(lengths[i] for i in b) for b in batches]
        assert longest == sorted(longest, reverse=True)                               # longest batches first
    assert len(token_budget_batches(lengths, 10**6)) == 1
    # little padding: sorting keeps padded tokens within a few % of the real ones at a 4096 budget
    padded = sum(len(b) * max(lengths[i] for i in b) for b in token_budget_batches(lengths, 4096))
    assert padded < 1.1 * sum(lengths)


def test_budget_batches_edge_cases():
    assert token_budget_batches([], 100) == []
    assert check_batches([500, 20, 30], 100) == [[0], [2, 1]]                        # oversize: alone
    assert check_batches([50, 50, 50], 49) == [[0], [1], [2]]                       # all oversize
    assert check_batches([5, 5, 5], 15) == [[0, 1, 2]]                              # exactly at the budget
    with pytest.raises(ValueError, match="token_budget"):
        token_budget_batches([1], 0)


def test_budget_batches_avoid_a_last_batch_of_one():
    """A batch of one compiles the layers again (grpo.compile=all): the last one borrows a sequence
    when the batch before can spare one and still hold two."""
    assert check_batches([5, 5, 5, 5], 15) == [[0, 1], [2, 3]]
    assert check_batches([5, 5, 4, 3, 2], 15) == [[0, 1, 2], [3, 4]]                # no batch of one at all
    assert check_batches([9, 5, 5], 15) == [[0], [1, 2]]                            # a long one stays alone
    assert check_batches([6, 6, 5], 12) == [[0, 1], [2]]                            # two cannot spare one
    gen = torch.Generator().manual_seed(1)
    for n in range(2, 120):
        lengths = torch.randint(200, 340, (n,), generator=gen).tolist()
        batches = check_batches(lengths, 16384)
        assert len(batches) == 1 or len(batches[-1]) > 1


# --- moved advantage and loss ----------------------------------------------------------------------
def test_advantages_equal_groups_zero_and_group_layout():
    assert torch.equal(group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2), torch.zeros(4))
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]), 4)
    assert adv[0] == pytest.approx(adv[7].item()) and adv[0] == pytest.approx(math.sqrt(3), rel=1e-3)
    assert torch.all(adv[1:7] < 0)


def _loss(ratio, adv, clip=0.2, mask=None):
    logp = torch.log(torch.tensor(ratio)).requires_grad_(True)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask)
    loss, metrics = grpo_loss(logp, torch.zeros_like(logp), torch.tensor(adv), mask, clip)
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_loss_on_policy_and_clipping():
    loss, grad, metrics = _loss([[1.0, 1.0], [1.0, 1.0]], [2.0, -1.0])
    assert loss == pytest.approx(-0.5) and torch.all(grad[0] < 0) and torch.all(grad[1] > 0)
    assert metrics["clip_fraction"] == 0.0
    loss, grad, metrics = _loss([[1.5]], [1.0])
    assert loss == pytest.approx(-1.2) and grad.abs().sum() == 0 and metrics["clip_fraction"] == 1.0
    loss, grad, _ = _loss([[0.5]], [-1.0])
    assert loss == pytest.approx(0.8) and grad.abs().sum() == 0


def test_loss_masks_tokens_and_averages_per_sequence():
    loss, grad, metrics = _loss([[1.0, 9.0, 9.0], [1.0, 1.0, 1.0]], [1.0, 1.0], mask=[[1.0, 0.0, 0.0], [1.0] * 3])
    assert loss == pytest.approx(-1.0) and torch.all(grad[0, 1:] == 0)
    assert grad[0, 0] == pytest.approx(3 * grad[1, 0].item()) and metrics["clip_fraction"] == 0.0


def test_loss_kl_term():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    loss, metrics = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones_like(logp), 0.2, ref_logp=ref, kl_beta=0.5)
    k3 = (torch.exp(ref - logp) - (ref - logp) - 1).mean().item()
    assert k3 > 0 and metrics["kl"] == pytest.approx(k3) and loss.item() == pytest.approx(0.5 * k3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_function_equals_autograd(temperature):
    """HeadLogprobs' hand-written backward against autograd through the plain chunk, for the rows
    and (were the head trained, e.g. tied embeddings) its weight: fp32, to 1e-6."""
    from lorabench.loss import HeadLogprobs, _chunk_logprobs
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=g))
    rows = torch.randn(7, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (7,), generator=g)
    weights = torch.randn(7, generator=g)
    expected = _chunk_logprobs(head, rows, targets, temperature)
    (expected * weights).sum().backward()
    rows_grad, head_grad = rows.grad.clone(), head.weight.grad.clone()
    rows.grad, head.weight.grad = None, None
    got, no_entropy = HeadLogprobs.apply(rows, head.weight, targets, temperature, False, False)
    (got * weights).sum().backward()
    assert torch.allclose(got, expected, atol=1e-6, rtol=0) and no_entropy.numel() == 0
    assert torch.allclose(rows.grad, rows_grad, atol=1e-6, rtol=1e-6)
    assert torch.allclose(head.weight.grad, head_grad, atol=1e-6, rtol=1e-6)


# --- entropy beside the log-probs ---------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_equals_the_full_softmax_and_stays_in_its_bounds(make_peft_model, batch, temperature):
    """token_logprobs_and_entropy: the same log-probs as token_logprobs, and the entropy of
    softmax(logits / T) at each wanted position as the full-vocabulary softmax computes it, in
    [0, log V]; 0 where no position is wanted; nothing of it has gradients."""
    model = make_peft_model()
    ids, attn = batch
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature   # [N, L-1, V]
    expected = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)           # [N, L-1]
    positions = attn[:, 1:].bool() & (torch.arange(ids.shape[1] - 1) % 2 == 0)               # every other token
    for chunk_size in (7, 512):
        logp, entropy = token_logprobs_and_entropy(model, ids, attn, temperature, chunk_size=chunk_size,
                                                   positions=positions)
        torch.testing.assert_close(logp, token_logprobs(model, ids, attn, temperature, chunk_size=chunk_size,
                                                        positions=positions))
        torch.testing.assert_close(entropy[positions], expected[positions], atol=1e-5, rtol=1e-5)
        assert entropy[~positions].abs().sum() == 0 and not entropy.requires_grad and logp.requires_grad
        assert entropy[positions].min() >= 0 and entropy.max() <= math.log(logits.shape[-1]) + 1e-5


def test_entropy_through_a_head_with_a_bias():
    """Heads HeadLogprobs does not take (a bias) get the same entropy from their own head call."""
    model = tiny_plain_qwen3(vocab_size=96)
    model.lm_head = torch.nn.Linear(64, 96, bias=True)
    torch.nn.init.normal_(model.lm_head.bias, std=1.0)
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    expected = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    _, entropy = token_logprobs_and_entropy(model, ids, attn, 1.0, chunk_size=5)
    torch.testing.assert_close(entropy, expected, atol=1e-5, rtol=1e-5)
