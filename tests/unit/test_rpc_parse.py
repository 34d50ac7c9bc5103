"""The request deserializer's wire-type check inside repeated and map sub-messages.

The service's own requests hold only singular Durations (their cases run over
a real channel in tests/integration/test_contract_wire_types.py); here
``google.protobuf.Struct`` (a map of Value, a Value holding a repeated
ListValue) shows that the walk reaches every kind of sub-message.
"""

from __future__ import annotations

from google.protobuf import struct_pb2

from leasekeeper_server.rpc.handling import MalformedRequest, parse_or_malformed

parse = parse_or_malformed(struct_pb2.Struct)


def _len(number: int, payload: bytes) -> bytes:
    assert number < 16 and len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def _with_entry(key: bytes, value: bytes) -> bytes:
    """A valid Struct followed by one more map entry (Struct.fields is field 1)."""
    good = struct_pb2.Struct()
    good.update({"a": 1.5, "l": [1.0, "x"]})
    return good.SerializeToString() + _len(1, _len(1, key) + _len(2, value))


def test_map_value_field_with_wrong_wire_type_names_its_path():
    body = _with_entry(b"b", b"\x10\x05")  # Value.number_value (2, a double) as a varint

    parsed = parse(body)

    assert isinstance(parsed, MalformedRequest)
    assert parsed.field == "fields.number_value"
    assert "wire type 0 (varint)" in parsed.error and "double" in parsed.error


def test_repeated_item_field_with_wrong_wire_type_names_its_path():
    item = b"\x18\x05"  # Value.string_value (3) as a varint, inside ListValue.values (1)
    body = _with_entry(b"c", _len(6, _len(1, item)))  # Value.list_value is 6

    parsed = parse(body)

    assert isinstance(parsed, MalformedRequest)
    assert parsed.field == "fields.list_value.values.string_value"


def test_undeclared_numbers_at_every_depth_are_accepted():
    field_999 = b"\xb8\x3e\x01"  # a varint, as a newer message might declare it
    body = _with_entry(b"d", field_999) + field_999

    parsed = parse(body)

    assert isinstance(parsed, struct_pb2.Struct)
    assert sorted(parsed.fields) == ["a", "d", "l"]
