"""Batched sampling: greedy, temperature, top-k/top-p, counter-based seeds, log-probs."""

from __future__ import annotations

import torch

from marlaas.rollout.sampling import filtered_probs_BV, sample_B, uniform_B


def _knobs(B: int, temperature: float, top_k: int = 0, top_p: float = 1.0):
    return (
        torch.full((B,), temperature),
        torch.full((B,), top_k, dtype=torch.long),
        torch.full((B,), top_p),
    )


def test_uniform_is_a_pure_function_of_seed_and_counter() -> None:
    seed_B = torch.tensor([0, 1, 2**40 + 7, -5, 0])
    counter_B = torch.tensor([0, 0, 3, 9, 1])
    u1 = uniform_B(seed_B, counter_B)
    u2 = uniform_B(seed_B.flip(0), counter_B.flip(0)).flip(0)
    assert torch.equal(u1, u2)
    assert len(set(u1.tolist())) == 5
    many = uniform_B(torch.full((20000,), 123), torch.arange(20000))
    assert float(many.min()) > 0.0 and float(many.max()) <= 1.0
    assert abs(float(many.mean()) - 0.5) < 0.01
    # Roughly uniform: each tenth of (0, 1] gets about a tenth of the draws.
    hist = torch.histc(many, bins=10, min=0.0, max=1.0) / many.numel()
    assert float((hist - 0.1).abs().max()) < 0.01


def test_greedy_takes_argmax_and_logprobs_at_temperature_one() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    tokens, logprobs = sample_B(logits, *_knobs(4, 0.0), torch.rand(4), all_greedy=True)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)


def test_logprobs_are_at_temperature_before_filters() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    t, k, p = _knobs(3, 0.7, top_k=5, top_p=0.8)
    tokens, logprobs = sample_B(logits, t, k, p, torch.rand(3))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)


def test_empirical_frequencies_follow_the_filtered_distribution() -> None:
    torch.manual_seed(2)
    V, N = 12, 40000
    logits = torch.randn(1, V) * 2
    cases = [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.7), (0.8, 6, 0.6)]
    for temperature, top_k, top_p in cases:
        t, k, p = _knobs(N, temperature, top_k, top_p)
        u = uniform_B(torch.full((N,), 7), torch.arange(N))
        tokens, _ = sample_B(logits.expand(N, V), t, k, p, u, any_filter=top_k > 0 or top_p < 1)
        freq = torch.bincount(tokens, minlength=V).float() / N
        want = filtered_probs_BV(logits, t[:1], k[:1], p[:1])[0]
        assert float((freq - want).abs().max()) < 0.015, (temperature, top_k, top_p)
        assert bool((freq[want == 0] == 0).all()), "sampled a token the filters removed"


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(3)
    logits = torch.randn(64, 30)
    u = torch.rand(64)
    for knobs in (_knobs(64, 1.0, top_k=1), _knobs(64, 1.0, top_p=1e-6)):
        tokens, _ = sample_B(logits, *knobs, u)
        assert torch.equal(tokens, logits.argmax(-1))


def test_never_samples_impossible_tokens() -> None:
    V, N = 20, 5000
    logits = torch.full((N, V), float("-inf"))
    logits[:, 3] = 0.0
    logits[:, 17] = 1.0
    u = uniform_B(torch.zeros(N, dtype=torch.long), torch.arange(N))
    for any_filter in (False, True):
        tokens, logprobs = sample_B(logits, *_knobs(N, 1.0), u, any_filter=any_filter)
        assert set(tokens.tolist()) == {3, 17}
        assert bool(torch.isfinite(logprobs).all())


def test_a_row_samples_the_same_whatever_its_batch_mates() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, 30)
    seed_B = torch.tensor([11, 12, 13, 14, 15])
    counter_B = torch.tensor([0, 4, 2, 8, 1])
    t = torch.tensor([1.0, 0.0, 0.9, 1.2, 0.5])
    k = torch.tensor([0, 0, 5, 0, 3])
    p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0])
    together, _ = sample_B(logits, t, k, p, uniform_B(seed_B, counter_B))
    for b in range(5):
        s = slice(b, b + 1)
        alone, _ = sample_B(logits[s], t[s], k[s], p[s], uniform_B(seed_B[s], counter_B[s]))
        assert int(alone) == int(together[b])


def test_the_native_kernel_samples_as_torchs_ops() -> None:
    """Without top-k/top-p, `kernels.sample_rows` (one call) gives torch's ops' tokens
    and log-probs: greedy and sampling rows mixed, a greedy batch, strided logits."""
    from marlaas.model import kernels

    assert kernels.native_kernels("sample_rows")
    g = torch.Generator().manual_seed(5)
    B, V = 512, 97
    logits = (torch.randn(B, V + 3, generator=g) * 3)[:, :V]  # rows of a wider buffer
    t = torch.rand(B, generator=g) + 0.3
    t[::5] = 0.0
    _, k, p = _knobs(B, 1.0)
    u = torch.rand(B, generator=g)
    for temperature, all_greedy in ((t, False), (torch.zeros(B), True)):
        got = sample_B(logits, temperature, k, p, u, all_greedy=all_greedy, any_filter=False)
        with kernels.torch_path():
            want = sample_B(logits, temperature, k, p, u, all_greedy=all_greedy, any_filter=False)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert kernels.sample_rows(logits.double(), t, u, False) is None
    assert kernels.sample_rows(logits.T, t[:V], u[:V], False) is None  # strided tokens
