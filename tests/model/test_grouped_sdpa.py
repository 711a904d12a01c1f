"""Forwards without an engine plan attend like transformers' own `sdpa` forward once the
engine's attention is installed; masked queries over grouped key/value heads take SDPA's
own grouping (`enable_gqa`) instead of `repeat_kv` copies, with the same logits and
gradients, sliding windows included."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from helpers.tiny_archs import ARCHS, WINDOW, tiny_model
from marlaas.model.attention import install_attention

VOCAB = 64


def _run(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, ...]:
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, attention_mask=attn, use_cache=False).logits
    valid = attn.bool()
    (logits.sin() * valid[..., None]).sum().backward()
    assert embeds.grad is not None
    return logits[valid], embeds.grad[valid]


@pytest.mark.parametrize("arch", ARCHS)
def test_installed_attention_is_transformers_own(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3 * WINDOW, WINDOW + 1, 2, 2 * WINDOW])
    ids = torch.randint(4, VOCAB, (4, int(lengths.max())), generator=g)
    attn = (torch.arange(ids.shape[1]) < lengths[:, None]).long()  # right padding
    plain = tiny_model(arch, VOCAB)
    implementation = plain.config._attn_implementation
    want = _run(plain, ids, attn)
    routed = tiny_model(arch, VOCAB)
    install_attention(routed)
    calls: list[int] = []
    original = hf_sdpa.repeat_kv

    def counted(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
        calls.append(n_rep)
        return original(hidden, n_rep)

    monkeypatch.setattr(hf_sdpa, "repeat_kv", counted)
    got = _run(routed, ids, attn)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if implementation == "sdpa":  # grouped heads (2 key/value heads for 4): never repeated
        assert calls == []
