# Provenance of this generated stub (everything below the blank line is protoc's output, unchanged):
#   proto:    triton_shm.proto in this folder (our own); see triton_shm_pb2.py and README.md here.
# ruff: noqa
# mypy: ignore-errors

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SystemSharedMemoryStatusRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SystemSharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions",)
    class RegionStatus(_message.Message):
        __slots__ = ("name", "key", "offset", "byte_size")
        NAME_FIELD_NUMBER: _ClassVar[int]
        KEY_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
        name: str
        key: str
        offset: int
        byte_size: int
        def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...
    class RegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SystemSharedMemoryStatusResponse.RegionStatus
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SystemSharedMemoryStatusResponse.RegionStatus, _Mapping]] = ...) -> None: ...
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.MessageMap[str, SystemSharedMemoryStatusResponse.RegionStatus]
    def __init__(self, regions: _Optional[_Mapping[str, SystemSharedMemoryStatusResponse.RegionStatus]] = ...) -> None: ...

class SystemSharedMemoryRegisterRequest(_message.Message):
    __slots__ = ("name", "key", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class SystemSharedMemoryRegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SystemSharedMemoryUnregisterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SystemSharedMemoryUnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CudaSharedMemoryStatusRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CudaSharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions",)
    class RegionStatus(_message.Message):
        __slots__ = ("name", "device_id", "byte_size")
        NAME_FIELD_NUMBER: _ClassVar[int]
        DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
        BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
        name: str
        device_id: int
        byte_size: int
        def __init__(self, name: _Optional[str] = ..., device_id: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...
    class RegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CudaSharedMemoryStatusResponse.RegionStatus
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[CudaSharedMemoryStatusResponse.RegionStatus, _Mapping]] = ...) -> None: ...
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.MessageMap[str, CudaSharedMemoryStatusResponse.RegionStatus]
    def __init__(self, regions: _Optional[_Mapping[str, CudaSharedMemoryStatusResponse.RegionStatus]] = ...) -> None: ...

class CudaSharedMemoryRegisterRequest(_message.Message):
    __slots__ = ("name", "raw_handle", "device_id", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RAW_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    raw_handle: bytes
    device_id: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., raw_handle: _Optional[bytes] = ..., device_id: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class CudaSharedMemoryRegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CudaSharedMemoryUnregisterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CudaSharedMemoryUnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
