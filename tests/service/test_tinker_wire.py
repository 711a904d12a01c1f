"""The Tinker wire: `tinker://` paths, the SDK's protobuf bodies (encoded and decoded
by the SDK's own converters on the other side), and the conversion to marlaas
records with the refusals that say what to fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from marlaas.service.tinker import convert, wire
from marlaas.service.tinker.errors import UserError
from marlaas.service.tinker.paths import TinkerPath, model_id, new_session_id
from marlaas.service.tinker.protobuf import (
    decode_forward_backward,
    decompress,
    encode_forward_backward,
    encode_sample,
)
from marlaas.train.objectives import PPO, CrossEntropy, ImportanceSampling

LIMITS = convert.ModelLimits(vocab_size=258, max_positions=256)


def test_paths_parse_print_and_refuse() -> None:
    run = model_id(new_session_id(), 3)
    path = TinkerPath.parse(f"tinker://{run}/sampler_weights/step-0001")
    assert (path.run_id, path.kind, path.name) == (run, "sampler", "step-0001")
    assert str(path) == f"tinker://{run}/sampler_weights/step-0001"
    assert path.checkpoint_id == "sampler_weights/step-0001"
    assert TinkerPath.parse(f"tinker://{run}/weights/final").kind == "training"
    # The SDK's own parser agrees on the parts.
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(str(path))
    assert (parsed.training_run_id, parsed.checkpoint_type) == (run, "sampler")
    for bad in (
        "s3://bucket/x",
        f"tinker://{run}/weights",
        f"tinker://{run}/external_weights/x",
        f"tinker://{run}/weights/a b",
        "tinker://someone-else/weights/x",
    ):
        with pytest.raises(UserError, match=r"tinker path|not valid"):
            TinkerPath.parse(bad)


def _sdk_body(data: list[types.Datum], loss_fn: str, config: dict[str, float] | None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="ses_0123456789abcdef:train:0",
        seq_id=7,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = True
    return bytes(msg.SerializeToString())


def test_the_sdks_forward_backward_body_decodes_to_the_same_tensors() -> None:
    rl = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={
            "target_tokens": torch.tensor([6, 7, 8, 9]),
            "logprobs": torch.tensor([0.0, -0.5, -1.0, -1.5]),
            "advantages": torch.tensor([0.0, 0.3, 0.3, 0.3]),
        },
    )
    sft = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])]
        ),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4],
            "weights": types.TensorData.from_torch_sparse(torch.tensor([[0.0, 1.0, 1.0]])),
        },
    )
    body = decode_forward_backward(_sdk_body([rl, sft], "ppo", {"clip_high_threshold": 1.3}))
    assert (body.model_id, body.seq_id, body.loss_fn, body.forward_only) == (
        "ses_0123456789abcdef:train:0",
        7,
        "ppo",
        True,
    )
    assert body.loss_fn_config == {"clip_high_threshold": 1.3}
    first, second = body.data
    assert first.tokens.tolist() == [5, 6, 7, 8]
    np.testing.assert_allclose(first.inputs["logprobs"], [0.0, -0.5, -1.0, -1.5])
    assert first.inputs["target_tokens"].dtype == np.int64
    assert second.tokens.tolist() == [1, 2, 3]  # chunks concatenated
    assert second.inputs["weights"].tolist() == [[0.0, 1.0, 1.0]]  # CSR expanded


def test_malformed_bodies_say_what_is_wrong() -> None:
    with pytest.raises(UserError, match="not a ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff garbage")
    with pytest.raises(UserError, match="Content-Encoding 'br'"):
        decompress(b"x", "br")
    import zstandard

    packed = zstandard.ZstdCompressor().compress(b"hello")
    assert decompress(packed, "zstd") == b"hello"


def test_replies_decode_with_the_sdks_own_decoders() -> None:
    out = deserialize_forward_backward_output(
        encode_forward_backward([[-0.5, -1.0], [-2.0]], {"loss:sum": 3.5, "tokens:sum": 3.0})
    )
    assert out.metrics == {"loss:sum": 3.5, "tokens:sum": 3.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-0.5, -1.0], [-2.0]]
    assert out.loss_fn_outputs[0]["logprobs"].shape == [2]
    sample = deserialize_sample_response(
        encode_sample(
            [([4, 5, 1], [-0.1, -0.2, -0.3], "stop"), ([9], [-1.5], "length")], [None, -2.0, -0.25]
        )
    )
    assert [s.tokens for s in sample.sequences] == [[4, 5, 1], [9]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.sequences[1].logprobs == pytest.approx([-1.5])
    assert sample.prompt_logprobs == [None, -2.0, -0.25]


def _body(*data: wire.DatumIn) -> wire.ForwardBackwardBody:
    return wire.ForwardBackwardBody("m", 1, "x", {}, False, list(data))


def _datum(n: int = 4, **inputs: list[float] | list[int]) -> wire.DatumIn:
    arrays = {k: np.asarray(v) for k, v in inputs.items()}
    arrays.setdefault("target_tokens", np.arange(1, n + 1))
    return wire.DatumIn(tokens=np.arange(n), inputs=arrays)


def test_data_convert_position_by_position_with_the_losses_weights() -> None:
    sft = convert.datums(_body(_datum(weights=[0.0, 0.0, 1.0, 1.0])), CrossEntropy(), LIMITS)
    assert sft[0].target_ids == (1, 2, 3, 4) and sft[0].weights_T == (0.0, 0.0, 1.0, 1.0)
    plain = convert.datums(_body(_datum()), CrossEntropy(), LIMITS)
    assert plain[0].weights_T == (1.0,) * 4  # no weights: every position counts
    rl = _datum(logprobs=[0.0, 0.0, -1.0, -2.0], advantages=[0.0, 0.0, 0.5, 0.5])
    (row,) = convert.datums(_body(rl), ImportanceSampling(), LIMITS)
    # Zero-advantage positions carry no importance-sampling loss: weight 0 changes nothing.
    assert row.weights_T == (0.0, 0.0, 1.0, 1.0)
    assert row.sampling_logprobs_T == (0.0, 0.0, -1.0, -2.0)
    assert convert.objective("ppo", {"clip_low_threshold": 0.7}) == PPO(clip_low_threshold=0.7)


@pytest.mark.parametrize(
    ("datum", "loss", "message"),
    [
        (_datum(weights=[1.0, 1.0]), CrossEntropy(), r"shape \[2\]; it must be \[4\]"),
        (_datum(target_tokens=[1, 2, 3, 999]), CrossEntropy(), r"must be in \[0, 258\)"),
        (_datum(advantages=[0.0] * 4), CrossEntropy(), "takes no loss_fn_inputs"),
        (_datum(advantages=[0.1] * 4), ImportanceSampling(), "needs loss_fn_inputs logprobs"),
        (
            _datum(logprobs=[0.0] * 4, advantages=[float("nan")] * 4),
            ImportanceSampling(),
            "NaN",
        ),
        (_datum(300), CrossEntropy(), "beyond this model's context of 256"),
        (wire.DatumIn(np.arange(3), {}), CrossEntropy(), "needs target_tokens"),
    ],
)
def test_bad_data_is_refused_with_what_to_fix(
    datum: wire.DatumIn, loss: CrossEntropy | ImportanceSampling, message: str
) -> None:
    with pytest.raises(UserError, match=message):
        convert.datums(_body(datum), loss, LIMITS)


def test_unknown_losses_and_configs_are_refused() -> None:
    with pytest.raises(UserError, match=r"'gspo' is not supported.*cross_entropy"):
        convert.objective("gspo", None)
    with pytest.raises(UserError, match="no option 'beta'"):
        convert.objective("ppo", {"beta": 0.1})
    with pytest.raises(UserError, match="must be numbers"):
        convert.objective("dro", {"beta": "high"})


def test_sampling_parameters_map_and_refuse() -> None:
    s = convert.sampling(
        wire.SamplingParams(max_tokens=8, stop=["\n"], top_k=-1, seed=3), 10, LIMITS
    )
    assert (s.params.max_new_tokens, s.params.stop, s.params.top_k, s.params.seed) == (
        8,
        ("\n",),
        0,
        3,
    )
    ids = convert.sampling(wire.SamplingParams(stop=[1, 10]), 250, LIMITS)
    assert ids.stop_tokens == {1, 10} and ids.params.max_new_tokens == 7  # to the context end
    assert convert.cut_at_stop([4, 10, 5], ids.stop_tokens) == 2
    with pytest.raises(UserError, match="at most max_tokens=7"):
        convert.sampling(wire.SamplingParams(max_tokens=50), 250, LIMITS)
    with pytest.raises(UserError, match=r"stop=\[\]"):
        convert.sampling(wire.SamplingParams(stop=[]), 10, LIMITS)
    with pytest.raises(UserError, match="top_p"):
        convert.sampling(wire.SamplingParams(top_p=0.0), 10, LIMITS)
    with pytest.raises(UserError, match="type 'image'"):
        convert.prompt_tokens(wire.ModelInputJson(chunks=[{"type": "image", "data": "x"}]))


LLAMA_ROLES = {
    **{n: frozenset({"attention"}) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{n: frozenset({"mlp"}) for n in ("gate_proj", "up_proj", "down_proj")},
}
GPT2_ROLES = {
    "c_attn": frozenset({"attention"}),
    "c_proj": frozenset({"attention", "mlp"}),
    "c_fc": frozenset({"mlp"}),
}


def test_lora_flags_pick_the_projections() -> None:
    attn = convert.lora_spec(wire.LoraConfig(rank=4, train_mlp=False), LLAMA_ROLES)
    assert attn.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert attn.alpha == convert.LORA_ALPHA
    assert convert.lora_flags(attn, LLAMA_ROLES) == {
        "train_attn": True,
        "train_mlp": False,
        "train_unembed": False,
    }
    mlp = convert.lora_spec(wire.LoraConfig(rank=4, train_attn=False), LLAMA_ROLES)
    assert mlp.target_modules == ("gate_proj", "up_proj", "down_proj")
    assert convert.lora_flags(mlp, LLAMA_ROLES)["train_mlp"]
    with pytest.raises(UserError, match="trains no module"):
        convert.lora_spec(wire.LoraConfig(rank=4, train_mlp=False, train_attn=False), LLAMA_ROLES)
    with pytest.raises(UserError, match="rank must be >= 1"):
        convert.lora_spec(wire.LoraConfig(rank=0), LLAMA_ROLES)


def test_lora_flags_follow_the_roles_of_other_architectures() -> None:
    """GPT-2's names: a leaf name shared by attention and MLP layers is trained only
    when both are asked for (a leaf name adapts every layer of that name)."""
    attn = convert.lora_spec(wire.LoraConfig(rank=4, train_mlp=False), GPT2_ROLES)
    assert attn.target_modules == ("c_attn",)
    mlp = convert.lora_spec(wire.LoraConfig(rank=4, train_attn=False), GPT2_ROLES)
    assert mlp.target_modules == ("c_fc",)
    both = convert.lora_spec(wire.LoraConfig(rank=4), GPT2_ROLES)
    assert both.target_modules == ("c_attn", "c_proj", "c_fc")
    assert convert.lora_flags(both, GPT2_ROLES) == {
        "train_attn": True,
        "train_mlp": True,
        "train_unembed": False,
    }
