"""The few TensorFlow protocol buffer messages a checkpoint index holds, without TensorFlow.

They are declared here as a ``FileDescriptorProto`` built in code (no generated modules are
vendored) and instantiated by the ``protobuf`` runtime, in a descriptor pool of their own so
they never clash with TensorFlow's generated classes when both are loaded in one process.
Field numbers and types follow TensorFlow's ``tensor_bundle.proto``, ``tensor_shape.proto``,
``tensor_slice.proto``, ``versions.proto`` and ``trackable_object_graph.proto``; fields a
reader does not need are left out (protobuf skips unknown fields). ``DataType`` enums are
declared as ``int32``, which has the same wire encoding, so every TF dtype number parses.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_OPTIONAL, _REPEATED = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
_PACKAGE = "weightstore.tf"


def _message(name: str, fields: list[tuple], nested: Sequence[descriptor_pb2.DescriptorProto] = (),
             oneofs: tuple[str, ...] = ()) -> descriptor_pb2.DescriptorProto:
    """A message type; each field is ``(name, number, type, label[, type name[, oneof index]])``."""
    message = descriptor_pb2.DescriptorProto(name=name)
    message.nested_type.extend(nested)
    for oneof in oneofs:
        message.oneof_decl.add(name=oneof)
    for field_name, number, kind, label, *rest in fields:
        field = message.field.add(name=field_name, number=number, type=kind, label=label)
        if rest and rest[0]:
            field.type_name = rest[0]
        if len(rest) > 1:
            field.oneof_index = rest[1]
    return message


def _file() -> descriptor_pb2.FileDescriptorProto:
    p = f".{_PACKAGE}."
    proto = descriptor_pb2.FileDescriptorProto(name="weightstore/tf_checkpoint.proto", package=_PACKAGE,
                                               syntax="proto3")
    dim = _message("Dim", [("size", 1, _F.TYPE_INT64, _OPTIONAL), ("name", 2, _F.TYPE_STRING, _OPTIONAL)])
    proto.message_type.append(_message("TensorShapeProto", [
        ("dim", 2, _F.TYPE_MESSAGE, _REPEATED, p + "TensorShapeProto.Dim"),
        ("unknown_rank", 3, _F.TYPE_BOOL, _OPTIONAL),
    ], [dim]))
    extent = _message("Extent", [
        ("start", 1, _F.TYPE_INT64, _OPTIONAL),
        ("length", 2, _F.TYPE_INT64, _OPTIONAL, None, 0),
    ], oneofs=("has_length",))
    proto.message_type.append(_message("TensorSliceProto", [
        ("extent", 1, _F.TYPE_MESSAGE, _REPEATED, p + "TensorSliceProto.Extent"),
    ], [extent]))
    proto.message_type.append(_message("VersionDef", [
        ("producer", 1, _F.TYPE_INT32, _OPTIONAL),
        ("min_consumer", 2, _F.TYPE_INT32, _OPTIONAL),
        ("bad_consumers", 3, _F.TYPE_INT32, _REPEATED),
    ]))
    proto.message_type.append(_message("BundleHeaderProto", [
        ("num_shards", 1, _F.TYPE_INT32, _OPTIONAL),
        ("endianness", 2, _F.TYPE_INT32, _OPTIONAL),  # LITTLE = 0, BIG = 1
        ("version", 3, _F.TYPE_MESSAGE, _OPTIONAL, p + "VersionDef"),
    ]))
    proto.message_type.append(_message("BundleEntryProto", [
        ("dtype", 1, _F.TYPE_INT32, _OPTIONAL),
        ("shape", 2, _F.TYPE_MESSAGE, _OPTIONAL, p + "TensorShapeProto"),
        ("shard_id", 3, _F.TYPE_INT32, _OPTIONAL),
        ("offset", 4, _F.TYPE_INT64, _OPTIONAL),
        ("size", 5, _F.TYPE_INT64, _OPTIONAL),
        ("crc32c", 6, _F.TYPE_FIXED32, _OPTIONAL),
        ("slices", 7, _F.TYPE_MESSAGE, _REPEATED, p + "TensorSliceProto"),
    ]))
    trackable = p + "TrackableObjectGraph.TrackableObject."
    proto.message_type.append(_message("TrackableObjectGraph", [
        ("nodes", 1, _F.TYPE_MESSAGE, _REPEATED, p + "TrackableObjectGraph.TrackableObject"),
    ], [_message("TrackableObject", [
        ("children", 1, _F.TYPE_MESSAGE, _REPEATED, trackable + "ObjectReference"),
        ("attributes", 2, _F.TYPE_MESSAGE, _REPEATED, trackable + "SerializedTensor"),
        ("slot_variables", 3, _F.TYPE_MESSAGE, _REPEATED, trackable + "SlotVariableReference"),
    ], [
        _message("ObjectReference", [("node_id", 1, _F.TYPE_INT32, _OPTIONAL),
                                     ("local_name", 2, _F.TYPE_STRING, _OPTIONAL)]),
        _message("SerializedTensor", [("name", 1, _F.TYPE_STRING, _OPTIONAL),
                                      ("full_name", 2, _F.TYPE_STRING, _OPTIONAL),
                                      ("checkpoint_key", 3, _F.TYPE_STRING, _OPTIONAL)]),
        _message("SlotVariableReference", [("original_variable_node_id", 1, _F.TYPE_INT32, _OPTIONAL),
                                           ("slot_name", 2, _F.TYPE_STRING, _OPTIONAL),
                                           ("slot_variable_node_id", 3, _F.TYPE_INT32, _OPTIONAL)]),
    ])]))
    return proto


_pool = descriptor_pool.DescriptorPool()
_pool.Add(_file())


def _class(name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


BundleHeaderProto = _class("BundleHeaderProto")
BundleEntryProto = _class("BundleEntryProto")
TrackableObjectGraph = _class("TrackableObjectGraph")
