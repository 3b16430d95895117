# Provenance: protoc's type stubs for triton_config.proto (see triton_config_pb2.py and README.md here).
# ruff: noqa
# mypy: ignore-errors

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TYPE_INVALID: _ClassVar[DataType]
    TYPE_BOOL: _ClassVar[DataType]
    TYPE_UINT8: _ClassVar[DataType]
    TYPE_UINT16: _ClassVar[DataType]
    TYPE_UINT32: _ClassVar[DataType]
    TYPE_UINT64: _ClassVar[DataType]
    TYPE_INT8: _ClassVar[DataType]
    TYPE_INT16: _ClassVar[DataType]
    TYPE_INT32: _ClassVar[DataType]
    TYPE_INT64: _ClassVar[DataType]
    TYPE_FP16: _ClassVar[DataType]
    TYPE_FP32: _ClassVar[DataType]
    TYPE_FP64: _ClassVar[DataType]
    TYPE_STRING: _ClassVar[DataType]
    TYPE_BF16: _ClassVar[DataType]
TYPE_INVALID: DataType
TYPE_BOOL: DataType
TYPE_UINT8: DataType
TYPE_UINT16: DataType
TYPE_UINT32: DataType
TYPE_UINT64: DataType
TYPE_INT8: DataType
TYPE_INT16: DataType
TYPE_INT32: DataType
TYPE_INT64: DataType
TYPE_FP16: DataType
TYPE_FP32: DataType
TYPE_FP64: DataType
TYPE_STRING: DataType
TYPE_BF16: DataType

class ModelInstanceGroup(_message.Message):
    __slots__ = ("name", "count", "gpus", "kind")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_AUTO: _ClassVar[ModelInstanceGroup.Kind]
        KIND_GPU: _ClassVar[ModelInstanceGroup.Kind]
        KIND_CPU: _ClassVar[ModelInstanceGroup.Kind]
        KIND_MODEL: _ClassVar[ModelInstanceGroup.Kind]
    KIND_AUTO: ModelInstanceGroup.Kind
    KIND_GPU: ModelInstanceGroup.Kind
    KIND_CPU: ModelInstanceGroup.Kind
    KIND_MODEL: ModelInstanceGroup.Kind
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    gpus: _containers.RepeatedScalarFieldContainer[int]
    kind: ModelInstanceGroup.Kind
    def __init__(self, name: _Optional[str] = ..., count: _Optional[int] = ..., gpus: _Optional[_Iterable[int]] = ..., kind: _Optional[_Union[ModelInstanceGroup.Kind, str]] = ...) -> None: ...

class ModelInput(_message.Message):
    __slots__ = ("name", "data_type", "format", "dims")
    class Format(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FORMAT_NONE: _ClassVar[ModelInput.Format]
        FORMAT_NHWC: _ClassVar[ModelInput.Format]
        FORMAT_NCHW: _ClassVar[ModelInput.Format]
    FORMAT_NONE: ModelInput.Format
    FORMAT_NHWC: ModelInput.Format
    FORMAT_NCHW: ModelInput.Format
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_type: DataType
    format: ModelInput.Format
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., data_type: _Optional[_Union[DataType, str]] = ..., format: _Optional[_Union[ModelInput.Format, str]] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelOutput(_message.Message):
    __slots__ = ("name", "data_type", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_type: DataType
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., data_type: _Optional[_Union[DataType, str]] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelDynamicBatching(_message.Message):
    __slots__ = ("max_queue_delay_microseconds",)
    MAX_QUEUE_DELAY_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
    max_queue_delay_microseconds: int
    def __init__(self, max_queue_delay_microseconds: _Optional[int] = ...) -> None: ...

class ModelParameter(_message.Message):
    __slots__ = ("string_value",)
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    string_value: str
    def __init__(self, string_value: _Optional[str] = ...) -> None: ...

class ModelTransactionPolicy(_message.Message):
    __slots__ = ("decoupled",)
    DECOUPLED_FIELD_NUMBER: _ClassVar[int]
    decoupled: bool
    def __init__(self, decoupled: bool = ...) -> None: ...

class ModelEnsembling(_message.Message):
    __slots__ = ("step", "max_inflight_requests")
    class Step(_message.Message):
        __slots__ = ("model_name", "model_version", "input_map", "output_map")
        class InputMapEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: str
            def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
        class OutputMapEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: str
            def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
        MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
        MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
        INPUT_MAP_FIELD_NUMBER: _ClassVar[int]
        OUTPUT_MAP_FIELD_NUMBER: _ClassVar[int]
        model_name: str
        model_version: int
        input_map: _containers.ScalarMap[str, str]
        output_map: _containers.ScalarMap[str, str]
        def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[int] = ..., input_map: _Optional[_Mapping[str, str]] = ..., output_map: _Optional[_Mapping[str, str]] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    step: _containers.RepeatedCompositeFieldContainer[ModelEnsembling.Step]
    max_inflight_requests: int
    def __init__(self, step: _Optional[_Iterable[_Union[ModelEnsembling.Step, _Mapping]]] = ..., max_inflight_requests: _Optional[int] = ...) -> None: ...

class ModelSequenceBatching(_message.Message):
    __slots__ = ("direct", "oldest", "max_sequence_idle_microseconds", "control_input", "state")
    class Control(_message.Message):
        __slots__ = ("kind", "int32_false_true", "fp32_false_true", "data_type", "bool_false_true")
        class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
            __slots__ = ()
            CONTROL_SEQUENCE_START: _ClassVar[ModelSequenceBatching.Control.Kind]
            CONTROL_SEQUENCE_READY: _ClassVar[ModelSequenceBatching.Control.Kind]
            CONTROL_SEQUENCE_END: _ClassVar[ModelSequenceBatching.Control.Kind]
            CONTROL_SEQUENCE_CORRID: _ClassVar[ModelSequenceBatching.Control.Kind]
        CONTROL_SEQUENCE_START: ModelSequenceBatching.Control.Kind
        CONTROL_SEQUENCE_READY: ModelSequenceBatching.Control.Kind
        CONTROL_SEQUENCE_END: ModelSequenceBatching.Control.Kind
        CONTROL_SEQUENCE_CORRID: ModelSequenceBatching.Control.Kind
        KIND_FIELD_NUMBER: _ClassVar[int]
        INT32_FALSE_TRUE_FIELD_NUMBER: _ClassVar[int]
        FP32_FALSE_TRUE_FIELD_NUMBER: _ClassVar[int]
        DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
        BOOL_FALSE_TRUE_FIELD_NUMBER: _ClassVar[int]
        kind: ModelSequenceBatching.Control.Kind
        int32_false_true: _containers.RepeatedScalarFieldContainer[int]
        fp32_false_true: _containers.RepeatedScalarFieldContainer[float]
        data_type: DataType
        bool_false_true: _containers.RepeatedScalarFieldContainer[bool]
        def __init__(self, kind: _Optional[_Union[ModelSequenceBatching.Control.Kind, str]] = ..., int32_false_true: _Optional[_Iterable[int]] = ..., fp32_false_true: _Optional[_Iterable[float]] = ..., data_type: _Optional[_Union[DataType, str]] = ..., bool_false_true: _Optional[_Iterable[bool]] = ...) -> None: ...
    class ControlInput(_message.Message):
        __slots__ = ("name", "control")
        NAME_FIELD_NUMBER: _ClassVar[int]
        CONTROL_FIELD_NUMBER: _ClassVar[int]
        name: str
        control: _containers.RepeatedCompositeFieldContainer[ModelSequenceBatching.Control]
        def __init__(self, name: _Optional[str] = ..., control: _Optional[_Iterable[_Union[ModelSequenceBatching.Control, _Mapping]]] = ...) -> None: ...
    class InitialState(_message.Message):
        __slots__ = ("data_type", "dims", "zero_data", "data_file", "name")
        DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
        DIMS_FIELD_NUMBER: _ClassVar[int]
        ZERO_DATA_FIELD_NUMBER: _ClassVar[int]
        DATA_FILE_FIELD_NUMBER: _ClassVar[int]
        NAME_FIELD_NUMBER: _ClassVar[int]
        data_type: DataType
        dims: _containers.RepeatedScalarFieldContainer[int]
        zero_data: bool
        data_file: str
        name: str
        def __init__(self, data_type: _Optional[_Union[DataType, str]] = ..., dims: _Optional[_Iterable[int]] = ..., zero_data: bool = ..., data_file: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...
    class State(_message.Message):
        __slots__ = ("input_name", "output_name", "data_type", "dims", "initial_state")
        INPUT_NAME_FIELD_NUMBER: _ClassVar[int]
        OUTPUT_NAME_FIELD_NUMBER: _ClassVar[int]
        DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
        DIMS_FIELD_NUMBER: _ClassVar[int]
        INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
        input_name: str
        output_name: str
        data_type: DataType
        dims: _containers.RepeatedScalarFieldContainer[int]
        initial_state: _containers.RepeatedCompositeFieldContainer[ModelSequenceBatching.InitialState]
        def __init__(self, input_name: _Optional[str] = ..., output_name: _Optional[str] = ..., data_type: _Optional[_Union[DataType, str]] = ..., dims: _Optional[_Iterable[int]] = ..., initial_state: _Optional[_Iterable[_Union[ModelSequenceBatching.InitialState, _Mapping]]] = ...) -> None: ...
    class StrategyDirect(_message.Message):
        __slots__ = ("max_queue_delay_microseconds",)
        MAX_QUEUE_DELAY_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
        max_queue_delay_microseconds: int
        def __init__(self, max_queue_delay_microseconds: _Optional[int] = ...) -> None: ...
    class StrategyOldest(_message.Message):
        __slots__ = ("max_candidate_sequences", "preferred_batch_size", "max_queue_delay_microseconds", "preserve_ordering")
        MAX_CANDIDATE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
        PREFERRED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
        MAX_QUEUE_DELAY_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
        PRESERVE_ORDERING_FIELD_NUMBER: _ClassVar[int]
        max_candidate_sequences: int
        preferred_batch_size: _containers.RepeatedScalarFieldContainer[int]
        max_queue_delay_microseconds: int
        preserve_ordering: bool
        def __init__(self, max_candidate_sequences: _Optional[int] = ..., preferred_batch_size: _Optional[_Iterable[int]] = ..., max_queue_delay_microseconds: _Optional[int] = ..., preserve_ordering: bool = ...) -> None: ...
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_IDLE_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_INPUT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    direct: ModelSequenceBatching.StrategyDirect
    oldest: ModelSequenceBatching.StrategyOldest
    max_sequence_idle_microseconds: int
    control_input: _containers.RepeatedCompositeFieldContainer[ModelSequenceBatching.ControlInput]
    state: _containers.RepeatedCompositeFieldContainer[ModelSequenceBatching.State]
    def __init__(self, direct: _Optional[_Union[ModelSequenceBatching.StrategyDirect, _Mapping]] = ..., oldest: _Optional[_Union[ModelSequenceBatching.StrategyOldest, _Mapping]] = ..., max_sequence_idle_microseconds: _Optional[int] = ..., control_input: _Optional[_Iterable[_Union[ModelSequenceBatching.ControlInput, _Mapping]]] = ..., state: _Optional[_Iterable[_Union[ModelSequenceBatching.State, _Mapping]]] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("name", "platform", "max_batch_size", "input", "output", "instance_group", "dynamic_batching", "sequence_batching", "ensemble_scheduling", "parameters", "backend", "model_transaction_policy")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ModelParameter
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ModelParameter, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_GROUP_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_BATCHING_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_BATCHING_FIELD_NUMBER: _ClassVar[int]
    ENSEMBLE_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_TRANSACTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    name: str
    platform: str
    max_batch_size: int
    input: _containers.RepeatedCompositeFieldContainer[ModelInput]
    output: _containers.RepeatedCompositeFieldContainer[ModelOutput]
    instance_group: _containers.RepeatedCompositeFieldContainer[ModelInstanceGroup]
    dynamic_batching: ModelDynamicBatching
    sequence_batching: ModelSequenceBatching
    ensemble_scheduling: ModelEnsembling
    parameters: _containers.MessageMap[str, ModelParameter]
    backend: str
    model_transaction_policy: ModelTransactionPolicy
    def __init__(self, name: _Optional[str] = ..., platform: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., input: _Optional[_Iterable[_Union[ModelInput, _Mapping]]] = ..., output: _Optional[_Iterable[_Union[ModelOutput, _Mapping]]] = ..., instance_group: _Optional[_Iterable[_Union[ModelInstanceGroup, _Mapping]]] = ..., dynamic_batching: _Optional[_Union[ModelDynamicBatching, _Mapping]] = ..., sequence_batching: _Optional[_Union[ModelSequenceBatching, _Mapping]] = ..., ensemble_scheduling: _Optional[_Union[ModelEnsembling, _Mapping]] = ..., parameters: _Optional[_Mapping[str, ModelParameter]] = ..., backend: _Optional[str] = ..., model_transaction_policy: _Optional[_Union[ModelTransactionPolicy, _Mapping]] = ...) -> None: ...

class ModelConfigRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class ModelConfigResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: ModelConfig
    def __init__(self, config: _Optional[_Union[ModelConfig, _Mapping]] = ...) -> None: ...

class StatisticDuration(_message.Message):
    __slots__ = ("count", "ns")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NS_FIELD_NUMBER: _ClassVar[int]
    count: int
    ns: int
    def __init__(self, count: _Optional[int] = ..., ns: _Optional[int] = ...) -> None: ...

class InferStatistics(_message.Message):
    __slots__ = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FAIL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    success: StatisticDuration
    fail: StatisticDuration
    queue: StatisticDuration
    compute_input: StatisticDuration
    compute_infer: StatisticDuration
    compute_output: StatisticDuration
    cache_hit: StatisticDuration
    cache_miss: StatisticDuration
    def __init__(self, success: _Optional[_Union[StatisticDuration, _Mapping]] = ..., fail: _Optional[_Union[StatisticDuration, _Mapping]] = ..., queue: _Optional[_Union[StatisticDuration, _Mapping]] = ..., compute_input: _Optional[_Union[StatisticDuration, _Mapping]] = ..., compute_infer: _Optional[_Union[StatisticDuration, _Mapping]] = ..., compute_output: _Optional[_Union[StatisticDuration, _Mapping]] = ..., cache_hit: _Optional[_Union[StatisticDuration, _Mapping]] = ..., cache_miss: _Optional[_Union[StatisticDuration, _Mapping]] = ...) -> None: ...

class InferBatchStatistics(_message.Message):
    __slots__ = ("batch_size", "compute_input", "compute_infer", "compute_output")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    compute_input: StatisticDuration
    compute_infer: StatisticDuration
    compute_output: StatisticDuration
    def __init__(self, batch_size: _Optional[int] = ..., compute_input: _Optional[_Union[StatisticDuration, _Mapping]] = ..., compute_infer: _Optional[_Union[StatisticDuration, _Mapping]] = ..., compute_output: _Optional[_Union[StatisticDuration, _Mapping]] = ...) -> None: ...

class InferResponseStatistics(_message.Message):
    __slots__ = ("compute_infer", "compute_output", "success", "fail", "empty_response", "cancel")
    COMPUTE_INFER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FAIL_FIELD_NUMBER: _ClassVar[int]
    EMPTY_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    compute_infer: StatisticDuration
    compute_output: StatisticDuration
    success: StatisticDuration
    fail: StatisticDuration
    empty_response: StatisticDuration
    cancel: StatisticDuration
    def __init__(self, compute_infer: _Optional[_Union[StatisticDuration, _Mapping]] = ..., compute_output: _Optional[_Union[StatisticDuration, _Mapping]] = ..., success: _Optional[_Union[StatisticDuration, _Mapping]] = ..., fail: _Optional[_Union[StatisticDuration, _Mapping]] = ..., empty_response: _Optional[_Union[StatisticDuration, _Mapping]] = ..., cancel: _Optional[_Union[StatisticDuration, _Mapping]] = ...) -> None: ...

class ModelStatistics(_message.Message):
    __slots__ = ("name", "version", "last_inference", "inference_count", "execution_count", "inference_stats", "batch_stats", "response_stats")
    class ResponseStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: InferResponseStatistics
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[InferResponseStatistics, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_INFERENCE_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_STATS_FIELD_NUMBER: _ClassVar[int]
    BATCH_STATS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_STATS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    last_inference: int
    inference_count: int
    execution_count: int
    inference_stats: InferStatistics
    batch_stats: _containers.RepeatedCompositeFieldContainer[InferBatchStatistics]
    response_stats: _containers.MessageMap[str, InferResponseStatistics]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., last_inference: _Optional[int] = ..., inference_count: _Optional[int] = ..., execution_count: _Optional[int] = ..., inference_stats: _Optional[_Union[InferStatistics, _Mapping]] = ..., batch_stats: _Optional[_Iterable[_Union[InferBatchStatistics, _Mapping]]] = ..., response_stats: _Optional[_Mapping[str, InferResponseStatistics]] = ...) -> None: ...

class ModelStatisticsRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class ModelStatisticsResponse(_message.Message):
    __slots__ = ("model_stats",)
    MODEL_STATS_FIELD_NUMBER: _ClassVar[int]
    model_stats: _containers.RepeatedCompositeFieldContainer[ModelStatistics]
    def __init__(self, model_stats: _Optional[_Iterable[_Union[ModelStatistics, _Mapping]]] = ...) -> None: ...
