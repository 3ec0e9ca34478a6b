from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ShipRequest(_message.Message):
    __slots__ = ("job", "shard", "epoch", "shipment", "primary", "states", "base")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHIPMENT_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    job: str
    shard: int
    epoch: int
    shipment: int
    primary: str
    states: _containers.RepeatedScalarFieldContainer[bytes]
    base: int
    def __init__(self, job: _Optional[str] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., shipment: _Optional[int] = ..., primary: _Optional[str] = ..., states: _Optional[_Iterable[bytes]] = ..., base: _Optional[int] = ...) -> None: ...

class ShipReply(_message.Message):
    __slots__ = ("epoch", "shipment")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHIPMENT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    shipment: int
    def __init__(self, epoch: _Optional[int] = ..., shipment: _Optional[int] = ...) -> None: ...
