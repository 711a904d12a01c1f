"""The SDK's protobuf messages, read and written with the SDK's own generated module
(`tinker.proto.tinker_public_pb2`, from the pinned `tinker` package; the extra
`marlaas[tinker]`), never parsed by hand.

- `decode_forward_backward`: a `ForwardBackwardRequest` body (zstd-compressed when
  the SDK says so) into `wire.ForwardBackwardBody`: token ids from the int32 bytes of
  each text chunk, every `loss_fn_inputs` tensor dense (a CSR tensor is expanded with
  0 in the cells it leaves out, as the SDK's own `to_numpy` does).
- `encode_sample`, `encode_forward_backward`: the `SampleResponse` and
  `ForwardBackwardOutput` the SDK decodes from `retrieve_future` (it accepts only
  protobuf for those two).

The module is imported only by the Tinker routes, so marlaas without the extra still
runs; a forward/backward body then answers 501 saying what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from marlaas.service.errors import ServiceError
from marlaas.service.tinker.errors import UserError
from marlaas.service.tinker.wire import DatumIn, ForwardBackwardBody

#: The most a zstd-compressed body may expand to.
MAX_DECOMPRESSED = 256 * 2**20


class ProtobufUnavailable(ServiceError, RuntimeError):
    status_code = 501


def _pb() -> ModuleType:
    try:
        return importlib.import_module("tinker.proto.tinker_public_pb2")
    except ImportError as e:
        raise ProtobufUnavailable(
            "this server cannot read the Tinker SDK's protobuf bodies: install the "
            "`tinker` extra on the server (pip install 'marlaas[tinker]')"
        ) from e


def _dtypes(pb: ModuleType) -> dict[int, np.dtype[Any]]:
    return {
        pb.DTYPE_FLOAT32: np.dtype(np.float32),
        pb.DTYPE_INT64: np.dtype(np.int64),
        pb.DTYPE_INT32: np.dtype(np.int32),
    }


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise UserError(f"Content-Encoding {encoding!r} is not supported; send zstd or none")
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_DECOMPRESSED)
    except zstandard.ZstdError as e:
        raise UserError(f"the zstd body could not be decompressed: {e}") from e


def _tensor(pb: ModuleType, msg: Any, where: str) -> np.ndarray:
    dtype = _dtypes(pb).get(msg.dtype)
    if dtype is None:
        raise UserError(
            f"{where}: tensor dtype {msg.dtype} is not supported; send float32 or int64"
        )
    shape = [int(s) for s in msg.shape]
    try:
        if msg.WhichOneof("encoding") == "sparse_csr":
            csr = msg.sparse_csr
            values = np.frombuffer(csr.values, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
                raise UserError(f"{where}: a sparse tensor needs a 2-D shape and matching indices")
            dense = np.zeros(shape, dtype=dtype)
            rows = np.repeat(np.arange(shape[0]), np.diff(crow))
            dense[rows, col] = values
            return dense
        flat = np.frombuffer(msg.dense, dtype=dtype)
        return flat.reshape(shape) if shape else flat
    except (ValueError, IndexError) as e:
        raise UserError(f"{where}: tensor bytes do not match its shape {shape}: {e}") from e


def _loss_config(msg: Any) -> dict[str, float | str]:
    if len(msg.loss_fn_config_v2):
        out: dict[str, float | str] = {}
        for key, value in msg.loss_fn_config_v2.items():
            out[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
        return out
    return {key: float(value) for key, value in msg.loss_fn_config.items()}


def decode_forward_backward(body: bytes, encoding: str | None = None) -> ForwardBackwardBody:
    """A `ForwardBackwardRequest` as plain records; `UserError` for a malformed body."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(decompress(body, encoding))
    except Exception as e:  # protobuf's DecodeError, or a truncated message
        if isinstance(e, UserError):
            raise
        raise UserError(f"the forward_backward body is not a ForwardBackwardRequest: {e}") from e
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[np.ndarray] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise UserError(
                    f"datum {i}: model_input chunks of type {kind!r} are not supported; "
                    "this server trains on text tokens (EncodedTextChunk) only"
                )
            tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        inputs = {
            name: _tensor(pb, tensor, f"datum {i}, loss_fn_inputs[{name!r}]")
            for name, tensor in datum.loss_fn_inputs.items()
        }
        ids = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
        data.append(DatumIn(tokens=ids, inputs=inputs))
    return ForwardBackwardBody(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_fn_config=_loss_config(msg),
        forward_only=bool(msg.forward_only),
        data=data,
    )


def encode_forward_backward(
    logprobs: Sequence[Sequence[float]] | None, metrics: Mapping[str, float]
) -> bytes:
    """A `ForwardBackwardOutput`: per datum its target log-probs (`loss_fn_outputs[i]
    ["logprobs"]`, float32 `[T]`), in one `ArrayRecord`, and the metrics."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    rows = list(logprobs or [])
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(rows))
    if rows:
        arrays = [np.asarray(r, dtype=np.float32) for r in rows]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
        field = record.fields["logprobs"]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
    return bytes(out.SerializeToString())


def encode_sample(
    sequences: Sequence[tuple[Sequence[int], Sequence[float], str]],
    prompt_logprobs: Sequence[float | None] | None,
) -> bytes:
    """A `SampleResponse`: per sequence its tokens, their log-probs and why it stopped
    (`"stop"` or `"length"`); prompt log-probs with NaN where there is none."""
    pb = _pb()
    stops = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        out.sequences.add(
            stop_reason=stops[stop],
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return bytes(out.SerializeToString())
