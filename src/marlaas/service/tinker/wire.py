"""Wire schemas of the Tinker-compatible API: the JSON bodies the `tinker` SDK (0.38)
sends and the answers it validates, separate from marlaas's records (`convert` turns
them into those). Field names and defaults are the SDK's.

Requests ignore fields they do not know (the SDK adds fields over time, with defaults
that keep old behaviour); fields that ask for something marlaas does not do are
declared here so that `convert` can refuse them by name instead of ignoring them.

`forward_backward` bodies are protobuf, not JSON: `protobuf` decodes them into the
plain records at the end of this module (`ForwardBackwardBody`), which a JSON body
(`ForwardBackwardJson`) also converts to.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class WireIn(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class WireOut(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# -- sessions and configuration -------------------------------------------------------


class ClientConfigRequest(WireIn):
    sdk_version: str = ""


class ClientConfigResponse(WireOut):
    """The SDK's feature flags, as this server wants them (see `routes.client_config`)."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    parallel_fwdbwd_chunks: bool = True
    proto_compress_fwdbwd: bool = False
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes_count: int
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False


class CreateSessionRequest(WireIn):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class CreateSessionResponse(WireOut):
    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatRequest(WireIn):
    session_id: str


class SessionFinishRequest(WireIn):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class FutureRetrieveRequest(WireIn):
    request_id: str
    allow_metadata_only: bool = False


class CancelFutureRequest(WireIn):
    request_id: str


class UntypedFuture(WireOut):
    """What every asynchronous call answers at once."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


# -- models ---------------------------------------------------------------------------


class LoraConfig(WireIn):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(WireIn):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModelRequest(WireIn):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)


class GetInfoRequest(WireIn):
    model_id: str


class SupportedModel(WireOut):
    model_name: str
    max_context_length: int
    trainable: bool = True
    sampleable: bool = True


class ServerCapabilities(WireOut):
    supported_models: list[SupportedModel]


class ModelData(WireOut):
    arch: str | None
    model_name: str
    tokenizer_id: str | None


class GetInfoResponse(WireOut):
    type: Literal["get_info"] = "get_info"
    model_data: ModelData
    model_id: str
    is_lora: bool = True
    lora_rank: int
    model_name: str


# -- training -------------------------------------------------------------------------


class AdamParams(WireIn):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepRequest(WireIn):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(WireIn):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerRequest(WireIn):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsRequest(WireIn):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None


class TensorJson(WireIn):
    """`TensorData` in JSON: flattened values, a dtype, a shape, optional CSR indices."""

    data: list[float] | list[int]
    dtype: Literal["float32", "int64"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class ModelInputJson(WireIn):
    chunks: list[dict[str, Any]]


class DatumJson(WireIn):
    model_input: ModelInputJson
    loss_fn_inputs: dict[str, TensorJson] = Field(default_factory=dict)


class ForwardBackwardInputJson(WireIn):
    data: list[DatumJson]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardJson(WireIn):
    """A `forward_backward` body sent as JSON (the SDK sends protobuf)."""

    forward_backward_input: ForwardBackwardInputJson
    model_id: str
    seq_id: int | None = None
    forward_only: bool = False


# -- sampling -------------------------------------------------------------------------


class CreateSamplingSessionRequest(WireIn):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class CreateSamplingSessionResponse(WireOut):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class GetSamplerResponse(WireOut):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class SamplingParams(WireIn):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleRequest(WireIn):
    num_samples: int = 1
    prompt: ModelInputJson
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


# -- training runs and checkpoints (REST) ---------------------------------------------


class CheckpointOut(WireOut):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class CheckpointsListResponse(WireOut):
    checkpoints: list[CheckpointOut]
    cursor: dict[str, int] | None = None


class TrainingRunOut(WireOut):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int
    last_request_time: datetime
    last_checkpoint: CheckpointOut | None = None
    last_sampler_checkpoint: CheckpointOut | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(WireOut):
    training_runs: list[TrainingRunOut]
    cursor: dict[str, int]


class WeightsInfoRequest(WireIn):
    tinker_path: str


class WeightsInfoResponse(WireOut):
    base_model: str
    is_lora: bool = True
    lora_rank: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool


# -- decoded forward/backward bodies --------------------------------------------------


@dataclass(frozen=True)
class DatumIn:
    """One datum of a forward/backward body: the model input's tokens and each
    `loss_fn_inputs` tensor, dense (CSR tensors already expanded), by name."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class ForwardBackwardBody:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[DatumIn]
