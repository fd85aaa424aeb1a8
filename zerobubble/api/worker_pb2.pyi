from zerobubble.api import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("spec", "num_prompt_tokens", "grammar", "prediction_token_ids")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    spec: _generate_pb2.RequestSpec
    num_prompt_tokens: int
    grammar: str
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, spec: _Optional[_Union[_generate_pb2.RequestSpec, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., grammar: _Optional[str] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanRows(_message.Message):
    __slots__ = ("req_ids", "num_tokens", "token_ids", "num_draft_slots", "num_new_blocks", "new_block_ids", "unsampled_rows", "new_rows", "num_cached_tokens", "sampling")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    UNSAMPLED_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEW_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_slots: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    unsampled_rows: _containers.RepeatedScalarFieldContainer[int]
    new_rows: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _containers.RepeatedCompositeFieldContainer[SamplingParams]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_draft_slots: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., unsampled_rows: _Optional[_Iterable[int]] = ..., new_rows: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Iterable[_Union[SamplingParams, _Mapping]]] = ...) -> None: ...

class Continuations(_message.Message):
    __slots__ = ("req_ids", "anchors", "num_tokens", "token_ids")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ANCHORS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    anchors: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., anchors: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "rows", "finished_req_ids", "continuations")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rows: PlanRows
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    continuations: Continuations
    def __init__(self, step_id: _Optional[int] = ..., rows: _Optional[_Union[PlanRows, _Mapping]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., continuations: _Optional[_Union[Continuations, _Mapping]] = ...) -> None: ...

class ResultRows(_message.Message):
    __slots__ = ("req_ids", "num_tokens", "token_ids", "num_draft_tokens", "prediction_drafts", "logprob_rows", "logprobs", "top_logprob_rows", "num_top_logprobs", "top_token_ids", "top_logprobs", "error_rows", "errors")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_ROWS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    prediction_drafts: _containers.RepeatedScalarFieldContainer[bool]
    logprob_rows: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprob_rows: _containers.RepeatedScalarFieldContainer[int]
    num_top_logprobs: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    error_rows: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., prediction_drafts: _Optional[_Iterable[bool]] = ..., logprob_rows: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprob_rows: _Optional[_Iterable[int]] = ..., num_top_logprobs: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., error_rows: _Optional[_Iterable[int]] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "rows", "forward_s", "idle_s", "accepted_per_pos", "num_tokens", "error", "draining", "grammar_s", "collective_s")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_S_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_S_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rows: ResultRows
    forward_s: float
    idle_s: float
    accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    error: str
    draining: bool
    grammar_s: float
    collective_s: float
    def __init__(self, step_id: _Optional[int] = ..., rows: _Optional[_Union[ResultRows, _Mapping]] = ..., forward_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., accepted_per_pos: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., error: _Optional[str] = ..., draining: bool = ..., grammar_s: _Optional[float] = ..., collective_s: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model", "max_model_len", "block_size", "num_blocks", "vocab_size", "eos_token_ids", "tokenizer_json", "chat_template", "bos_token", "eos_token", "spec_method", "num_spec_tokens", "device", "dtype", "max_num_seqs", "num_lookahead_slots", "num_prediction_tokens", "tensor_parallel_size", "sliding_window")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPEC_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    spec_method: str
    num_spec_tokens: int
    device: str
    dtype: str
    max_num_seqs: int
    num_lookahead_slots: int
    num_prediction_tokens: int
    tensor_parallel_size: int
    sliding_window: int
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., spec_method: _Optional[str] = ..., num_spec_tokens: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., num_lookahead_slots: _Optional[int] = ..., num_prediction_tokens: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., sliding_window: _Optional[int] = ...) -> None: ...
