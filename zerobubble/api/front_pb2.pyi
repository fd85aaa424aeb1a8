from zerobubble.api import generate_pb2 as _generate_pb2
from zerobubble.api import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Submit(_message.Message):
    __slots__ = ("tag", "request", "tokenized_for", "front_detokenizes")
    TAG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZED_FOR_FIELD_NUMBER: _ClassVar[int]
    FRONT_DETOKENIZES_FIELD_NUMBER: _ClassVar[int]
    tag: int
    request: _generate_pb2.GenerateRequest
    tokenized_for: str
    front_detokenizes: bool
    def __init__(self, tag: _Optional[int] = ..., request: _Optional[_Union[_generate_pb2.GenerateRequest, _Mapping]] = ..., tokenized_for: _Optional[str] = ..., front_detokenizes: bool = ...) -> None: ...

class Stopped(_message.Message):
    __slots__ = ("tag", "index", "num_output_tokens")
    TAG_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tag: int
    index: int
    num_output_tokens: int
    def __init__(self, tag: _Optional[int] = ..., index: _Optional[int] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class FrontLoad(_message.Message):
    __slots__ = ("name", "cpu_seconds", "num_calls")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CALLS_FIELD_NUMBER: _ClassVar[int]
    name: str
    cpu_seconds: float
    num_calls: int
    def __init__(self, name: _Optional[str] = ..., cpu_seconds: _Optional[float] = ..., num_calls: _Optional[int] = ...) -> None: ...

class FrontMessage(_message.Message):
    __slots__ = ("submit", "cancel", "ttft_s", "e2e_s", "stopped", "load", "reads_plain")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    READS_PLAIN_FIELD_NUMBER: _ClassVar[int]
    submit: _containers.RepeatedCompositeFieldContainer[Submit]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    ttft_s: _containers.RepeatedScalarFieldContainer[float]
    e2e_s: _containers.RepeatedScalarFieldContainer[float]
    stopped: _containers.RepeatedCompositeFieldContainer[Stopped]
    load: FrontLoad
    reads_plain: bool
    def __init__(self, submit: _Optional[_Iterable[_Union[Submit, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ..., ttft_s: _Optional[_Iterable[float]] = ..., e2e_s: _Optional[_Iterable[float]] = ..., stopped: _Optional[_Iterable[_Union[Stopped, _Mapping]]] = ..., load: _Optional[_Union[FrontLoad, _Mapping]] = ..., reads_plain: bool = ...) -> None: ...

class TaggedResponse(_message.Message):
    __slots__ = ("tag", "response", "num_plain_before")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    NUM_PLAIN_BEFORE_FIELD_NUMBER: _ClassVar[int]
    tag: int
    response: _generate_pb2.GenerateResponse
    num_plain_before: int
    def __init__(self, tag: _Optional[int] = ..., response: _Optional[_Union[_generate_pb2.GenerateResponse, _Mapping]] = ..., num_plain_before: _Optional[int] = ...) -> None: ...

class PlainReplies(_message.Message):
    __slots__ = ("tags", "indexes", "num_tokens", "token_ids", "num_output_tokens")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    INDEXES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[int]
    indexes: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tags: _Optional[_Iterable[int]] = ..., indexes: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_output_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("tag", "code", "message")
    TAG_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    tag: int
    code: int
    message: str
    def __init__(self, tag: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EngineMessage(_message.Message):
    __slots__ = ("replies", "refused", "done", "accepted", "plain")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PLAIN_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[TaggedResponse]
    refused: _containers.RepeatedCompositeFieldContainer[Refusal]
    done: _containers.RepeatedScalarFieldContainer[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    plain: PlainReplies
    def __init__(self, replies: _Optional[_Iterable[_Union[TaggedResponse, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[Refusal, _Mapping]]] = ..., done: _Optional[_Iterable[int]] = ..., accepted: _Optional[_Iterable[int]] = ..., plain: _Optional[_Union[PlainReplies, _Mapping]] = ...) -> None: ...
